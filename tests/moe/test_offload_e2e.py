"""End to end on the CPU: `offload` with a cache of exactly one layer's experts generates the
same tokens as `gpu`, for each family; statistics see the decode admissions."""

import pytest

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError
from tests.support.fixtures import family_configs, make_checkpoint

FAMILIES = family_configs()
PROMPTS = [[5, 17, 33, 2, 9, 71, 40], [88, 3], [12, 60, 61, 62, 7, 1, 90, 45, 23, 30, 31, 8, 19]]


@pytest.fixture(scope="module", params=FAMILIES, ids=[n for n, _ in FAMILIES])
def ckpt(request, tmp_path_factory):
    name, config = request.param
    path = str(tmp_path_factory.mktemp(name))
    make_checkpoint(config, path)
    return name, config, path


def test_offload_one_layer_cache_matches_gpu(ckpt):
    name, config, path = ckpt
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    gpu = LLM(path, dtype="float32", device="cpu").generate(PROMPTS, params)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    off = LLM(path, dtype="float32", device="cpu", moe_strategy="offload", moe_cache_slots=experts,
              moe_collect_stats=True)
    got = off.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in gpu]
    stats = off.engine.runner.strategy.stats()
    decode = stats["decode"]["total"]
    assert decode["calls"] > 0 and decode["misses"] > 0  # a one-layer cache misses across layers
    assert decode["misses"] <= decode["distinct"]
    assert stats["prefill"]["total"]["calls"] == 0  # prefill streamed: no admissions


def test_a_cache_of_every_expert_starts_warm_and_never_misses(ckpt):
    name, config, path = ckpt
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    off = LLM(path, dtype="float32", device="cpu", moe_strategy="offload", moe_collect_stats=True)
    strategy = off.engine.runner.strategy
    assert strategy.store.cache.num_slots == strategy.store.cache.num_layers * strategy.store.cache.num_experts
    off.generate(PROMPTS, params)
    decode = strategy.stats()["decode"]["total"]
    assert decode["calls"] > 0 and decode["distinct"] > 0 and decode["misses"] == 0


def test_a_partial_cache_starts_with_the_first_layers_resident(ckpt):
    import torch

    name, config, path = ckpt
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    slots = experts + experts // 2 + 1
    strategy = LLM(path, dtype="float32", device="cpu", moe_strategy="offload",
                   moe_cache_slots=slots).engine.runner.strategy
    cache, pool = strategy.store.cache, strategy.store.pool
    owners = cache.owner_of.tolist()
    assert all(o >= 0 for o in owners)  # every slot filled
    for slot, owner in enumerate(owners):
        layer, expert = divmod(owner, experts)
        assert cache.slot_of[layer, expert] == slot
        host = strategy.banks[sorted(strategy.banks)[layer]]
        assert torch.equal(pool.w13[slot], host.w13[expert]) and torch.equal(pool.w2[slot], host.w2[expert])
    assert int((cache.slot_of >= 0).sum()) == slots  # inverse maps: nothing else resident
    assert (cache.slot_of[0] >= 0).all() and (cache.slot_of[1, : slots - experts] >= 0).all()


@pytest.mark.parametrize("strategy", ["gpu", "uva", "offload"])
def test_demand_prefill_needs_gpu_decode_with_offload(ckpt, strategy):
    name, config, path = ckpt
    with pytest.raises(ConfigError, match="needs GPU decode with --moe-strategy offload"):
        LLM(path, device="cpu", moe_strategy=strategy, moe_prefill_demand_tokens=64)


def test_cache_smaller_than_a_layer_is_refused(ckpt):
    name, config, path = ckpt
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    with pytest.raises(ConfigError, match=f"fewer than one layer's {experts}"):
        LLM(path, device="cpu", moe_strategy="offload", moe_cache_slots=experts - 1)


def test_cache_sizing_from_slots_gigabytes_or_every_expert():
    from moeferry.config import EngineConfig
    from moeferry.engine.planner import plan_memory
    from moeferry.moe.banks import ExpertNeeds

    expert_bytes = 3 * 2**20
    needs = ExpertNeeds(expert_bytes=expert_bytes, total_experts=24, layer_experts=8, wants_slots=True)
    assert plan_memory(EngineConfig(device="cpu", moe_cache_slots=13), needs).expert_slots == 13
    assert plan_memory(EngineConfig(device="cpu", moe_cache_gb=0.03), needs).expert_slots == int(0.03 * 2**30 // expert_bytes)
    assert plan_memory(EngineConfig(device="cpu"), needs).expert_slots == 24


def test_a_dense_model_resets_moe_flags_with_a_warning(tmp_path, caplog):
    import transformers

    from tests.support.fixtures import COMMON

    config = transformers.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                                         mlp_only_layers=[0, 1, 2], **COMMON)
    make_checkpoint(config, str(tmp_path))
    with caplog.at_level("WARNING"):
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", moe_strategy="offload", moe_cache_slots=4)
    assert llm.engine.ec.moe_strategy == "gpu" and llm.engine.ec.moe_cache_slots is None
    assert "dense model: ignoring MoE option(s) --moe-strategy, --moe-cache-slots" in caplog.text
    assert len(llm.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_over_a_partly_resident_cache_matches_gpu_and_streams_only_the_rest(ckpt, dtype):
    """The second batch's prefill finds the residency decode scattered over the layers: it reads
    the resident experts from their slots, streams only the others, and gives gpu's tokens."""
    name, config, path = ckpt
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    slots = experts + experts // 2 + 1
    gpu = LLM(path, dtype=dtype, device="cpu")
    off = LLM(path, dtype=dtype, device="cpu", moe_strategy="offload", moe_cache_slots=slots, moe_collect_stats=True)
    strategy = off.engine.runner.strategy
    for prompts in (PROMPTS, [p[::-1] + [3, 4] for p in PROMPTS]):
        want = [o.token_ids for o in gpu.generate(prompts, params)]
        assert [o.token_ids for o in off.generate(prompts, params)] == want
    resident = (strategy.store.cache.slot_of >= 0).sum(dim=1)
    assert ((resident > 0) & (resident < experts)).sum() >= 1  # some layer partly resident
    stats = strategy.stats()
    assert stats["prefill"]["total"]["calls"] == 0  # streaming never admits
    forwards = stats["prefill_chunks"]["stream"]
    assert forwards >= 2 and stats["prefill_streamed_bytes"] == forwards * (stats["experts"] - slots) * stats["expert_bytes"]
