"""The streamed prefill over the slot pool (CPU: the same row map and copies as on a GPU, the
copies plain): resident experts are read from their slots, only the others are copied, by
runs of expert ids into rows past the slots; the output is the `gpu` strategy's bit for bit
in every expert format and with scattered residency; nothing is admitted, no slot is
written, and the statistics count only the bytes copied."""

from types import SimpleNamespace

import pytest
import torch

from moeferry.config import EngineConfig
from moeferry.engine.planner import plan_memory
from moeferry.kernels.fused_moe import fused_moe
from moeferry.moe import formats
from moeferry.moe.layer_stream import LayerStream, missing_runs
from moeferry.moe.strategies import create_strategy

H, I, E, TOP_K, LAYERS = 32, 16, 16, 2, 4


def _strategy(slots, quantization=None, dtype="float32", name="offload"):
    ec = EngineConfig(device="cpu", dtype=dtype, moe_strategy=name, moe_cache_slots=slots if name == "offload" else None,
                      moe_collect_stats=True, quantization=quantization)
    mc = SimpleNamespace(num_experts=E, top_k=TOP_K, num_layers=LAYERS, max_position_embeddings=512)
    strategy = create_strategy(name, ec, mc)
    gen = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        banks = strategy.allocate_banks(layer, E, H, I)
        w13, w2 = torch.randn(E, 2 * I, H, generator=gen) * 0.1, torch.randn(E, H, I, generator=gen) * 0.1
        if banks.format.quantized:
            (banks.w13[:], banks.w13_scale[:]), (banks.w2[:], banks.w2_scale[:]) = (
                formats.quantize(w13, banks.format), formats.quantize(w2, banks.format))
        else:
            banks.w13.copy_(w13)
            banks.w2.copy_(w2)
    strategy.finalize(plan_memory(strategy.engine_config, strategy.memory_needs()))
    return strategy


def _routes(tokens, gen, dtype=torch.float32):
    scores = torch.rand(tokens, E, generator=gen)
    weights, ids = torch.topk(torch.softmax(scores, -1), TOP_K)
    return torch.randn(tokens, H, generator=gen).to(dtype), weights, ids.to(torch.int32)


def _scatter(strategy, gen, steps=6):
    """Decode steps that leave each layer a scattered share of the slots."""
    for _ in range(steps):
        for layer in range(LAYERS):
            hidden, weights, ids = _routes(3, gen, strategy.dtype)
            strategy.forward(layer, hidden, weights, ids, is_decode=True)


def _gpu(strategy, layer, hidden, weights, ids):
    banks = strategy.banks[layer]
    return fused_moe(hidden, banks.w13, banks.w2, weights, ids, num_routed_experts=E, **banks.kernel_args())


def test_missing_runs():
    missing = torch.tensor([[True, True, False, True, False, False, True], [False] * 7, [True] * 7])
    assert missing_runs(missing) == [[(0, 2), (3, 4), (6, 7)], [], [(0, 7)]]


@pytest.mark.parametrize("quantization, dtype", [(None, "float32"), (None, "bfloat16"), ("fp8", "float32"),
                                                 ("int4", "float32")])
