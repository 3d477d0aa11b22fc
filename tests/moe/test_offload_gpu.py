"""GPU: offloaded decode and demand prefill over the slot pool are bit-identical to the
resident layer; the whole step (admission, copy, GEMM) captures as a CUDA graph; end to end,
`offload` and `uva` generate what `gpu` generates."""

import pytest
import torch

from moeferry.engine.cuda_graph import capture
from moeferry.kernels.fused_moe import fused_moe
from moeferry.engine.planner import plan_memory
from moeferry.moe.slot_cache import SlotCache

pytestmark = pytest.mark.gpu

H, I, E, TOP_K, LAYERS = 512, 256, 64, 2, 24


def _layer_banks(gen, layers=LAYERS):
    w13 = [torch.randn(E, 2 * I, H, generator=gen).mul_(0.05).to(torch.bfloat16).pin_memory() for _ in range(layers)]
    w2 = [torch.randn(E, H, I, generator=gen).mul_(0.05).to(torch.bfloat16).pin_memory() for _ in range(layers)]
    return w13, w2


def _routes(gen, rows):
    scores = torch.rand(rows, E, generator=gen)
    weights, ids = torch.topk(torch.softmax(scores, -1), TOP_K)
    return weights.float().cuda(), ids.to(torch.int32).cuda()


@pytest.mark.parametrize("slots", [1100, E])
def test_wide_step_over_slots_is_bit_identical_to_the_resident_layer(slots):
    gen = torch.Generator().manual_seed(slots)
    w13, w2 = _layer_banks(gen)
    cache = SlotCache(LAYERS, E, slots, device="cuda", collect_stats=True)
    pool13 = torch.zeros(slots, 2 * I, H, dtype=torch.bfloat16, device="cuda")
    pool2 = torch.zeros(slots, H, I, dtype=torch.bfloat16, device="cuda")
    for layer in range(1, LAYERS):  # decode left other layers' experts resident
        _, ids = _routes(gen, 8)
        cache.load_experts(layer, ids, [w13[layer], w2[layer]], [pool13, pool2])
    hidden = torch.randn(600, H, generator=gen).to(torch.bfloat16).cuda()
    weights, ids = _routes(gen, 600)
    slot_ids = cache.load_experts(0, ids, [w13[0], w2[0]], [pool13, pool2])
    got = fused_moe(hidden, pool13, pool2, weights, slot_ids, num_routed_experts=E)
    ref = fused_moe(hidden, w13[0].cuda(), w2[0].cuda(), weights, ids, num_routed_experts=E)
    assert torch.equal(got, ref)
    snap = cache.stats.snapshot()["decode"]["per_layer"]
    assert snap["calls"][0] == 1 and snap["distinct"][0] == len(torch.unique(ids))


def test_offload_step_replays_as_a_cuda_graph_from_a_cold_cache():
    gen = torch.Generator().manual_seed(7)
    w13, w2 = _layer_banks(gen, layers=3)
    slots = E + 10
    cache = SlotCache(3, E, slots, device="cuda")
    pool13 = torch.zeros(slots, 2 * I, H, dtype=torch.bfloat16, device="cuda")
    pool2 = torch.zeros(slots, H, I, dtype=torch.bfloat16, device="cuda")
    hidden = torch.randn(16, H, generator=gen).to(torch.bfloat16).cuda()
    weights, ids = _routes(gen, 16)

    def step():
        outs = []
        for layer in range(3):
            s = cache.load_experts(layer, ids, [w13[layer], w2[layer]], [pool13, pool2])
            outs.append(fused_moe(hidden, pool13, pool2, weights, s, num_routed_experts=E))
        return outs

    graph, outs = capture(step)
    cache.reset()
    pool13.fill_(float("nan"))
    pool2.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for layer in range(3):
        ref = fused_moe(hidden, w13[layer].cuda(), w2[layer].cuda(), weights, ids, num_routed_experts=E)
        assert torch.equal(outs[layer], ref)


@pytest.mark.parametrize("options", [
    dict(moe_strategy="offload", moe_cache_slots=32),
    dict(moe_strategy="offload", moe_prefill_demand_tokens=64),
    dict(moe_strategy="offload", moe_cache_slots=32, disable_cuda_graph=True),
    dict(moe_strategy="offload", moe_cache_slots=32, moe_miss_copy="dma"),
    dict(moe_strategy="offload", moe_prefill_demand_tokens=64, moe_miss_copy="dma"),
    dict(moe_strategy="uva"),
], ids=["offload-one-layer", "offload-demand", "offload-eager", "offload-dma", "offload-demand-dma", "uva"])
def test_strategies_generate_what_gpu_generates(options):
    from moeferry import LLM, SamplingParams
    from moeferry.default_model import ensure_default_model

    path = ensure_default_model()
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(10, 50))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM(path, max_running_requests=4).generate(prompts, params)]
    got = [o.token_ids for o in LLM(path, max_running_requests=4, **options).generate(prompts, params)]
    assert got == ref


