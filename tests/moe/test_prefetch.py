"""Lookahead prefetch (moe/prefetch.py) on the CPU: with --moe-prefetch router, `offload` and
`hybrid` generate `gpu`'s tokens for every family and expert format; a predictor that is always
wrong still does, at a cost in copies only; a predictor that is always right leaves no decode
miss past the first layer; and the statistics add up."""

import os

import pytest
import torch

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError
from moeferry.routing.forced import ForcedRouting
from moeferry.routing.profiles import get_profile
from tests.support.fixtures import family_configs, make_checkpoint

FAMILIES = family_configs()
PROMPTS = [[5, 17, 33, 2, 9, 71, 40], [88, 3], [12, 60, 61, 62, 7, 1, 90, 45, 23, 30, 31, 8, 19]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def tokens(llm, prompts=PROMPTS):
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def prefetching(path, experts, strategy="offload", layers=3, top_k=None, **options):
    """An engine whose cache has room for two layers' experts (one computing, one ahead) and
    still misses: a two-layer model's holds one layer and one token's routes."""
    slots = 2 * experts if layers > 2 else experts + top_k
    return LLM(path, dtype="float32", device="cpu", moe_strategy=strategy, moe_cache_slots=slots,
               moe_collect_stats=True, **{"moe_prefetch": "router", **options})


def gpu_and_room(path):
    """`gpu` and the options that leave a lookahead room: a two-layer model decodes one
    request at a time (its cache of a layer and a token's routes has room for a token's
    experts twice, not for three tokens' when they fill a layer)."""
    probe = LLM(path, dtype="float32", device="cpu")
    mc = probe.engine.mc
    layers = len(mc.moe_layer_ids)
    options = {"layers": layers, "top_k": mc.top_k}
    if layers > 2:
        return probe, options
    return LLM(path, dtype="float32", device="cpu", max_running_requests=1), {**options, "max_running_requests": 1}


def assert_counts_add_up(prefetch: dict) -> None:
    assert prefetch["useful"] + prefetch["wasted"] == prefetch["copied"]
    assert 0 <= prefetch["useful"] <= prefetch["copied"] <= prefetch["predicted"]
    assert prefetch["predicted_hit"] <= prefetch["routed"]


def test_offload_with_prefetch_generates_what_gpu_generates(family_ckpt):
    path, experts = family_ckpt
    gpu, options = gpu_and_room(path)
    llm = prefetching(path, experts, **options)
    assert tokens(llm) == tokens(gpu)
    stats = llm.engine.runner.strategy.stats()
    prefetch = stats["prefetch"]
    assert prefetch["mode"] == "router" and prefetch["copied"] > 0 and prefetch["routed"] > 0
    assert_counts_add_up(prefetch)
    assert prefetch["per_layer_recall"][0] is None  # nothing predicts the first MoE layer


def test_hybrid_with_prefetch_generates_what_gpu_generates(family_ckpt):
    path, experts = family_ckpt
    gpu, options = gpu_and_room(path)
    llm = prefetching(path, experts, "hybrid", moe_host_share=0.5, **options)
    assert tokens(llm) == tokens(gpu)
    stats = llm.engine.runner.strategy.stats()
    assert stats["host_experts"] > 0 and stats["prefetch"]["copied"] > 0
    assert_counts_add_up(stats["prefetch"])


def test_under_hybrid_the_lookahead_fetches_only_the_device_channels_share(tmp_path):
    """The split decides the lookahead's copies too: a host that takes every miss leaves the
    copy channel nothing to fetch ahead (predictions still made and counted); one that takes
    none leaves every predicted miss to it. The tokens are gpu's either way."""
    path = str(tmp_path / "ckpt")
    config = dict(FAMILIES)["qwen3_moe"]
    make_checkpoint(config, path)
    want = tokens(LLM(path, dtype="float32", device="cpu"))
    copied = {}
    for share in (1.0, 0.0):
        llm = prefetching(path, config.num_experts, "hybrid", moe_host_share=share)
        assert tokens(llm) == want, share
        prefetch = llm.engine.runner.strategy.stats()["prefetch"]
        assert prefetch["predicted"] > 0
        copied[share] = prefetch["copied"]
    assert copied[1.0] == 0 < copied[0.0]


def test_prefetch_over_quantized_experts_generates_what_gpu_generates(quantized_ckpt):
    path, options, experts = quantized_ckpt
    want = tokens(LLM(path, dtype="bfloat16", device="cpu", **options))
    for strategy, exact in (("offload", {}), ("hybrid", {"moe_host_activations": "bf16"})):  # the GPU's arithmetic
        llm = LLM(path, dtype="bfloat16", device="cpu", moe_strategy=strategy, moe_cache_slots=2 * experts,
                  moe_prefetch="router", **options, **exact)
        assert tokens(llm) == want, strategy


def test_an_always_wrong_predictor_costs_copies_never_tokens(tmp_path):
    """Generated routes, and predictions drawn from the experts no row of the layer routes."""
    path = str(tmp_path / "ckpt")
    config = dict(FAMILIES)["qwen3_moe"]
    make_checkpoint(config, path)
    want = tokens(LLM(path, dtype="float32", device="cpu", max_running_requests=2, max_prefill_tokens=16),
                  PROMPTS[:2])
    llm = prefetching(path, config.num_experts, max_running_requests=2, max_prefill_tokens=16)
    forced = ForcedRouting.install(llm.engine, get_profile("qwen3"), seed=5)
    strategy = llm.engine.runner.strategy
    strategy.prefetch.predict_from(never_routed(llm, forced))
    forced_tokens = tokens(llm, PROMPTS[:2])
    prefetch = strategy.stats()["prefetch"]
    assert prefetch["predicted_hit"] == prefetch["useful"] == 0
    assert prefetch["wasted"] == prefetch["copied"] > 0 and prefetch["recall"] == 0.0
    forced.remove()
    strategy.prefetch.predict_from(None)
    gpu = LLM(path, dtype="float32", device="cpu", max_running_requests=2, max_prefill_tokens=16)
    forced = ForcedRouting.install(gpu.engine, get_profile("qwen3"), seed=5)
    assert forced_tokens == tokens(gpu, PROMPTS[:2])  # the same routes without prefetch
    assert want  # (the unforced run is only a warm-up of the same shapes)


def never_routed(llm, forced):
    """[L, rows, K] predictions refreshed every forward (a hook after the generator's): for
    every row, K experts that no row of that layer routes."""
    mc = llm.engine.mc
    layers, rows, k = forced.routes.shape
    wrong = torch.zeros(layers, rows, k, dtype=torch.int64)

    def fill(_module, inputs, _out):
        n = inputs[0].shape[0]
        routed = torch.zeros(layers, mc.num_experts)
        routed.scatter_(1, forced.routes[:, :n].reshape(layers, -1), 1.0)
        unrouted_first = routed.argsort(dim=1, stable=True)[:, :k]
        wrong[:, :n] = unrouted_first[:, None, :]

    first = llm.engine.runner.model.moe_block(mc.moe_layer_ids[0]).route_module
    first.register_forward_hook(fill)
    return wrong


def test_an_always_right_predictor_leaves_no_decode_miss_past_the_first_layer(tmp_path):
    """Generated routes and an oracle of recall 1: each layer's routes are admitted a layer
    early, so only the first MoE layer's own admissions can miss."""
    path = str(tmp_path / "ckpt")
    config = dict(FAMILIES)["qwen3_moe"]
    make_checkpoint(config, path)
    llm = prefetching(path, config.num_experts, max_running_requests=2, max_prefill_tokens=16)
    forced = ForcedRouting.install(llm.engine, get_profile("qwen3"), seed=3, oracle_recall=1.0)
    strategy = llm.engine.runner.strategy
    strategy.prefetch.predict_from(forced.predictions)
    tokens(llm, PROMPTS[:2])
    stats = strategy.stats()
    misses = stats["decode"]["per_layer"]["misses"]
    assert misses[0] > 0 and sum(misses[1:]) == 0
    prefetch = stats["prefetch"]
    assert prefetch["recall"] == 1.0 and prefetch["predictor"] == "given"
    assert prefetch["useful"] == prefetch["copied"] > 0
    assert_counts_add_up(prefetch)


def test_a_capped_lookahead_copies_at_most_its_cap_a_layer(tmp_path):
    """--moe-prefetch-experts N: each lookahead copies at most N predicted misses, the rest
    left to the layer's own admission; the tokens are gpu's, capped or not."""
    path = str(tmp_path / "ckpt")
    config = dict(FAMILIES)["qwen3_moe"]
    make_checkpoint(config, path)
    plans = {}
    for cap in (0, 1):
        llm = prefetching(path, config.num_experts, max_running_requests=1, moe_prefetch_experts=cap)
        forced = ForcedRouting.install(llm.engine, get_profile("uniform"), seed=4, oracle_recall=1.0)
        llm.engine.runner.strategy.prefetch.predict_from(forced.predictions)
        plans[cap] = lookahead_copies(llm.engine.runner.strategy.store.cache)
        assert tokens(llm, PROMPTS[:2]) == tokens(forced_gpu(path, seed=4), PROMPTS[:2]), cap
    assert max(plans[0]) > 1 and max(plans[1]) == 1
    assert sum(plans[1]) < sum(plans[0])


def lookahead_copies(cache) -> list[int]:
    """Each later lookahead's planned copies, in order (cache.admit_ahead wrapped)."""
    counts = []
    admit_ahead = cache.admit_ahead

    def counted(*args):
        admit_ahead(*args)
        counts.append(int(cache.state.ahead_count[0]))

    cache.admit_ahead = counted
    return counts


def forced_gpu(path, seed):
    gpu = LLM(path, dtype="float32", device="cpu", max_running_requests=1)
    ForcedRouting.install(gpu.engine, get_profile("uniform"), seed=seed)
    return gpu


def test_no_room_beside_the_computing_layer_means_no_lookahead(family_ckpt):
    """A cache of one layer's experts cannot take a second layer's beside the first: prefetch
    stands aside and the tokens are still gpu's."""
    path, experts = family_ckpt
    want = tokens(LLM(path, dtype="float32", device="cpu"))
    llm = LLM(path, dtype="float32", device="cpu", moe_strategy="offload", moe_cache_slots=experts,
              moe_prefetch="router", moe_collect_stats=True)
    assert tokens(llm) == want
    assert llm.engine.runner.strategy.stats()["prefetch"]["predicted"] == 0


def test_statistics_switch_off_and_on_again_with_fresh_counters(tmp_path):
    """MoEStrategy.set_statistics: off, nothing is counted (and no counter is left to read);
    on again, counting starts from zero; the tokens never change."""
    path = str(tmp_path / "ckpt")
    config = dict(FAMILIES)["qwen3_moe"]
    make_checkpoint(config, path)
    llm = prefetching(path, config.num_experts)
    strategy = llm.engine.runner.strategy
    want = tokens(llm)
    counted = strategy.stats()["prefetch"]
    assert counted["copied"] > 0
    strategy.set_statistics(False)
    assert tokens(llm) == want
    stats = strategy.stats()
    assert "decode" not in stats and "copied" not in stats["prefetch"]
    strategy.set_statistics(True)
    assert tokens(llm, PROMPTS[:1]) == want[:1]
    fresh = strategy.stats()
    assert 0 < fresh["prefetch"]["predicted"] < counted["predicted"]
    assert 0 < fresh["decode"]["total"]["distinct"]
    assert_counts_add_up(fresh["prefetch"])


def test_prefetch_statistics_reach_v1_stats_and_metrics(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from moeferry.server.metrics import ServerMetrics

    path = str(tmp_path / "ckpt")
    config = dict(FAMILIES)["qwen3_moe"]
    make_checkpoint(config, path)
    llm = prefetching(path, config.num_experts)
    tokens(llm)
    stats = llm.engine.stats(include_moe=True)
    prefetch = stats["moe"]["prefetch"]
    text = ServerMetrics().render(stats).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["moeferry_prefetch_copied_experts_total"] == prefetch["copied"] > 0
    assert samples["moeferry_prefetch_useful_experts_total"] == prefetch["useful"]
    assert samples["moeferry_prefetch_recall"] == pytest.approx(prefetch["recall"])


@pytest.mark.parametrize("strategy", ["gpu", "uva", "cpu"])
def test_prefetch_is_refused_where_nothing_reads_it(strategy, tmp_path):
    path = str(tmp_path / "ckpt")
    make_checkpoint(dict(FAMILIES)["qwen3_moe"], path)
    with pytest.raises(ConfigError, match="--moe-prefetch"):
        LLM(path, dtype="float32", device="cpu", moe_strategy=strategy, moe_prefetch="router")


@pytest.mark.gpu
@pytest.mark.parametrize("copy, miss_copy", [("gather", "gather"), ("dma", "gather"), ("dma", "dma")])
@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_prefetch_in_the_decode_graph_generates_what_gpu_generates(strategy, copy, miss_copy, tmp_path):
    """On the GPU the lookahead copies run beside the compute inside the captured decode graph,
    by the gather kernel on a side stream or by the copy engine's worker; with --moe-miss-copy
    dma the layer's own copies go to the same engine (a layer joins its lookahead before them)."""
    path = str(tmp_path / "ckpt")
    config = dict(FAMILIES)["qwen3_moe"]
    make_checkpoint(config, path)
    want = tokens(LLM(path, dtype="bfloat16"))
    extra = {"moe_host_share": 0.5} if strategy == "hybrid" else {}
    llm = LLM(path, dtype="bfloat16", moe_strategy=strategy, moe_cache_slots=2 * config.num_experts,
              moe_prefetch="router", moe_prefetch_copy=copy, moe_miss_copy=miss_copy, moe_collect_stats=True,
              **extra)
    assert tokens(llm) == want
    prefetch = llm.engine.runner.strategy.stats()["prefetch"]
    assert prefetch["copied"] > 0 and prefetch["copy"] == copy
    assert_counts_add_up(prefetch)
    assert llm.engine.runner.strategy.store.stats()["decode"]["total"]["misses"] > 0
    assert torch.cuda.current_stream().query()


def test_a_capped_lookahead_gather_copies_the_same_rows(tmp_path):
    """--moe-prefetch-programs caps the grid of the gather that copies ahead: the same experts
    arrive, the tokens are gpu's; a negative cap, or one without a prefetch, is refused."""
    path = str(tmp_path / "ckpt")
    config = dict(FAMILIES)["qwen3_moe"]
    make_checkpoint(config, path)
    want = tokens(LLM(path, dtype="float32", device="cpu"))
    llm = prefetching(path, config.num_experts, moe_prefetch_programs=2)
    assert llm.engine.runner.strategy.prefetch.tuning.max_programs == 2
    assert tokens(llm) == want
    assert llm.engine.runner.strategy.stats()["prefetch"]["copied"] > 0
    with pytest.raises(ConfigError, match="--moe-prefetch-programs"):
        LLM(path, dtype="float32", device="cpu", moe_strategy="offload", moe_prefetch_programs=2)
    with pytest.raises(ConfigError, match="--moe-prefetch-programs"):
        prefetching(path, config.num_experts, moe_prefetch_programs=-1)


def test_fitted_predictors_from_routing_fit_drive_the_lookahead(tmp_path, capsys):
    """`moeferry routing fit` writes predictors that --moe-prefetch fitted loads: the lookahead
    predicts with them, copies ahead, and the tokens are gpu's (the built-in model, fitted on
    the held-out text)."""
    from moeferry.cli import main
    from moeferry.default_model import DEFAULT_MODEL_NAME

    predictors = str(tmp_path / "predictors.safetensors")
    text = os.path.join(os.path.dirname(__file__), "..", "data", "austen_heldout.txt")
    assert main(["routing", "fit", DEFAULT_MODEL_NAME, "--text", text, "--prompts", "8", "--prompt-len", "64",
                 "--hidden", "32", "-o", predictors]) == 0
    assert "wrote 5 predictors (an MLP of 32 each) fitted on 8 windows of 64 tokens" in capsys.readouterr().out
    want = tokens(LLM(DEFAULT_MODEL_NAME, dtype="float32", device="cpu"))
    llm = prefetching(DEFAULT_MODEL_NAME, 32, moe_prefetch="fitted", moe_prefetch_predictor=predictors)
    assert tokens(llm) == want
    prefetch = llm.engine.runner.strategy.stats()["prefetch"]
    assert prefetch["mode"] == prefetch["predictor"] == "fitted" and prefetch["copied"] > 0
    assert_counts_add_up(prefetch)


def test_routing_fit_refuses_a_model_without_a_tokenizer(tmp_path, capsys):
    from tests.test_cli import run_cli

    path = str(tmp_path / "ckpt")
    make_checkpoint(dict(FAMILIES)["qwen3_moe"], path)
    text = tmp_path / "text.txt"
    text.write_text("some text")
    line = run_cli(["routing", "fit", path, "--text", str(text), "-o", str(tmp_path / "p")], capsys)
    assert "has no tokenizer to read --text with" in line


def test_fitted_prefetch_refuses_a_missing_or_foreign_predictors_file(tmp_path):
    """Without a file, or with one fitted for another model's layers, the engine says which in one line."""
    from moeferry.moe.predictors import FittedPredictors

    path = str(tmp_path / "ckpt")
    config = dict(FAMILIES)["qwen3_moe"]
    make_checkpoint(config, path)
    with pytest.raises(ConfigError, match="--moe-prefetch fitted needs --moe-prefetch-predictor"):
        prefetching(path, config.num_experts, moe_prefetch="fitted")
    foreign = str(tmp_path / "foreign.safetensors")
    FittedPredictors({7: torch.nn.Linear(config.hidden_size, config.num_experts)}).save(foreign)
    with pytest.raises(ConfigError, match="predictors are for layers \\[7\\]") as info:
        prefetching(path, config.num_experts, moe_prefetch="fitted", moe_prefetch_predictor=foreign)
    assert "\n" not in str(info.value)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="not a predictors file"):
        prefetching(path, config.num_experts, moe_prefetch="fitted", moe_prefetch_predictor=str(bad))


def test_the_miss_copy_is_refused_where_nothing_reads_it_and_a_cpu_gathers(tmp_path):
    """--moe-miss-copy belongs to the slot-cache strategies; on a CPU, with no copy engine,
    dma copies by the gather and the tokens are gpu's."""
    path = str(tmp_path / "ckpt")
    config = dict(FAMILIES)["qwen3_moe"]
    make_checkpoint(config, path)
    for strategy in ("gpu", "uva", "cpu"):
        with pytest.raises(ConfigError, match="--moe-miss-copy"):
            LLM(path, dtype="float32", device="cpu", moe_strategy=strategy, moe_miss_copy="gather")
    with pytest.raises(ConfigError, match="--moe-miss-copy"):
        LLM(path, dtype="float32", device="cpu", moe_strategy="offload", moe_miss_copy="rdma")
    want = tokens(LLM(path, dtype="float32", device="cpu"))
    llm = LLM(path, dtype="float32", device="cpu", moe_strategy="offload", moe_cache_slots=config.num_experts,
              moe_miss_copy="dma", moe_collect_stats=True)
    assert tokens(llm) == want
    store = llm.engine.runner.strategy.store
    assert store.copy_engine() is None and store.stats()["decode"]["total"]["misses"] > 0


class _CopyEngineHere:
    """kernels/gather_copy/copy_engine.py's CopyEngine, its worker's copies done in `post`."""

    def __init__(self, host_banks, slot_banks, capacity, device):
        self.host_banks, self.slot_banks, self.capacity = host_banks, slot_banks, capacity
        self.posted = []

    def post(self, layer, plan):
        count = int(plan[0])
        self.posted.append((layer, count))
        src, dst = plan[1:1 + count].long(), plan[1 + self.capacity:1 + self.capacity + count].long()
        for host, slot in zip(self.host_banks[layer], self.slot_banks):
            slot[dst] = host[src]

    def wait(self):
        pass

    def error_code(self):
        return 0


def test_demand_copies_on_a_copy_engine_give_gpus_tokens(tmp_path, monkeypatch):
    """The dma way's wiring, its engine's copies done in place: the admission's one-buffer
    plan, the host banks in MoE-layer order, copies before the fused MoE; every miss of a
    layer comes from its own posts."""
    from moeferry.kernels.gather_copy import copy_engine

    path = str(tmp_path / "ckpt")
    config = dict(FAMILIES)["qwen3_moe"]
    make_checkpoint(config, path)
    want = tokens(LLM(path, dtype="float32", device="cpu"))
    monkeypatch.setattr(copy_engine, "available", lambda device: True)
    monkeypatch.setattr(copy_engine, "CopyEngine", _CopyEngineHere)
    llm = LLM(path, dtype="float32", device="cpu", moe_strategy="offload", moe_cache_slots=config.num_experts,
              moe_miss_copy="dma", moe_collect_stats=True)
    assert tokens(llm) == want
    store = llm.engine.runner.strategy.store
    posted = store.copy_engine().posted
    misses = store.stats()["decode"]["total"]["misses"] + store.stats()["prefill"]["total"]["misses"]
    assert misses > 0 and sum(count for _, count in posted) == misses
