"""--tensor-parallel-size on the CPU: two processes over gloo give one process's greedy tokens
and log-probs (every family; gpu, offload, uva, cpu and hybrid; bf16, fp8 and int4 experts; across preemption
and prefix-cache hits; behind the server), each rank holds only its share of the experts, and a
rank that dies or raises ends the run with one clear line instead of a hang."""

import json
import os
import signal
import time

import pytest

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError, EngineConfig
from moeferry.engine.ranks import RankFailed
from tests.support.fixtures import family_configs, make_checkpoint, make_fp8_checkpoint, make_int4_checkpoint

FAMILIES = dict(family_configs())
PROMPTS = [[5, 17, 33, 2, 9, 71, 40], [88, 3], [12, 60, 61, 62, 7, 1, 90, 45, 23, 30, 31, 8, 19]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
CPU = dict(dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def make(name, writer=make_checkpoint):
        key = (name, writer.__name__)
        if key not in made:
            made[key] = str(tmp_path_factory.mktemp(name))
            writer(FAMILIES[name], made[key])
        return made[key]
    return make


def _same_generations(one, two):
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one, two):
        for x, y in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in y.top] == [t for t, _ in x.top]
            assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("family,strategy,writer", [
    ("qwen3_moe", "gpu", make_checkpoint),
    ("deepseek_v3", "offload", make_checkpoint),
    ("gpt_oss", "offload", make_checkpoint),
    ("qwen3_moe", "offload", make_fp8_checkpoint),
    ("mixtral", "uva", make_checkpoint),
], ids=["qwen3_moe-gpu", "deepseek_v3-offload", "gpt_oss-offload", "qwen3_moe-fp8-offload", "mixtral-uva"])
def test_two_ranks_generate_one_process_tokens_and_logprobs(checkpoints, family, strategy, writer):
    path = checkpoints(family, writer)
    one = LLM(path, moe_strategy=strategy, **CPU).generate(PROMPTS, GREEDY)
    with LLM(path, moe_strategy=strategy, tensor_parallel_size=2, **CPU) as llm:
        two = llm.generate(PROMPTS, GREEDY)
    _same_generations(one, two)


@pytest.mark.parametrize("family", [n for n in FAMILIES if n not in ("qwen3_moe", "deepseek_v3", "gpt_oss")])
def test_every_other_family_splits_its_experts_with_one_process_tokens(checkpoints, family):
    path = checkpoints(family)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    one = LLM(path, moe_strategy="offload", **CPU).generate(PROMPTS[:2], params)
    with LLM(path, moe_strategy="offload", tensor_parallel_size=2, **CPU) as llm:
        _same_generations(one, llm.generate(PROMPTS[:2], params))


