"""Generated routes forced on a running engine (routing/forced.py): every MoE layer routes
exactly the generator's experts, the same under every strategy, for a Linear gate and for a
router that routes by itself (DeepSeek's); and `moeferry routing generate` writes a trace that
`routing simulate` replays like a recorded one."""

import numpy as np
import pytest
import torch

from moeferry import LLM, SamplingParams
from moeferry.cli import main
from moeferry.routing.forced import ForcedRouting
from moeferry.routing.profiles import RouteGenerator, get_profile
from moeferry.routing.trace import RoutingTrace
from tests.support.fixtures import family_configs, make_checkpoint

PROMPTS = [[5, 17, 33, 2, 9, 71, 40], [88, 3], [12, 60, 61, 62, 7, 1, 90, 45]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _checkpoint(tmp_path_factory, family: str) -> str:
    path = str(tmp_path_factory.mktemp(family))
    make_checkpoint(dict(family_configs())[family], path)
    return path


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def checkpoint(request, tmp_path_factory):
    return _checkpoint(tmp_path_factory, request.param)


def _run(checkpoint, trace, **options):
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_running_requests=2, max_prefill_tokens=16,
              moe_record_routing=str(trace), **options)
    forced = ForcedRouting.install(llm.engine, get_profile("qwen3"), seed=11)
    outputs = llm.generate(PROMPTS, GREEDY)
    forced.remove()
    llm.engine.runner.recorder.close()
    return llm, forced, outputs, RoutingTrace.read(str(trace))


def test_every_forward_routes_the_generators_experts_under_every_strategy(checkpoint, tmp_path):
    llm, forced, _, gpu = _run(checkpoint, tmp_path / "gpu", moe_strategy="gpu")
    _, _, _, offload = _run(checkpoint, tmp_path / "offload", moe_strategy="offload", moe_cache_slots=2 * 8)
    mc = llm.engine.mc
    replay = RouteGenerator(get_profile("qwen3"), len(mc.moe_layer_ids), mc.num_experts, mc.top_k,
                            forced.generator.max_rows, seed=11)
    assert len(gpu.steps) == len(offload.steps) > len(PROMPTS)
    for a, b in zip(gpu.steps, offload.steps):
        want = np.sort(replay.generate(a.rows).numpy(), axis=2)
        # the block orders a token's experts by its own weights; the set is the generator's
        assert (np.sort(a.ids, axis=2) == want).all() and (np.sort(b.ids, axis=2) == want).all()


def test_the_oracle_predicts_each_forwards_routes_at_its_stated_recall(tmp_path_factory):
    checkpoint = _checkpoint(tmp_path_factory, "qwen3_moe-tied-top4")
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_running_requests=2, max_prefill_tokens=16)
    forced = ForcedRouting.install(llm.engine, get_profile("qwen3"), seed=2, oracle_recall=0.75)
    seen = []
    block = llm.engine.runner.model.moe_block(llm.engine.mc.moe_layer_ids[-1])
    handle = block.register_forward_pre_hook(
        lambda _m, args: seen.append((forced.routes[:, :args[0].shape[0]].clone(),
                                      forced.predictions[:, :args[0].shape[0]].clone())))
    llm.generate(PROMPTS * 4, GREEDY)
    handle.remove()
    routes = torch.cat([r for r, _ in seen], dim=1)
    predicted = torch.cat([p for _, p in seen], dim=1)
    assert predicted.shape == routes.shape  # width k: one wrong id for each true one dropped
    hit = (predicted[..., :, None] == routes[..., None, :]).any(dim=-1).float().mean().item()
    assert abs(hit - 0.75) < 0.05, hit


def test_removing_the_hooks_gives_the_models_own_routes_back(tmp_path_factory):
    checkpoint = _checkpoint(tmp_path_factory, "qwen3_moe")
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_running_requests=2)
    own = llm.generate(PROMPTS, GREEDY)
    forced = ForcedRouting.install(llm.engine, get_profile("uniform"))
    llm.generate(PROMPTS, GREEDY)
    forced.remove()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in own]


def test_routing_generate_writes_a_trace_simulate_replays(tmp_path, capsys):
    path = str(tmp_path / "trace.bin")
    assert main(["routing", "generate", "--profile", "qwen3", "--layers", "4", "--experts", "64", "--top-k", "4",
                 "--tokens", "40", "--rows", "2", "-o", path]) == 0
    trace = RoutingTrace.read(path)
    h = trace.header
    assert (h.num_moe_layers, h.num_experts, h.top_k, h.model) == (4, 64, 4, "generated:qwen3")
    assert len(trace.steps) == 40 and all(s.phase == "decode" and s.ids.shape == (4, 2, 4) for s in trace.steps)
    capsys.readouterr()
    assert main(["routing", "simulate", path, "--cache-fraction", "0.25", "1", "--policy", "lru"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| --cache")]
    quarter, everything = (float(r[6]) for r in rows)
    assert everything == 1.0 and 0.25 < quarter < 1.0  # locality beats the share resident


def test_routing_generate_refuses_a_top_k_over_the_experts(tmp_path, capsys):
    from tests.test_cli import run_cli

    line = run_cli(["routing", "generate", "--experts", "4", "--top-k", "8", "-o", str(tmp_path / "t")], capsys)
    assert "--top-k 8 exceeds --experts 4" in line


@pytest.mark.gpu
def test_decode_graphs_draw_new_routes_each_replay_the_same_under_gpu_and_offload(tmp_path_factory, tmp_path):
    checkpoint = _checkpoint(tmp_path_factory, "qwen3_moe-tied-top4")
    traces = []
    for strategy, slots in (("gpu", None), ("offload", 20)):
        llm = LLM(checkpoint, dtype="float32", device="cuda", max_running_requests=4, moe_strategy=strategy,
                  moe_cache_slots=slots, moe_record_routing=str(tmp_path / strategy))
        forced = ForcedRouting.install(llm.engine, get_profile("qwen3"), seed=4, oracle_recall=0.8)
        llm.engine.runner.recapture_graphs()  # the graphs draw the routes and the oracle's predictions
        assert llm.engine.runner.graphs is not None
        llm.generate(PROMPTS, GREEDY)
        llm.engine.runner.recorder.close()
        traces.append(RoutingTrace.read(str(tmp_path / strategy)))
        forced.remove()
    gpu, offload = traces
    decode = [s for s in gpu.steps if s.phase == "decode"]
    assert len(decode) > 3 and not all((a.ids == decode[0].ids).all() for a in decode[1:])  # a new draw per replay
    assert len(gpu.steps) == len(offload.steps)
    for a, b in zip(gpu.steps, offload.steps):
        assert (np.sort(a.ids, axis=2) == np.sort(b.ids, axis=2)).all()
        assert (np.diff(np.sort(a.ids, axis=2), axis=2) > 0).all()
