"""The host strategies on the CPU: `cpu` and `hybrid` generate what `gpu` generates, for each
family, in float32 (the reference computes the host's routes) and bfloat16 (the compiled host
kernel, gpt-oss's biased, clamped experts too), and on fp8, int4 and mxfp4 experts (the kernel reads them as stored); the device-side
split gives the host exactly its share of a step's misses; flags and statistics."""
from dataclasses import replace

import pytest
import torch

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError
from moeferry.moe.host_speeds import ChannelSpeeds
from tests.support.fixtures import family_configs, make_checkpoint

FAMILIES = family_configs()
PROMPTS = [[5, 17, 33, 2, 9, 71, 40], [88, 3], [12, 60, 61, 62, 7, 1, 90, 45, 23, 30, 31, 8, 19]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def tokens(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_and_hybrid_generate_what_gpu_generates(family_ckpt, dtype):
    """A bf16 model's host routes run in the compiled kernel, every family's experts (gpt-oss's
    biases and clamped SwiGLU too); a float32 model's through the reference."""
    from moeferry.kernels.fused_moe import host as host_kernel

    path, experts = family_ckpt
    want = tokens(LLM(path, dtype=dtype, device="cpu"))
    cpu = LLM(path, dtype=dtype, device="cpu", moe_strategy="cpu")
    assert cpu.engine.runner.strategy.host.channel.compiled == (dtype == "bfloat16")
    calls = host_kernel.timing()["calls"]
    assert tokens(cpu) == want
    assert cpu.engine.runner.strategy.stats()["host_experts"] > 0
    assert (host_kernel.timing()["calls"] > calls) == (dtype == "bfloat16")
    hybrid = LLM(path, dtype=dtype, device="cpu", moe_strategy="hybrid", moe_cache_slots=experts,
                 moe_host_share=0.5, moe_collect_stats=True)
    assert hybrid.engine.runner.strategy.host.channel.compiled == (dtype == "bfloat16")
    assert tokens(hybrid) == want
    stats = hybrid.engine.runner.strategy.stats()
    assert stats["host_experts"] > 0 and stats["decode"]["total"]["misses"] > 0  # both channels carried experts


def test_the_share_balances_the_two_channels():
    assert ChannelSpeeds(55e9, 65e9).host_share == pytest.approx(65 / 120)
    assert ChannelSpeeds(55e9, 65e9, share=0.1).host_share == 0.1
    assert ChannelSpeeds(0.0, 0.0).host_share == 0.0
    # with a fixed cost per call, n misses split so that both channels end together
    speeds = ChannelSpeeds(50e9, 100e9, host_call_s=200e-6, expert_bytes=10**7)
    t_copy, t_host = 1e7 / 50e9, 1e7 / 100e9
    for misses in (1, 2, 6, 20):
        host = max(0, int(misses * speeds.host_share - speeds.host_offset + 0.5))
        best = min(range(misses + 1), key=lambda h: max(h * t_host + (200e-6 if h else 0), (misses - h) * t_copy))
        assert abs(host - best) <= 1


@pytest.mark.parametrize("options, message", [
    (dict(moe_strategy="offload", moe_host_threads=4), "--moe-host-threads is read only by --moe-strategy hybrid or cpu"),
    (dict(moe_strategy="cpu", moe_host_share=0.5), "--moe-host-share is read only by --moe-strategy hybrid"),
    (dict(moe_strategy="cpu", moe_cache_slots=8), "--moe-cache-slots is read only by --moe-strategy offload or hybrid"),
    (dict(moe_strategy="hybrid", moe_host_share=1.5), "--moe-host-share"),
])
def test_host_flags_are_refused_where_nothing_reads_them(options, message, monkeypatch):
    import moeferry.default_model

    monkeypatch.setattr(moeferry.default_model, "ensure_default_model", lambda: pytest.fail("a model was made"))
    with pytest.raises(ConfigError, match=message):
        LLM(device="cpu", **options)


def test_cpu_prefill_streams_long_chunks_and_computes_short_ones_on_the_host(family_ckpt):
    path, _ = family_ckpt
    llm = LLM(path, dtype="float32", device="cpu", moe_strategy="cpu")
    strategy = llm.engine.runner.strategy
    want = tokens(LLM(path, dtype="float32", device="cpu"))
    assert tokens(llm) == want
    assert strategy.stats()["prefill_chunks"]["stream"] > 0  # the default: every chunk streamed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_and_hybrid_compute_quantized_experts_as_gpu_does(quantized_ckpt, dtype):
    """Decode steps through the host channel: a bf16 model's quantized experts in the compiled
    kernel (on this machine `gpu` runs the same kernel: the same bits), a float32 model's
    through the reference (each step's top log-probs within 1e-5 of `gpu`'s reference path); the
    exact host path (--moe-host-activations bf16), the int8 one having its own test."""
    from moeferry.kernels.fused_moe import host as host_kernel

    path, options, experts = quantized_ckpt
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run(llm):
        outs = llm.generate(PROMPTS, params)
        return [o.token_ids for o in outs], [[[v for _, v in lp.top] for lp in o.logprobs] for o in outs]

    want_tokens, want_top = run(LLM(path, dtype=dtype, device="cpu", **options))
    for strategy, kwargs in (("cpu", {}), ("hybrid", dict(moe_cache_slots=experts, moe_host_share=0.5,
                                                           moe_collect_stats=True))):
        llm = LLM(path, dtype=dtype, device="cpu", moe_strategy=strategy, moe_host_activations="bf16", **options,
                  **kwargs)
        channel = llm.engine.runner.strategy.host.channel
        assert channel.compiled == (dtype == "bfloat16")
        calls = host_kernel.timing()["calls"]
        got_tokens, got_top = run(llm)
        assert got_tokens == want_tokens, strategy
        got, want = torch.tensor(got_top), torch.tensor(want_top)
        if dtype == "float32":
            assert (got - want).abs().max().item() <= 1e-5, strategy
        else:
            assert torch.equal(got, want), strategy
        stats = llm.engine.runner.strategy.stats()
        assert stats["host_experts"] > 0
        assert (host_kernel.timing()["calls"] > calls) == channel.compiled  # the kernel ran the host's routes
        if strategy == "hybrid":
            assert stats["decode"]["total"]["misses"] > 0  # both channels carried experts


class FakeCounters:
    """Stands in for the host kernel's process-wide counters (kernels/fused_moe/host.py timing)."""

    def __init__(self):
        self.now = {"calls": 0, "seconds": 0.0, "experts": 0, "working_calls": 0, "working_seconds": 0.0}

    def run(self, calls, seconds, experts, empty_calls=0, empty_seconds=0.0):
        """`calls` that computed `experts` in `seconds`, and `empty_calls` that computed none
        (they return at once, paying no fixed cost)."""
        for key, value in (("calls", calls + empty_calls), ("seconds", seconds + empty_seconds),
                           ("experts", experts), ("working_calls", calls), ("working_seconds", seconds)):
            self.now[key] += value

    def __call__(self):
        return dict(self.now)


def tuned(monkeypatch, speeds, **settings):
    from moeferry.moe import split_policy

    counters = FakeCounters()
    monkeypatch.setattr(split_policy.host_kernel, "timing", counters)
    return split_policy.SplitTuner(speeds, torch.device("cpu"), split_policy.TunerSettings(**settings)), counters


def decode_steps(tuner, counters, steps, calls, seconds, experts, **empty):
    """`steps` decode steps, the host's calls spread over them."""
    for _ in range(steps):
        counters.run(calls / steps, seconds / steps, experts / steps, **{k: v / steps for k, v in empty.items()})
        tuner.decode_step()


def decode_period(tuner, counters, calls, seconds, experts, **empty):
    decode_steps(tuner, counters, tuner.settings.period, calls, seconds, experts, **empty)


def test_the_split_follows_the_host_speed_decode_finds(monkeypatch):
    """A host at a third of its start-up speed: the estimate moves halfway each period, the
    split tensor (what the route split reads) follows, and it never falls below the floor;
    calls that computed no expert (no fixed cost paid) do not distort it."""
    start = ChannelSpeeds(50e9, 75e9, host_call_s=20e-6, expert_bytes=10**7)
    tuner, counters = tuned(monkeypatch, start)
    assert torch.allclose(tuner.split, torch.tensor([start.host_share, start.host_offset]))
    tuner.decode_step()  # the first step only marks the counters
    decode_period(tuner, counters, calls=96, seconds=96 * 20e-6 + 300 * 1e7 / 25e9, experts=300,
                  empty_calls=96, empty_seconds=96 * 1e-6)
    assert tuner.speeds.host_bytes_per_s == pytest.approx((75e9 + 25e9) / 2)
    assert tuner.speeds.host_share < start.host_share and tuner.updates == 1
    assert torch.allclose(tuner.split, torch.tensor([tuner.speeds.host_share, tuner.speeds.host_offset]))
    for _ in range(8):
        decode_period(tuner, counters, calls=96, seconds=96 * 20e-6 + 300 * 1e7 / 1e9, experts=300)
    assert tuner.speeds.host_bytes_per_s == pytest.approx(tuner.settings.floor * 75e9)
    for _ in range(8):  # the host recovers: so does its share
        decode_period(tuner, counters, calls=96, seconds=96 * 20e-6 + 300 * 1e7 / 75e9, experts=300)
    assert tuner.speeds.host_share == pytest.approx(start.host_share, rel=1e-2)


def test_a_prefill_between_decode_steps_is_not_counted_and_the_period_goes_on(monkeypatch):
    start = ChannelSpeeds(50e9, 75e9, expert_bytes=10**7)
    tuner, counters = tuned(monkeypatch, start)
    tuner.decode_step()
    half = tuner.settings.period // 2
    decode_steps(tuner, counters, half, calls=48, seconds=150 * 1e7 / 25e9, experts=150)
    tuner.interrupt()  # a prefill: its host calls, slow per expert, are not decode's
    counters.run(calls=1, seconds=5.0, experts=100)
    tuner.decode_step()  # counting resumes here
    decode_steps(tuner, counters, tuner.settings.period - half, calls=48, seconds=150 * 1e7 / 25e9, experts=150)
    assert tuner.updates == 1 and tuner.speeds.host_bytes_per_s == pytest.approx((75e9 + 25e9) / 2)


def test_the_split_stays_where_it_cannot_measure_or_must_not_move(monkeypatch):
    start = ChannelSpeeds(50e9, 75e9, expert_bytes=10**7)
    tuner, counters = tuned(monkeypatch, start)
    tuner.decode_step()
    decode_period(tuner, counters, calls=8, seconds=1.0, experts=tuner.settings.min_experts - 1)  # too few experts
    assert tuner.updates == 0 and tuner.speeds == start
    fixed, counters = tuned(monkeypatch, replace(start, share=0.3))  # --moe-host-share
    fixed.decode_step()
    decode_period(fixed, counters, calls=96, seconds=1.0, experts=300)
    assert fixed.updates == 0 and float(fixed.split[0]) == pytest.approx(0.3)


def test_hybrid_decode_retunes_its_split_and_still_generates_what_gpu_generates(tmp_path, monkeypatch):
    """The runner calls the tuner before each decode step, its split is the one the layers
    read, and the tokens stay gpu's."""
    from moeferry.moe import host_compute

    name, config = FAMILIES[0]
    path = str(tmp_path / name)
    make_checkpoint(config, path)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    monkeypatch.setattr(host_compute, "measure_speeds", lambda banks, *a: ChannelSpeeds(
        10e9, 10e9, expert_bytes=next(iter(banks.values())).bytes_per_expert))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, dtype="bfloat16", device="cpu").generate(PROMPTS, params)]
    llm = LLM(path, dtype="bfloat16", device="cpu", moe_strategy="hybrid", moe_cache_slots=experts,
              moe_collect_stats=True, moe_tuner_period=2, moe_tuner_min_experts=1)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    stats = llm.engine.runner.strategy.stats()
    tuner = llm.engine.runner.strategy.split.tuner
    assert stats["split_now"]["updates"] > 0 and stats["host_experts"] > 0
    assert float(tuner.split[0]) == pytest.approx(tuner.speeds.host_share)
    assert tuner.speeds.host_bytes_per_s != 10e9  # moved toward what the kernel achieved here


