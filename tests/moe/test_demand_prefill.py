"""Demand-loaded prefill at the layer level (CPU): which chunks go on demand, what they admit,
how they are counted, and that their output is the streamed layer's, bit for bit."""

from types import SimpleNamespace

import pytest
import torch

from moeferry.config import ConfigError, EngineConfig
from moeferry.kernels.fused_moe import fused_moe
from moeferry.moe import strategy as strategy_module
from moeferry.moe.strategies import create_strategy
from moeferry.engine.planner import plan_memory
from moeferry.moe.prefill_policy import PrefillPolicy, parse_demand_tokens, validate_demand_prefill

H, I, E, TOP_K = 32, 16, 160, 2


def _strategy(demand, slots=2 * E, layers=2):
    ec = EngineConfig(device="cpu", dtype="float32", moe_strategy="offload", moe_prefill_demand_tokens=demand,
                      moe_cache_slots=slots, moe_collect_stats=True)
    mc = SimpleNamespace(num_experts=E, top_k=TOP_K, num_layers=layers, max_position_embeddings=512)
    strategy = create_strategy("offload", ec, mc)
    gen = torch.Generator().manual_seed(0)
    for layer in range(layers):
        banks = strategy.allocate_banks(layer, E, H, I)
        banks.w13.copy_(torch.randn(banks.w13.shape, generator=gen) * 0.1)
        banks.w2.copy_(torch.randn(banks.w2.shape, generator=gen) * 0.1)
    strategy.finalize(plan_memory(strategy.engine_config, strategy.memory_needs()))
    strategy.store.cache.reset()  # cold: these tests count the misses a chunk's admission takes
    return strategy