def test_a_streamed_chunk_over_scattered_residency_gives_gpu_bits(quantization, dtype):
    strategy = _strategy(E + E // 2 + 3, quantization, dtype)
    gen = torch.Generator().manual_seed(1)
    _scatter(strategy, gen)
    cache = strategy.store.cache
    slot_of, owner_of = cache.slot_of.clone(), cache.owner_of.clone()
    resident = (slot_of >= 0).sum(dim=1).tolist()
    assert any(0 < r < E for r in resident), resident  # some layer partly resident
    pool = [t.clone() for t in strategy.store.pool.tensors()]
    before = strategy.stats()
    for t in strategy.store.stream.banks.tensors():  # poison the buffers: a route reading a row not copied shows
        t[strategy.store.cache.num_slots:] = float("nan") if t.is_floating_point() else -1
    for chunk in range(2):
        hidden, weights, ids = _routes(40, gen, strategy.dtype)
        strategy.begin_forward(False, 40)
        for layer in range(LAYERS):
            got = strategy.forward(layer, hidden, weights, ids, is_decode=False)
            assert torch.equal(got, _gpu(strategy, layer, hidden, weights, ids)), (chunk, layer)
    after = strategy.stats()
    assert torch.equal(cache.slot_of, slot_of) and torch.equal(cache.owner_of, owner_of)
    assert all(torch.equal(a, b) for a, b in zip(pool, strategy.store.pool.tensors()))  # no slot written
    assert after["prefill"]["total"]["calls"] == 0  # nothing admitted
    assert after["decode"]["total"] == before["decode"]["total"]
    missing = LAYERS * E - sum(resident)
    assert after["prefill_streamed_bytes"] == 2 * missing * strategy.expert_bytes
    assert after["prefill_chunks"]["stream"] == 2


def test_only_the_missing_experts_are_copied_by_runs_into_their_layers_buffer():
    strategy = _strategy(E + E // 2)
    banks, base = strategy.store.stream.banks, strategy.store.cache.num_slots
    slot_of = torch.full((LAYERS, E), -1, dtype=torch.int32)
    resident = {0: [0, 1, 2, 5, 9, 15], 1: list(range(E)), 2: [2, 3, 4], 3: []}
    slot = 0
    for layer, experts in resident.items():
        for e in experts:
            slot_of[layer, e], slot = slot, slot + 1
    stream = LayerStream(banks, base, E, LAYERS)
    for t in banks.tensors():
        t[base:] = float("nan")
    stream.begin(strategy.banks, slot_of)
    assert stream.runs[0] == [(3, 5), (6, 9), (10, 15)] and stream.runs[1] == [] and stream.runs[3] == [(0, E)]
    assert stream.runs[2] == [(0, 2), (5, E)] and stream.copied == [E - 6, 0, E - 3, E]
    for layer in range(LAYERS):
        row_of, copied = stream.acquire(layer)
        buf = base + (layer % 2) * E
        for e in range(E):
            if e in resident[layer]:
                assert row_of[e] == slot_of[layer, e]
            else:
                assert row_of[e] == buf + e
                assert torch.equal(banks.w13[buf + e], strategy.banks[layer].w13[e])
        if layer == 0:  # layer 1 copies nothing: buffer 1 untouched so far
            assert torch.isnan(banks.w13[base + E:]).all()
        stream.release(layer)
    assert torch.isnan(banks.w13[base + 2]).all()  # resident in layers 0 and 2: never copied into buffer 0


def _streamed_chunk_bytes(strategy, tokens: int, seed: int) -> int:
    """One prefill chunk of `tokens` through every layer: each layer's output equals `gpu`'s
    bit for bit; returns the bytes the chunk streamed."""
    hidden, weights, ids = _routes(tokens, torch.Generator().manual_seed(seed))
    before = strategy.stats()["prefill_streamed_bytes"]
    strategy.begin_forward(False, tokens)
    for layer in range(LAYERS):
        assert torch.equal(strategy.forward(layer, hidden, weights, ids, is_decode=False),
                           _gpu(strategy, layer, hidden, weights, ids))
    return strategy.stats()["prefill_streamed_bytes"] - before


def test_a_fully_resident_cache_streams_nothing():
    assert _streamed_chunk_bytes(_strategy(LAYERS * E), 30, seed=2) == 0


def test_auto_weighs_demand_against_the_missing_bytes_only():
    """A fully resident cache streams for free; with one layer of slots, a one-token chunk
    goes on demand (two experts a layer against every missing one)."""
    for slots, expect_demand, stream_experts in ((LAYERS * E, False, 0), (E, True, (LAYERS - 1) * E)):
        strategy = _strategy(slots)
        strategy.prefill.policy.threshold = "auto"
        hidden, weights, ids = _routes(1, torch.Generator().manual_seed(3))
        strategy.begin_forward(False, 1)
        strategy.forward(0, hidden, weights, ids, is_decode=False)
        assert strategy.prefill.decision.demand is expect_demand
        assert strategy.prefill.decision.stream_bytes == stream_experts * strategy.expert_bytes


def test_cpu_strategy_streams_every_expert():
    strategy = _strategy(0, name="cpu")
    assert _streamed_chunk_bytes(strategy, 40, seed=4) == LAYERS * E * strategy.expert_bytes