def test_both_schedules_give_the_same_bits_and_an_unknown_one_is_refused():
    """The host channel's schedule (--moe-host-schedule) reaches its call records, the routes
    are the same bits under either, and a schedule the kernel does not know is refused."""
    from moeferry.config import ConfigError
    from moeferry.kernels.fused_moe import host as host_kernel
    from moeferry.moe.banks import ExpertBanks
    from moeferry.moe.host_channel import HostChannelOptions, HostExpertChannel

    gen = torch.Generator().manual_seed(1)
    hidden_size, inter, experts, top_k, tokens = 128, 64, 16, 4, 3
    banks = {0: ExpertBanks((torch.randn(experts, 2 * inter, hidden_size, generator=gen) * 0.05).bfloat16(),
                            (torch.randn(experts, hidden_size, inter, generator=gen) * 0.05).bfloat16())}
    hidden = torch.randn(tokens, hidden_size, generator=gen).bfloat16()
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    host_ids = torch.where(torch.rand(tokens, top_k, generator=gen) < 0.5, ids, -1)

    outputs = {}
    for schedule in ("static", "dynamic"):
        channel = HostExpertChannel(banks, tokens, top_k, torch.device("cpu"), threads=2,
                                    options=HostChannelOptions(schedule=schedule))
        channel.begin(0, hidden, weights, host_ids)
        outputs[schedule] = channel.finish().clone()
        assert [call.schedule for call in channel.calls.values()] == [host_kernel.SCHEDULES[schedule]]
    assert torch.equal(outputs["static"], outputs["dynamic"]) and bool((outputs["static"] != 0).any())
    with pytest.raises(ConfigError, match="--moe-host-schedule 'guided': choose one of static, dynamic"):
        HostChannelOptions(schedule="guided")