def _chunk(tokens, gen, cover_all=True):
    """A chunk whose routes cover every expert of the layer once the chunk is wide enough."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    if cover_all and tokens * TOP_K >= E:
        ids.view(-1)[:E] = torch.randperm(E, generator=gen).to(torch.int32)
        ids = torch.stack([row if len(set(row.tolist())) == TOP_K else torch.tensor([row[0], (row[0] + 1) % E])
                           for row in ids]).to(torch.int32)
    weights = torch.rand(tokens, TOP_K, generator=gen)
    return torch.randn(tokens, H, generator=gen), weights / weights.sum(-1, keepdim=True), ids


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def spy(hidden, w13, w2, weights, ids, **kw):
        seen.append(SimpleNamespace(w13=w13, num_routed_experts=kw["num_routed_experts"]))
        return fused_moe(hidden, w13, w2, weights, ids, **kw)

    monkeypatch.setattr(strategy_module, "fused_moe", spy)
    return seen


def test_a_96_token_chunk_goes_on_demand_and_a_97_token_chunk_streams(calls):
    strategy = _strategy(96)
    gen = torch.Generator().manual_seed(1)
    hidden, weights, ids = _chunk(96, gen)
    assert len(torch.unique(ids)) == E
    strategy.begin_forward(False, 96)
    got = strategy.forward(0, hidden, weights, ids, is_decode=False)
    assert calls[-1].w13 is strategy.store.pool.w13 and calls[-1].num_routed_experts == E  # the view names the layer's 160
    stats = strategy.stats()
    assert stats["prefill"]["per_layer"]["calls"] == [1, 0]
    assert stats["prefill"]["per_layer"]["distinct"] == [E, 0]
    assert stats["prefill"]["per_layer"]["misses"] == [E, 0]
    assert stats["decode"]["total"]["calls"] == 0 and sum(map(sum, stats["decode"]["freq"])) == 0
    host = strategy.banks[0]
    streamed = fused_moe(hidden, host.w13, host.w2, weights, ids, num_routed_experts=E)
    assert torch.equal(got, streamed)

    hidden, weights, ids = _chunk(97, gen)
    strategy.begin_forward(False, 97)
    strategy.forward(1, hidden, weights, ids, is_decode=False)
    assert calls[-1].w13 is strategy.store.stream.banks.w13  # streamed: the pool's banks, slots and stream buffers
    assert strategy.stats()["prefill"]["per_layer"]["calls"] == [1, 0]
    assert strategy.stats()["prefill_chunks"] == {"demand": 1, "stream": 1}


@pytest.mark.parametrize("threshold, on_demand", [(0, []), (2, [1, 2])])
def test_threshold_picks_the_chunks(threshold, on_demand):
    policy = PrefillPolicy(threshold)
    assert [n for n in (1, 2, 3, 96) if policy.begin(n).demand] == on_demand


def test_auto_decides_before_the_forward_only_when_every_expert_is_resident():
    policy = PrefillPolicy("auto")
    held = torch.zeros(2, 8, dtype=torch.int32)
    assert policy.begin(4, held).demand is False and policy.decisions == {"demand": 0, "stream": 1}
    held[1, 3] = -1
    assert policy.begin(4, held).demand is None and policy.begin(4).demand is None
    assert policy.decisions == {"demand": 0, "stream": 1}  # undecided chunks are counted when decided


def test_auto_takes_short_chunks_on_demand_and_streams_chunks_that_need_every_expert():
    strategy = _strategy("auto")
    gen = torch.Generator().manual_seed(2)
    for tokens, expect_demand in [(1, True), (96, False)]:
        hidden, weights, ids = _chunk(tokens, gen)
        strategy.begin_forward(False, tokens)
        assert strategy.prefill.decision.demand is None  # decided at the first MoE layer
        strategy.forward(0, hidden, weights, ids, is_decode=False)
        assert strategy.prefill.decision.demand is expect_demand, (tokens, strategy.prefill.decision)


def test_auto_streams_a_fully_resident_cache_without_waiting_for_the_first_layer(monkeypatch):
    """Every expert resident: the chunk streams nothing, decided before any layer runs (no
    read of the first layer's routing in the middle of the forward), and its output is the
    one the slots give."""
    strategy = _strategy("auto")
    strategy.restart_cache()  # warm: 2 x 160 slots hold both layers' experts
    assert bool((strategy.store.cache.slot_of >= 0).all())
    monkeypatch.setattr(strategy.prefill.policy, "decide_auto", lambda *a: pytest.fail("waited for the routing"))
    gen = torch.Generator().manual_seed(3)
    hidden, weights, ids = _chunk(4, gen)
    strategy.begin_forward(False, 4)
    assert strategy.prefill.decision.demand is False and strategy.store.stream.copied == [0, 0]
    got = strategy.forward(0, hidden, weights, ids, is_decode=False)
    host = strategy.banks[0]
    assert torch.equal(got, fused_moe(hidden, host.w13, host.w2, weights, ids, num_routed_experts=E))
    assert strategy.stats()["prefill_chunks"] == {"demand": 0, "stream": 1}


def test_demand_prefill_is_refused_without_gpu_offload_decode():
    for strategy in ("gpu", "uva", "offload"):
        ec = EngineConfig(device="cpu", moe_strategy=strategy, moe_prefill_demand_tokens=8)
        with pytest.raises(ConfigError, match="needs GPU decode"):
            validate_demand_prefill(ec)
    validate_demand_prefill(EngineConfig(device="cpu", moe_prefill_demand_tokens=0))
    validate_demand_prefill(EngineConfig(device="cpu", moe_strategy="cpu", moe_prefill_demand_tokens=8))


def test_flag_values():
    assert parse_demand_tokens("auto") == "auto" and parse_demand_tokens("512") == 512
    with pytest.raises(ConfigError, match="token count or 'auto'"):
        parse_demand_tokens("lots")
    with pytest.raises(ConfigError, match=">= 0"):
        parse_demand_tokens(-1)


def test_cpu_on_a_cpu_device_takes_short_chunks_to_the_host_channel(tmp_path):
    """`cpu` with --moe-prefill-demand-tokens on a machine without a GPU: chunks up to the
    threshold go to the host channel (nothing copied into the stream buffers), longer ones
    stream, and the tokens are `gpu`'s."""
    from moeferry import LLM, SamplingParams
    from tests.support.fixtures import family_configs, make_checkpoint

    path = str(tmp_path / "ckpt")
    make_checkpoint(dict(family_configs())["qwen3_moe"], path)
    prompts = [[5, 17, 33, 2, 9, 71, 40], list(range(3, 40))]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, dtype="float32", device="cpu").generate(prompts, greedy)]
    llm = LLM(path, dtype="float32", device="cpu", moe_strategy="cpu", moe_prefill_demand_tokens=16,
              max_running_requests=1)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want
    stats = llm.engine.runner.strategy.stats()
    assert stats["prefill_chunks"]["demand"] >= 1 and stats["prefill_chunks"]["stream"] >= 1
