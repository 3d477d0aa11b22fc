"""The host strategies: the CPU computes routed experts beside the PCIe link.

`cpu`: every routed expert of a decode step (and of a prefill chunk taken on demand) is
computed on the host from the pinned host banks; attention and the rest run on the GPU. Long
prefill chunks stream layers through the double buffer, as `offload` does (every expert:
`cpu` has no slot cache; `hybrid` reads its resident experts from their slots).

`hybrid`: `offload`'s slot cache, plus the host as a second channel. Per layer and step, the
resident routed experts run on the GPU; of the misses, a share set by the two channels'
measured speeds (`ChannelSpeeds.host_share`, the host's figure kept current during decode by
`SplitTuner`) is computed on the host while the rest is
copied and admitted as `offload` does, both at once (moe/host_experts.py draws the timeline).
The cache policy still decides what stays: host-computed experts are not admitted.

Both give `gpu`'s output within bf16 rounding: each route is computed by one channel, with
the same rounding points (activation and weighted route output in bf16), and the per-route
outputs are combined by selection, never by addition.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from moeferry.kernels.fused_moe import host as host_kernel
from moeferry.kernels.fused_moe.reference import sum_route_partials
from moeferry.kernels.route_split import split_routes
from moeferry.moe.host_experts import HostExpertChannel, SplitTuner, TunerSettings, measure_speeds
from moeferry.moe.offload import LayerStream, OffloadStrategy
from moeferry.moe.prefill_policy import AUTO
from moeferry.moe.strategies import ExpertNeeds

logger = logging.getLogger(__name__)

# `cpu` under --moe-prefill-demand-tokens auto: chunks of at most this many tokens are computed on
# the host. The host kernel reads each routed expert once per chunk, but its arithmetic grows
# with the tokens per expert while streaming a layer costs the same for any chunk.
AUTO_HOST_PREFILL_TOKENS = 32


def _summed(per_route: torch.Tensor, dtype: torch.dtype, sum_routes: bool) -> torch.Tensor:
    """[T, K, H] route outputs, or their fixed-order float32 sum cast once (fused_moe's sum)."""
    return sum_route_partials(per_route).to(dtype) if sum_routes else per_route


class HostChannelMixin:
    """What both host strategies add to `offload`: the channel, its measured speeds, and the
    per-layer count of experts the host computed in decode (a device counter, graph-safe)."""

    channel: HostExpertChannel
    speeds = None

    def _build_channel(self) -> None:
        ec, mc = self.engine_config, self.model_config
        demand = self.prefill_policy.threshold
        if demand == AUTO:
            widest_chunk = AUTO_HOST_PREFILL_TOKENS if self.name == "cpu" else ec.max_prefill_tokens
        else:
            widest_chunk = demand
        threads = ec.moe_host_threads or host_kernel.default_threads()
        self.channel = HostExpertChannel(self.banks, max(ec.max_running_requests, widest_chunk, 1), mc.top_k,
                                         self.device, threads, self.dtype)
        self.speeds = measure_speeds(self.banks, self.channel, mc.top_k, self.device)
        if ec.moe_host_share is not None:
            self.speeds = dataclasses.replace(self.speeds, share=ec.moe_host_share)
        self.host_experts = torch.zeros(len(self.moe_layer_of), dtype=torch.int64, device=self.device)
        logger.info("host channel: %d threads; expert bytes/s: PCIe %.1f GB/s, host kernel %.1f GB/s + %.0f us a "
                    "call; the host takes round(%.2f x misses - %.2f) of a layer's missed experts", threads,
                    self.speeds.pcie_bytes_per_s / 1e9, self.speeds.host_bytes_per_s / 1e9,
                    self.speeds.host_call_s * 1e6, self.speeds.host_share, self.speeds.host_offset)

    def _host_routes(self, layer_id, hidden, topk_weights, host_ids) -> torch.Tensor:
        self.channel.begin(layer_id, hidden, topk_weights, host_ids)
        return self.channel.finish()

    def _channel_stats(self) -> dict:
        host = self.host_experts.tolist()
        return {"speeds": self.speeds.as_dict() if self.speeds else None, "threads": self.channel.threads,
                "host_kernel": host_kernel.timing() if self.channel.compiled else None,
                "host_experts": sum(host), "host_experts_per_layer": host,
                "host_bytes": sum(host) * self.expert_bytes, "host_stalled": self.channel.stalled()}


class CpuStrategy(HostChannelMixin, OffloadStrategy):
    """Every routed expert computed on the host (decode and demand prefill chunks); long prefill
    chunks streamed through the layer buffers, every expert of each layer (nothing is
    resident). Invariants: no slot cache and no device copy of any expert outside the stream
    buffers; the host banks are the only full copy."""

    name = "cpu"

    def memory_needs(self) -> ExpertNeeds:
        return dataclasses.replace(super().memory_needs(), wants_slots=False)

    def finalize(self, plan) -> None:
        num_experts = self.model_config.num_experts
        buffers = next(iter(self.banks.values())).like(2 * num_experts, self.device)
        self.stream = LayerStream(buffers, 0, num_experts, len(self.moe_layer_of))
        self._build_channel()

    def restart_cache(self) -> None:
        self.host_experts.zero_()

    def _on_host(self, layer_id, hidden, topk_weights, topk_ids, is_decode, sum_routes):
        if is_decode:
            distinct = torch.zeros(self.model_config.num_experts, dtype=torch.int32, device=topk_ids.device)
            distinct.index_fill_(0, topk_ids.reshape(-1).long(), 1)
            self.host_experts[self.moe_layer_of[layer_id]] += distinct.sum()
        routes = self._host_routes(layer_id, hidden, topk_weights, topk_ids)
        return _summed(routes, hidden.dtype, sum_routes)

    def forward(self, layer_id, hidden, topk_weights, topk_ids, is_decode, sum_routes=True):
        if is_decode:
            return self._on_host(layer_id, hidden, topk_weights, topk_ids, True, sum_routes)
        if self.decision.demand is None:  # auto: short chunks on the host, where streaming would cost more
            self.decision = self.prefill_policy.decide(hidden.shape[0] <= AUTO_HOST_PREFILL_TOKENS)
            if not self.decision.demand:
                self._start_stream()
        if self.decision.demand:
            return self._on_host(layer_id, hidden, topk_weights, topk_ids, False, sum_routes)
        return self._streamed(layer_id, hidden, topk_weights, topk_ids, sum_routes)

    def admits_prefill(self) -> bool:
        return False

    def stats(self) -> dict:
        return {"strategy": self.name, "experts": self.total_experts, "expert_bytes": self.expert_bytes,
                "prefill_streamed_bytes": self.streamed_bytes, "prefill_chunks": dict(self.prefill_policy.decisions),
                **self._channel_stats()}


class HybridStrategy(HostChannelMixin, OffloadStrategy):
    """`offload` plus the host channel for a share of each step's misses (module docstring).
    Invariants: those of `offload`'s slot cache; a route is computed by exactly one channel;
    the routes the host computes are never admitted, so they cost the cache nothing."""

    name = "hybrid"
    timeline = None  # a moe/timeline.py LayerTimeline over HYBRID_POINTS, set before capturing to profile
    tuner_settings = TunerSettings()  # how the split follows the host (a class default; set before finalize)

    def finalize(self, plan) -> None:
        super().finalize(plan)
        self._build_channel()
        self.tuner = SplitTuner(self.speeds, self.device, self.tuner_settings)
        self.rotation = torch.zeros(1, dtype=torch.int64, device=self.device)

    def begin_forward(self, is_decode: bool, num_tokens: int) -> None:
        super().begin_forward(is_decode, num_tokens)
        if not is_decode:
            self.tuner.interrupt()

    def begin_decode_step(self) -> None:
        self.tuner.decode_step()

    def restart_cache(self) -> None:
        super().restart_cache()
        self.host_experts.zero_()

    def _through_cache(self, layer_id, hidden, topk_weights, topk_ids, phase, sum_routes):
        if self.cache.num_slots >= self.total_experts:  # nothing can miss: offload's path, no host node
            return super()._through_cache(layer_id, hidden, topk_weights, topk_ids, phase, sum_routes)
        moe_layer = self.moe_layer_of[layer_id]
        mark = self._marker(moe_layer, phase)
        mark("start")
        tally = self.host_experts[moe_layer:moe_layer + 1] if phase == "decode" else None
        host_ids, device_ids, _ = split_routes(topk_ids, self.cache.slot_of[moe_layer], self.tuner.split,
                                               self.rotation, tally)
        mark("split")
        self.channel.begin(layer_id, hidden, topk_weights, host_ids)
        mark("posted")
        bank = self.banks[layer_id]
        slot_ids = self.cache.load_experts(moe_layer, device_ids, bank.tensors(), self.pool.tensors(), phase=phase)
        mark("copied")
        on_host = host_ids >= 0
        device_routes = self._compute(hidden, self.pool, topk_weights.masked_fill(on_host, 0.0),
                                      slot_ids.clamp(min=0), bank.num_experts, sum_routes=False)
        mark("computed")
        host_routes = self.channel.finish()
        mark("joined")
        routes = torch.where(on_host.unsqueeze(-1), host_routes.to(device_routes.dtype), device_routes)
        out = _summed(routes, hidden.dtype, sum_routes)
        mark("combined")
        return out

    def _marker(self, moe_layer: int, phase: str):
        """Stamps a decode layer's points (moe/timeline.py HYBRID_POINTS) when a timeline is set."""
        timeline = self.timeline
        if timeline is None or phase != "decode":
            return lambda point: None
        return lambda point: timeline.mark(moe_layer, point)

    def stats(self) -> dict:
        """`offload`'s statistics plus the host channel's, and `decode_split`: the decode
        steps' distinct routed experts by channel (hit: resident; copied: over PCIe; host),
        totals and per step, with the bytes each channel moved."""
        out = {**super().stats(), **self._channel_stats(), "split_now": self.tuner.as_dict()}
        if "decode" in out:
            cache = out["decode"]["total"]
            steps = max(out["decode"]["per_layer"]["calls"], default=0)
            split = {"hit": cache["distinct"] - cache["misses"], "copied": cache["misses"], "host": out["host_experts"]}
            split.update(pcie_bytes=split["copied"] * self.expert_bytes, host_bytes=out["host_bytes"], steps=steps)
            split["per_step"] = {k: split[k] / steps if steps else 0.0 for k in ("hit", "copied", "host")}
            out["decode_split"] = split
        return out