def test_int8_host_activations_run_the_int8_path_and_stay_near_the_exact_one():
    """--moe-host-activations int8, the default, reaches the host kernel's calls: over int4
    experts the host's routes take the int8 path (not the exact bits), and the decode steps'
    log-probabilities stay near the exact path's (the prefill streams: its token is the GPU
    path's under both)."""
    from moeferry.default_model import ensure_default_model

    path = ensure_default_model()
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, ignore_eos=True)
    prompts = [list(range(10, 40)), [5, 17, 33, 2, 9, 71, 40]]
    runs = {}
    for activations in ("bf16", None):  # None: the default, the int8 path
        options = {} if activations is None else {"moe_host_activations": activations}
        llm = LLM(path, dtype="bfloat16", device="cpu", quantization="int4", moe_strategy="cpu", **options)
        activations = activations or "int8"
        assert llm.engine.runner.strategy.host.channel.options.activations == activations
        runs[activations] = [dict(step.top) for o in llm.generate(prompts, params) for step in o.logprobs[1:]]
    for exact, int8 in zip(runs["bf16"], runs["int8"]):
        shared = set(exact) & set(int8)
        assert len(shared) >= 4
        assert max(abs(exact[t] - int8[t]) for t in shared) < 0.15
    assert runs["bf16"] != runs["int8"]