@pytest.mark.parametrize("demand", [0, 256, 512, 1024, "auto"])
def test_greedy_outputs_identical_at_every_demand_threshold(demand):
    from moeferry import LLM, SamplingParams
    from moeferry.default_model import ensure_default_model

    path = ensure_default_model()
    prompts = [list(range(1, 300)), [9, 8, 7], list(range(10, 50))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in LLM(path, max_running_requests=4).generate(prompts, params)]
    llm = LLM(path, max_running_requests=4, moe_strategy="offload", moe_cache_slots=48,
              moe_prefill_demand_tokens=demand, moe_collect_stats=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    chunks = llm.engine.runner.strategy.stats()["prefill_chunks"]
    if demand == 0:
        assert chunks["demand"] == 0
    elif demand == 1024:
        assert chunks["stream"] == 0


def test_600_token_demand_chunk_equals_the_streamed_layer_bit_for_bit():
    """After decode left other layers' experts resident, a 600-token, 1,200-route chunk through
    the strategy's demand path equals its streamed path exactly, over 1,100 slots and over one layer's."""
    from types import SimpleNamespace

    from moeferry.config import EngineConfig
    from moeferry.moe.strategies import create_strategy

    gen = torch.Generator().manual_seed(3)
    for slots in (1100, E):
        ec = EngineConfig(moe_strategy="offload", moe_prefill_demand_tokens=600, moe_cache_slots=slots,
                          moe_collect_stats=True, dtype="bfloat16")
        mc = SimpleNamespace(num_experts=E, top_k=TOP_K, num_layers=4, max_position_embeddings=1024)
        strategy = create_strategy("offload", ec, mc)
        for layer in range(4):
            banks = strategy.allocate_banks(layer, E, H, I)
            banks.w13.copy_(torch.randn(banks.w13.shape, generator=gen) * 0.05)
            banks.w2.copy_(torch.randn(banks.w2.shape, generator=gen) * 0.05)
        strategy.finalize(plan_memory(strategy.engine_config, strategy.memory_needs()))
        strategy.store.cache.reset()  # cold, so the chunk's admission misses
        for layer in (1, 2, 3):
            hidden = torch.randn(8, H, generator=gen).to(torch.bfloat16).cuda()
            weights, ids = _routes(gen, 8)
            strategy.forward(layer, hidden, weights, ids, is_decode=True)
        hidden = torch.randn(600, H, generator=gen).to(torch.bfloat16).cuda()
        weights, ids = _routes(gen, 600)
        strategy.begin_forward(False, 600)
        demand = strategy.forward(0, hidden, weights, ids, is_decode=False)
        strategy.prefill.policy.threshold = 0
        strategy.begin_forward(False, 600)
        streamed = strategy.forward(0, hidden, weights, ids, is_decode=False)
        assert torch.equal(demand, streamed)
        stats = strategy.stats()
        assert stats["prefill"]["per_layer"]["calls"] == [1, 0, 0, 0]
        assert stats["decode"]["per_layer"]["calls"] == [0, 1, 1, 1]


def test_streamed_chunks_over_a_scattered_cache_are_bit_identical_to_the_resident_layer():
    """Decode left a scattered share of each layer resident; three streamed chunks in a row (the
    copy stream's events order the buffers' reuse across layers and chunks) read the resident
    experts from their slots and only the others from the copied buffers: the resident
    layer's bits, nothing admitted, only the missing experts' bytes streamed."""
    from types import SimpleNamespace

    from moeferry.config import EngineConfig
    from moeferry.moe.strategies import create_strategy

    layers, slots = 6, 3 * E + 17
    gen = torch.Generator().manual_seed(11)
    ec = EngineConfig(moe_strategy="offload", moe_cache_slots=slots, moe_collect_stats=True, dtype="bfloat16")
    mc = SimpleNamespace(num_experts=E, top_k=TOP_K, num_layers=layers, max_position_embeddings=1024)
    strategy = create_strategy("offload", ec, mc)
    for layer in range(layers):
        banks = strategy.allocate_banks(layer, E, H, I)
        banks.w13.copy_(torch.randn(banks.w13.shape, generator=gen) * 0.05)
        banks.w2.copy_(torch.randn(banks.w2.shape, generator=gen) * 0.05)
    strategy.finalize(plan_memory(strategy.engine_config, strategy.memory_needs()))
    for _ in range(4):
        for layer in range(layers):
            hidden = torch.randn(8, H, generator=gen).to(torch.bfloat16).cuda()
            weights, ids = _routes(gen, 8)
            strategy.forward(layer, hidden, weights, ids, is_decode=True)
    resident = (strategy.store.cache.slot_of >= 0).sum(dim=1).tolist()
    assert sum(0 < r < E for r in resident) >= 2, resident
    slot_of = strategy.store.cache.slot_of.clone()
    device_banks = {layer: (b.w13.cuda(), b.w2.cuda()) for layer, b in strategy.banks.items()}
    for chunk in range(3):
        hidden = torch.randn(300, H, generator=gen).to(torch.bfloat16).cuda()
        weights, ids = _routes(gen, 300)
        strategy.begin_forward(False, 300)
        outs = [strategy.forward(layer, hidden, weights, ids, is_decode=False) for layer in range(layers)]
        for layer, got in enumerate(outs):
            ref = fused_moe(hidden, *device_banks[layer], weights, ids, num_routed_experts=E)
            assert torch.equal(got, ref), (chunk, layer)
    assert torch.equal(strategy.store.cache.slot_of, slot_of)
    stats = strategy.stats()
    assert stats["prefill"]["total"]["calls"] == 0
    assert stats["prefill_streamed_bytes"] == 3 * (layers * E - sum(resident)) * strategy.expert_bytes
