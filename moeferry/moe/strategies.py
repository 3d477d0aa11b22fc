"""MoE strategies: where a layer's routed experts live and who computes them, as compositions of
parts.

    part            what it answers                          kinds (module)
    expert store    where the experts live; the device's     resident, uva, slot cache, host only
                    access to a layer's                       (moe/stores.py)
    prefill route   a prefill chunk streamed or on demand     (moe/prefill_policy.py)
    host compute    the host CPU computing routes             (moe/host_compute.py)
    route split     which routes go to the host               all to host, by channel speed
                                                              (moe/split_policy.py)
    prefetch        the next layer's predicted experts moved  --moe-prefetch (moe/prefetch.py)
                    while a decode layer computes

The device's compute is the fused MoE kernel (kernels/fused_moe) over the banks and rows the
store locates. A strategy name (--moe-strategy) names one composition (`_COMPOSITIONS`):

    gpu      resident store
    uva      uva store
    offload  slot-cache store + prefill route (+ prefetch)
    cpu      host-only store + prefill route + host compute, every route to the host
    hybrid   slot-cache store + prefill route + host compute, the misses split by channel speed
             (+ prefetch)

Under --tensor-parallel-size each rank runs the same composition over its share of every
layer's experts (moe/shard.py), and the strategy adds the ranks' route outputs together.

The MoE layer routes tokens and hands (hidden, topk_weights, topk_ids) to `MoEStrategy.forward`.
Every strategy gives the output of `gpu` for the same inputs.
"""

from __future__ import annotations

from moeferry.errors import ConfigError


def strategy_names() -> list[str]:
    return list(_COMPOSITIONS)


def create_strategy(name: str, engine_config, model_config, shard=None) -> "MoEStrategy":
    """The strategy `name`; with an ExpertShard (moe/shard.py), over the rank's share of each
    layer's experts: its parts see a model of that many experts per layer."""
    if name not in _COMPOSITIONS:
        raise ConfigError(f"--moe-strategy {name!r} is unknown; choose one of: {', '.join(_COMPOSITIONS)}")
    if shard is None:
        return _COMPOSITIONS[name](engine_config, model_config)
    share = model_config.with_layer_experts(len(shard.owned(model_config.num_experts)))
    strategy = _COMPOSITIONS[name](engine_config, share)
    strategy.split_across(shard, model_config.num_experts)
    return strategy


def _gpu(ec, mc):
    from moeferry.moe.stores import ResidentStore
    from moeferry.moe.strategy import MoEStrategy

    return MoEStrategy("gpu", ec, mc, ResidentStore(ec, mc))


def _uva(ec, mc):
    from moeferry.moe.stores import UvaStore
    from moeferry.moe.strategy import MoEStrategy

    return MoEStrategy("uva", ec, mc, UvaStore(ec, mc))


def _offload(ec, mc):
    from moeferry.moe.prefill_policy import PrefillRoute
    from moeferry.moe.stores import SlotStore
    from moeferry.moe.strategy import MoEStrategy

    prefill = PrefillRoute(ec)
    return MoEStrategy("offload", ec, mc, SlotStore(ec, mc, prefill.widest_demand_chunk), prefill=prefill,
                       prefetch=_prefetch(ec, mc))


def _cpu(ec, mc):
    from moeferry.moe.host_compute import HostCompute
    from moeferry.moe.prefill_policy import AUTO_HOST_PREFILL_TOKENS, PrefillRoute
    from moeferry.moe.split_policy import AllToHost
    from moeferry.moe.stores import HostStore
    from moeferry.moe.strategy import MoEStrategy

    prefill = PrefillRoute(ec, host_tokens=AUTO_HOST_PREFILL_TOKENS)
    return MoEStrategy("cpu", ec, mc, HostStore(ec, mc), prefill=prefill,
                       host=HostCompute(ec, mc, prefill.widest_demand_chunk), split=AllToHost(mc.num_experts))


def _hybrid(ec, mc):
    from moeferry.moe.host_compute import HostCompute
    from moeferry.moe.prefill_policy import PrefillRoute
    from moeferry.moe.split_policy import ByChannelSpeed, TunerSettings
    from moeferry.moe.stores import SlotStore
    from moeferry.moe.strategy import MoEStrategy

    prefill = PrefillRoute(ec)
    tuner = TunerSettings(period=ec.moe_tuner_period, min_experts=ec.moe_tuner_min_experts)
    return MoEStrategy("hybrid", ec, mc, SlotStore(ec, mc, prefill.widest_demand_chunk), prefill=prefill,
                       host=HostCompute(ec, mc, prefill.widest_demand_chunk), split=ByChannelSpeed(tuner),
                       prefetch=_prefetch(ec, mc))


def _prefetch(ec, mc):
    """The lookahead part under --moe-prefetch, or None (off)."""
    if ec.moe_prefetch == "off":
        return None
    from moeferry.moe.prefetch import Prefetch

    return Prefetch(ec, mc, ec.moe_prefetch)


_COMPOSITIONS = {"gpu": _gpu, "offload": _offload, "uva": _uva, "cpu": _cpu, "hybrid": _hybrid}
