"""The expert cache simulator (routing/simulate.py) against the engine it models: a trace
recorded while an offload engine runs, replayed at the same cache size and policy, counts
exactly the engine's own admissions (decode and prefill, per layer); `gpu` records the same
routes as `offload`; `moeferry routing simulate` prints its table, and each mistake is one
line with exit status 2."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moeferry import LLM, SamplingParams
from moeferry.cli import main
from moeferry.config import ConfigError, EngineConfig
from moeferry.engine.planner import plan_memory
from moeferry.kernels.admission import POLICIES
from moeferry.moe.strategies import create_strategy
from moeferry.moe.banks import ExpertNeeds
from moeferry.routing.recorder import RoutingRecorder
from moeferry.routing.simulate import (DEFAULT_COPY_CALL_US, DEFAULT_H2D_GBPS, HostSpeed, HostSplit, SimulationError,
                                       cache_sizes, compute_seconds, h2d_bandwidth, simulate)
from moeferry.routing.trace import RoutingTrace, TraceHeader, TraceStep, TraceWriter
from tests.support.fixtures import family_configs, make_checkpoint
from tests.test_cli import run_cli

PROMPTS = [[5, 17, 33, 2, 9, 71, 40], [88, 3], [12, 60, 61, 62, 7, 1, 90, 45, 23, 30, 31, 8, 19]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
EXPERTS, LAYERS = 8, 3  # the qwen3_moe fixture: 3 MoE layers of 8 experts, top-2
SLOTS = EXPERTS + 3  # one layer's experts and three more: the layers compete for slots


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    name, config = family_configs()[0]
    assert name == "qwen3_moe" and config.num_experts == EXPERTS and config.num_hidden_layers == LAYERS
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    make_checkpoint(config, path)
    return path


def _record(checkpoint, trace, **options):
    """Run PROMPTS greedily (2 at a time: prefill and decode interleave) while recording."""
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_running_requests=2, moe_record_routing=str(trace),
              **options)
    outputs = llm.generate(PROMPTS, GREEDY)
    return llm, outputs, RoutingTrace.read(str(trace))


@pytest.mark.parametrize("policy", POLICIES)
def test_the_simulator_counts_exactly_the_offload_engines_admissions(checkpoint, tmp_path, policy):
    llm, _, trace = _record(checkpoint, tmp_path / "trace", moe_strategy="offload", moe_cache_slots=SLOTS,
                            moe_cache_policy=policy, moe_collect_stats=True)
    engine = llm.engine.runner.strategy.stats()
    assert trace.header.cache_slots == SLOTS and trace.header.cache_policy == policy
    result = simulate(trace, SLOTS, policy)
    for phase in ("decode", "prefill"):
        got, want = getattr(result, phase), engine[phase]
        assert got["per_layer"] == want["per_layer"], phase
    assert result.decode == engine["decode"]  # totals, hit rate and the route histogram too
    decode = engine["decode"]["total"]
    assert 0 < decode["misses"] < decode["distinct"]  # the cache both hit and missed
    assert engine["prefill"]["total"]["calls"] == 0  # CPU prefill streams: nothing admitted, nothing replayed
    assert result.decode_tokens == llm.engine.counters["decode_tokens"]


def test_demand_prefill_chunks_are_replayed_as_the_strategy_admitted_them(tmp_path):
    """At the strategy level (demand prefill needs a GPU engine): a 4-token chunk goes through
    the cache, an 8-token chunk streams; the replay admits the first as prefill, skips the
    second, and counts what the strategy counted."""
    h, i, e, k = 16, 8, 8, 2
    ec = EngineConfig(device="cpu", dtype="float32", moe_strategy="offload", moe_prefill_demand_tokens=4,
                      moe_cache_slots=e + 2, moe_collect_stats=True, moe_cache_policy="lru")
    strategy = create_strategy("offload", ec, SimpleNamespace(num_experts=e, top_k=k, num_layers=2, max_position_embeddings=64))
    gen = torch.Generator().manual_seed(0)
    for layer in range(2):
        banks = strategy.allocate_banks(layer, e, h, i)
        banks.w13.copy_(torch.randn(banks.w13.shape, generator=gen))
        banks.w2.copy_(torch.randn(banks.w2.shape, generator=gen))
    strategy.finalize(plan_memory(ec, strategy.memory_needs()))
    header = TraceHeader(2, e, k, strategy.expert_bytes, strategy="offload")
    strategy.recorder = RoutingRecorder(TraceWriter(str(tmp_path / "t"), header), 8, 2, torch.device("cpu"))
    for is_decode, tokens in [(False, 4), (True, 2), (False, 8), (True, 2), (True, 1), (False, 3), (True, 2)]:
        with strategy.recorder.step(is_decode, tokens, strategy.admits_prefill):
            strategy.begin_forward(is_decode, tokens)
            for layer in range(2):  # as MoEBlock.forward calls it
                ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
                strategy.record_routes(layer, ids)
                strategy.forward(layer, torch.randn(tokens, h, generator=gen), torch.full((tokens, k), 0.5), ids,
                                 is_decode)
    trace = RoutingTrace.read(str(tmp_path / "t"))
    assert [s.demand for s in trace.steps if s.phase == "prefill"] == [True, False, True]
    result, engine = simulate(trace, e + 2, "lru"), strategy.stats()
    assert engine["prefill"]["total"]["calls"] == 2 * 2 and engine["prefill"]["total"]["misses"] > 0
    assert result.prefill["per_layer"] == engine["prefill"]["per_layer"]
    assert result.decode["per_layer"] == engine["decode"]["per_layer"]
    every_prefill = simulate(trace, e + 2, "lru", prefill_demand_tokens=8)
    assert every_prefill.prefill["total"]["calls"] == 3 * 2


def test_gpu_records_the_same_routes_as_offload_for_a_greedy_run(checkpoint, tmp_path):
    _, gpu_out, gpu = _record(checkpoint, tmp_path / "gpu")
    _, off_out, off = _record(checkpoint, tmp_path / "off", moe_strategy="offload", moe_cache_slots=SLOTS)
    assert [o.token_ids for o in gpu_out] == [o.token_ids for o in off_out]
    assert gpu.header.strategy == "gpu" and gpu.header.cache_slots is None
    assert len(gpu.steps) == len(off.steps) > 0
    for a, b in zip(gpu.steps, off.steps):
        assert (a.phase, a.num_tokens, a.demand) == (b.phase, b.num_tokens, b.demand)
        assert np.array_equal(a.ids, b.ids)
    assert {s.phase for s in gpu.steps} == {"decode", "prefill"} and all(s.timed for s in gpu.steps)


def test_a_record_path_in_a_missing_directory_is_refused_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="--moe-record-routing .*: give a file path in an existing directory"):
        EngineConfig(device="cpu", moe_record_routing=str(tmp_path / "no" / "trace")).check()


# ---- sizes and the prediction --------------------------------------------------------------
HEADER = TraceHeader(num_moe_layers=4, num_experts=16, top_k=2, expert_bytes=3 << 20, strategy="gpu", device="x")


def test_cache_gb_gives_the_slots_the_engines_planner_gives():
    needs = ExpertNeeds(expert_bytes=HEADER.expert_bytes, total_experts=64, layer_experts=16, wants_slots=True)
    for gb in (0.05, 0.1, 0.123):
        planned = plan_memory(EngineConfig(device="cpu", moe_strategy="offload", moe_cache_gb=gb), needs).expert_slots
        assert cache_sizes(HEADER, gb=[gb])[0].slots == planned
    assert [s.slots for s in cache_sizes(HEADER, fractions=[0.25, 0.5, 0.75], slots=[20])] == [20, 16, 32, 48]


def test_a_cache_under_one_layer_is_refused():
    with pytest.raises(SimulationError, match="--cache-fraction 0.2 holds 12 experts, fewer than one layer's 16"):
        cache_sizes(HEADER, fractions=[0.2])
    trace = RoutingTrace(HEADER, [])
    with pytest.raises(SimulationError, match="fewer than one layer's 16"):
        simulate(trace, 15, "lru")


def _decode_trace(step_ms=2.0):
    gen = np.random.default_rng(0)
    steps = [TraceStep("decode", False, 3, step_ms, gen.integers(0, 16, (4, 4, 2))) for _ in range(10)]
    return RoutingTrace(HEADER, steps)


def test_the_prediction_is_compute_time_plus_missed_bytes_over_the_bandwidth_plus_a_cost_a_copying_call():
    trace = _decode_trace(step_ms=2.0)
    result = simulate(trace, 20, "layer_lru")
    misses = result.decode["total"]["misses"]
    assert misses > 0 and result.decode_bytes == misses * HEADER.expert_bytes
    seconds, source = compute_seconds(HEADER, result, None)  # recorded under gpu: its own times
    assert seconds == pytest.approx(10 * 2.0 / 1e3) and "own decode step times" in source
    bandwidth = 50e9
    copied = result.layer_calls[:, 0]
    assert len(copied) == 10 * HEADER.num_moe_layers and copied.sum() == misses and result.host_experts == 0
    copying_calls = int((copied > 0).sum())
    assert 0 < copying_calls < len(copied)  # some calls copy nothing, and cost nothing
    bytes_s = misses * HEADER.expert_bytes / bandwidth
    assert result.predicted_tok_s(bandwidth, seconds, copy_call_us=0.0) == pytest.approx(30 / (seconds + bytes_s))
    expect = 30 / (seconds + bytes_s + copying_calls * DEFAULT_COPY_CALL_US * 1e-6)
    assert result.predicted_tok_s(bandwidth, seconds) == pytest.approx(expect)
    assert compute_seconds(HEADER, result, 5.0)[0] == pytest.approx(10 * 5.0 / 1e3)


def test_a_hybrid_rows_channel_time_is_each_layers_longer_channel():
    """Per layer call: copies over H2D against the host's experts over its bandwidth plus its
    fixed cost where it took any; the calls' copies add up to the engine's misses."""
    trace = _decode_trace(step_ms=2.0)
    result = simulate(trace, 20, "layer_lru", host=HostSplit(0.5))
    copied, on_host = result.layer_calls[:, 0], result.layer_calls[:, 1]
    assert len(result.layer_calls) == 10 * HEADER.num_moe_layers and copied.sum() == result.decode["total"]["misses"]
    assert on_host.sum() > 0
    host = HostSpeed(gbps=20.0, call_us=30.0)
    b = HEADER.expert_bytes
    want = sum(max(c * b / 50e9 + (5e-6 if c else 0.0), h * b / 20e9 + (30e-6 if h else 0.0))
               for c, h in result.layer_calls.tolist())
    assert result.channel_seconds(50e9, host, copy_call_us=5.0) == pytest.approx(want)
    assert result.predicted_tok_s(50e9, 0.02, host, copy_call_us=5.0) == pytest.approx(30 / (0.02 + want))


def test_no_prediction_without_a_compute_time_it_can_trust():
    offload = RoutingTrace(TraceHeader(**{**HEADER.__dict__, "strategy": "offload"}), _decode_trace().steps)
    seconds, why = compute_seconds(offload.header, simulate(offload, 20, "lru"), None)
    assert seconds is None and "give --step-ms" in why
    untimed = _decode_trace(step_ms=math.nan)
    assert compute_seconds(HEADER, simulate(untimed, 20, "lru"), None)[0] is None


def test_the_bandwidth_is_the_flag_else_measured_else_the_documented_default(monkeypatch):
    assert h2d_bandwidth(20.0) == (20e9, "--h2d-gbps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bandwidth, source = h2d_bandwidth(None)
    assert bandwidth == DEFAULT_H2D_GBPS * 1e9 and "H200" in source and "no GPU here" in source


# ---- the command ---------------------------------------------------------------------------
def test_routing_simulate_prints_a_row_per_size_and_policy(tmp_path, capsys):
    writer = TraceWriter(str(tmp_path / "t"), HEADER)
    for step in _decode_trace().steps:
        writer.write(step)
    writer.close()
    status = main(["routing", "simulate", str(tmp_path / "t"), "--cache-fraction", "0.5", "1", "--cache-slots", "20",
                   "--policy", "lru", "layer_lru", "--h2d-gbps", "25"])
    out = capsys.readouterr().out
    assert status == 0
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| cache | slots | GiB | % experts | policy | split | decode hit")
    rows = [line.split(" | ") for line in lines[1:]]
    assert [(r[1], r[4]) for r in rows] == [("20", "lru"), ("20", "layer_lru"), ("32", "lru"), ("32", "layer_lru"),
                                            ("64", "lru"), ("64", "layer_lru")]
    assert rows[-1][6] == "1.000"  # every expert cached: every admission hits
    assert "H2D bandwidth: 25.0 GB/s (--h2d-gbps)" in out and "own decode step times" in out
    assert all(float(r[-1].rstrip(" |")) > 0 for r in rows)


def test_routing_simulate_plot_writes_the_hit_rate_curve(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    writer = TraceWriter(str(tmp_path / "t"), HEADER)
    for step in _decode_trace().steps:
        writer.write(step)
    writer.close()
    png = tmp_path / "hits.png"
    status = main(["routing", "simulate", str(tmp_path / "t"), "--cache-fraction", "0.5", "1", "--policy", "lru",
                   "--h2d-gbps", "25", "--plot", str(png)])
    assert status == 0 and f"hit-rate curve written to {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_simulator_counts_exactly_the_hybrid_engines_split_and_admissions(checkpoint, tmp_path):
    """A hybrid engine's recorded routes replayed through its own split at its fixed share: the
    same admissions layer by layer and the same host experts."""
    llm, _, trace = _record(checkpoint, tmp_path / "trace", moe_strategy="hybrid", moe_cache_slots=SLOTS,
                            moe_cache_policy="layer_lru", moe_host_share=0.5, moe_collect_stats=True)
    engine = llm.engine.runner.strategy.stats()
    result = simulate(trace, SLOTS, "layer_lru", host=HostSplit(0.5))
    assert result.decode["per_layer"] == engine["decode"]["per_layer"]
    assert result.host_experts == engine["host_experts"] > 0


def test_routing_simulate_replays_hybrid_rows_beside_offload(tmp_path, capsys):
    """The host's experts leave the copies: fewer experts copied a step than offload's, each
    row with its channel time."""
    trace = str(tmp_path / "t")
    assert main(["routing", "generate", "--profile", "qwen3", "--layers", "2", "--experts", "64", "--top-k", "4",
                 "--tokens", "120", "-o", trace]) == 0
    assert main(["routing", "simulate", trace, "--cache-fraction", "0.5", "--policy", "layer_lru",
                 "--host-share", "0.5", "--host-gbps", "25", "--h2d-gbps", "25", "--step-ms", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| --")]
    assert [r[5] for r in rows] == ["offload", "hybrid 0.5"]
    (offload_copied, offload_host), (copied, host) = ((float(v) for v in r[8].split(" / ")) for r in rows)
    assert offload_host == 0 and host > 0 and copied < offload_copied
    assert all(float(r[10]) > 0 for r in rows)  # channel ms a step
    assert "host kernel: 25 GB/s, 0 us a call" in out
    assert run_cli(["routing", "simulate", trace, "--cache-slots", "64", "--host-gbps", "30"], capsys).endswith(
        "--host-gbps is read only with --host-share (a hybrid split)")


@pytest.mark.parametrize("args,says", [
    (["missing", "--cache-slots", "16"], "moeferry routing: error: cannot read routing trace"),
    (["garbage", "--cache-slots", "16"], "moeferry routing: error: {dir}/garbage is not a routing trace"),
    (["trace", "--cache-slots", "15"], "moeferry routing: error: --cache-slots 15 holds 15 experts, fewer than one"),
    (["trace", "--cache-gb", "0.01"], "moeferry routing: error: --cache-gb 0.01 holds 3 experts"),
    (["trace"], "moeferry routing: error: give at least one cache size"),
    (["trace", "--cache-fraction", "1.5"], "argument --cache-fraction: 1.5 is out of range"),
    (["trace", "--cache-slots", "16", "--policy", "mru"], "argument --policy: invalid choice: 'mru'"),
])
def test_routing_simulate_mistakes_are_one_line(tmp_path, capsys, args, says):
    TraceWriter(str(tmp_path / "trace"), HEADER).close()
    (tmp_path / "garbage").write_bytes(b"\x00" * 64)
    line = run_cli(["routing", "simulate", str(tmp_path / args[0]), *args[1:]], capsys)
    assert says.format(dir=tmp_path) in line, line


@pytest.mark.gpu
def test_decode_graphs_record_every_step_padded_rows_included(checkpoint, tmp_path):
    llm = LLM(checkpoint, dtype="float32", device="cuda", max_running_requests=4, moe_strategy="offload",
              moe_cache_slots=SLOTS, moe_record_routing=str(tmp_path / "t"))
    llm.generate(PROMPTS, GREEDY)
    sizes = llm.engine.runner.graphs.sizes
    decode = [s for s in RoutingTrace.read(str(tmp_path / "t")).steps if s.phase == "decode"]
    assert sum(s.num_tokens for s in decode) == llm.engine.counters["decode_tokens"]
    assert all(s.rows in sizes and s.rows >= s.num_tokens for s in decode)
    assert any(s.rows > s.num_tokens for s in decode)  # 3 requests replay the graph of 4
    assert all((s.ids < EXPERTS).all() for s in decode)