@pytest.mark.parametrize("strategy,dtype", [("cpu", "float32"), ("hybrid", "bfloat16")])
def test_the_host_channel_computes_each_ranks_share(checkpoints, strategy, dtype):
    """cpu (the reference host path in float32) and hybrid (the compiled host kernel in bf16,
    half of each rank's misses on the host): every rank's host channel computes the routes to
    its own experts, the others' routes go to neither of its channels."""
    path = checkpoints("qwen3_moe")
    experts = FAMILIES["qwen3_moe"].num_experts
    extra = {"moe_host_share": 0.5} if strategy == "hybrid" else {}
    one = LLM(path, moe_strategy=strategy, dtype=dtype, device="cpu", moe_collect_stats=True,
              **({"moe_cache_slots": experts} if extra else {}), **extra)
    want = one.generate(PROMPTS, GREEDY)
    assert one.engine.runner.strategy.stats()["host_experts"] > 0
    with LLM(path, moe_strategy=strategy, tensor_parallel_size=2, dtype=dtype, device="cpu",
             **({"moe_cache_slots": experts // 2} if extra else {}), **extra) as llm:
        _same_generations(want, llm.generate(PROMPTS, GREEDY))


def test_int4_experts_split_with_one_process_tokens(checkpoints):
    path = checkpoints("qwen3_moe", make_int4_checkpoint)
    one = LLM(path, moe_strategy="offload", dtype="bfloat16", device="cpu").generate(PROMPTS, GREEDY)
    with LLM(path, moe_strategy="offload", tensor_parallel_size=2, dtype="bfloat16", device="cpu") as llm:
        two = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


# 16 pages of 4 tokens: three requests of up to 13 + 24 tokens cannot all hold their pages, so the
# scheduler preempts; the repeated prompt's first pages come from the prefix cache
SMALL_KV = dict(num_tokens=64, page_size=4, max_prefill_tokens=8, max_running_requests=3, max_model_len=48)


def test_preemption_and_prefix_caching_run_alike_on_every_rank(checkpoints):
    path = checkpoints("qwen3_moe")
    prompts = PROMPTS + [PROMPTS[2]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    single = LLM(path, **CPU, **SMALL_KV)
    one = single.generate(prompts, params)
    assert single.engine.scheduler.num_preemptions > 0 and single.engine.counters["prefix_cache_hit_tokens"] > 0
    with LLM(path, tensor_parallel_size=2, **CPU, **SMALL_KV) as llm:
        two = llm.generate(prompts, params)
        assert llm.engine.scheduler.num_preemptions == single.engine.scheduler.num_preemptions
        assert llm.engine.counters["prefix_cache_hit_tokens"] == single.engine.counters["prefix_cache_hit_tokens"]
    _same_generations(one, two)


def _force_routes(engine, profile):
    """Run on every rank: generated routes through router hooks (benchmarks' forced routing)."""
    from moeferry.routing.forced import ForcedRouting
    from moeferry.routing.profiles import get_profile

    ForcedRouting.install(engine, get_profile(profile), seed=3)
    engine.runner.recapture_graphs()


def test_a_call_on_every_rank_changes_every_ranks_engine_alike(checkpoints):
    path = checkpoints("qwen3_moe")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    one = LLM(path, **CPU)
    _force_routes(one.engine, "qwen3")
    with LLM(path, tensor_parallel_size=2, **CPU) as llm:
        llm.engine.run_on_every_rank(_force_routes, "qwen3")
        two = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in two] == [o.token_ids for o in one.generate(PROMPTS, params)]


def _write_held(engine, out_dir):
    """Run on every rank: the rows and bytes of its expert banks, and its slot cache's size."""
    strategy = engine.runner.strategy
    banks = strategy.banks.values()
    held = {"rows": sorted({b.num_experts for b in banks}),
            "bytes": sum(t.numel() * t.element_size() for b in banks for t in b.tensors()),
            "slots": strategy.store.cache.num_slots}
    with open(os.path.join(out_dir, f"rank{strategy.shard.rank}.json"), "w") as f:
        json.dump(held, f)


def test_each_rank_holds_only_its_share_of_the_experts(checkpoints, tmp_path):
    path = checkpoints("qwen3_moe")
    experts = FAMILIES["qwen3_moe"].num_experts
    whole = LLM(path, moe_strategy="offload", **CPU).engine.runner.strategy
    whole_bytes = sum(t.numel() * t.element_size() for b in whole.banks.values() for t in b.tensors())
    with LLM(path, moe_strategy="offload", tensor_parallel_size=2, **CPU) as llm:
        llm.engine.run_on_every_rank(_write_held, str(tmp_path))
        llm.generate([[1, 2]], SamplingParams(max_tokens=1))  # the followers have run the call by this step
    for rank in (0, 1):
        held = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert held["rows"] == [experts // 2]
        assert held["bytes"] * 2 == whole_bytes
        assert held["slots"] == whole.store.cache.num_slots // 2  # every expert of its share, no more


def test_a_killed_rank_ends_the_run_with_one_clear_line(checkpoints):
    llm = LLM(checkpoints("qwen3_moe"), tensor_parallel_size=2, **CPU)
    follower = llm.engine.ranks.followers[0].process
    killed = []

    def kill_once(_out):
        if not killed:
            os.kill(follower.pid, signal.SIGKILL)
            killed.append(time.monotonic())

    with pytest.raises(RankFailed, match=r"^rank 1 of 2 \(pid \d+\) was killed by signal 9: the run cannot go on"):
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), on_output=kill_once)
    assert time.monotonic() - killed[0] < 30
    with pytest.raises(RankFailed, match="stopped after an earlier failure"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    llm.close()
    assert not follower.is_alive()


def _raise_on_followers(engine):
    if engine.runner.strategy.shard.rank != 0:
        raise ValueError("a follower's own trouble")


def test_a_rank_that_raises_ends_the_run_naming_its_error(checkpoints):
    with LLM(checkpoints("qwen3_moe"), tensor_parallel_size=2, **CPU) as llm:
        llm.engine.run_on_every_rank(_raise_on_followers)
        with pytest.raises(RankFailed, match=r"rank 1 of 2 .* raised ValueError: a follower's own trouble"):
            llm.generate([[1, 2]], SamplingParams(max_tokens=2))
        assert all(not f.process.is_alive() for f in llm.engine.ranks.followers)


def test_the_option_is_checked_before_any_rank_starts(checkpoints):
    path = checkpoints("qwen3_moe")  # 8 experts per layer
    with pytest.raises(ConfigError, match=r"^--tensor-parallel-size must be >= 1, got 0$"):
        EngineConfig(tensor_parallel_size=0).check()
    with pytest.raises(ConfigError, match=r"^--tensor-parallel-size 3 splits .* the model has 8: give a size that "
                                          r"divides them$"):
        LLM(path, tensor_parallel_size=3, **CPU)
    with pytest.raises(ConfigError, match=r"^--tensor-parallel-size 2 with --moe-prefetch router is not built yet"):
        LLM(path, tensor_parallel_size=2, moe_strategy="offload", moe_prefetch="router", **CPU)


def test_the_server_serves_two_ranks_as_one_process(model_cache):
    """The built-in model (32 experts a layer, its tokenizer) behind the HTTP server, on two ranks."""
    import httpx

    from moeferry.engine.ranks import create_engine
    from tests.server.conftest import serve_engine

    options = dict(max_model_len=128, **CPU)
    body = {"prompt": "It is a truth universally acknowledged", "max_tokens": 12, "temperature": 0}
    want = LLM(**options).generate([body["prompt"]], SamplingParams(temperature=0.0, max_tokens=12))[0].text
    engine = create_engine(EngineConfig(tensor_parallel_size=2, **options))
    try:
        with serve_engine(engine) as running:
            r = httpx.post(running.url + "/v1/completions", headers=running.headers(), timeout=60, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want and want
    finally:
        engine.close()
