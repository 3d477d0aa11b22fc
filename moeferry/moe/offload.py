"""The offload strategy: experts in (pinned) host memory, a device slot pool shared by every
MoE layer, device-side admission, and a prefill that either streams each layer through a
double buffer or demand-loads a short chunk's experts through the slot cache.

Decode step of one MoE layer, all on the device and inside the decode CUDA graph:
  admit(layer, topk_ids) -> slot ids + copy plan;  gather copy of the misses;
  fused_moe over the slot pool at the slot ids (tiles sized by the layer's expert count).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from moeferry.kernels.fused_moe import fused_moe
from moeferry.moe.prefill_policy import PrefillDecision, PrefillPolicy
from moeferry.moe.slot_cache import DEFAULT_MAX_ROUTES, SlotCache
from moeferry.moe.strategies import ExpertBanks, ExpertNeeds, MoEStrategy

logger = logging.getLogger(__name__)


class LayerStream:
    """Double-buffered prefill stream: every expert of MoE layer l is copied into buffer l % 2
    on a copy stream, layer l+1's copy running behind layer l's compute.

    Invariants: a buffer is overwritten only after the compute that read it has finished
    (event `consumed`); compute on a buffer starts only after its copy finished (event
    `ready`). The buffers are separate from the slot pool: streaming never evicts decode's
    resident experts.
    """

    def __init__(self, sample: ExpertBanks, num_experts: int, device):
        self.buffers = [sample.like(num_experts, device) for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device)
        self.ready = [torch.cuda.Event() for _ in range(2)]
        self.consumed = [torch.cuda.Event() for _ in range(2)]
        self.order: list[int] = []
        self.position: dict[int, int] = {}

    def _issue_copy(self, index: int, host: ExpertBanks) -> None:
        buf = index % 2
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.consumed[buf])
            for dst, src in zip(self.buffers[buf].tensors(), host.tensors()):
                dst.copy_(src, non_blocking=True)
            self.ready[buf].record(self.copy_stream)

    def begin(self, moe_layer_order: list[int], host_banks: dict[int, ExpertBanks]) -> None:
        self.order, self.position = moe_layer_order, {l: i for i, l in enumerate(moe_layer_order)}
        self.host = host_banks
        self._issue_copy(0, host_banks[moe_layer_order[0]])

    def acquire(self, layer_id: int) -> tuple[ExpertBanks, int]:
        index = self.position[layer_id]
        if index + 1 < len(self.order):
            self._issue_copy(index + 1, self.host[self.order[index + 1]])
        buf = index % 2
        torch.cuda.current_stream().wait_event(self.ready[buf])
        return self.buffers[buf], buf

    def release(self, buf: int) -> None:
        self.consumed[buf].record(torch.cuda.current_stream())


class OffloadStrategy(MoEStrategy):
    """Experts in host memory (pinned when the compute device is a GPU), a slot cache on the
    compute device.

    Invariants: the host banks are the only full copy of the experts; the slot pool holds,
    in each occupied slot, exactly its owner's rows (the slot cache's invariant); decode and
    demand prefill compute over the slot pool at slot ids, streamed prefill over a layer
    buffer; the same kernel with tiles from the layer's expert count makes both give the
    `gpu` strategy's bits.
    """

    name = "offload"

    def __init__(self, engine_config, model_config):
        super().__init__(engine_config, model_config)
        self.prefill_policy = PrefillPolicy(engine_config.moe_prefill_demand_tokens)
        self.cache: SlotCache | None = None
        self.stream: LayerStream | None = None
        self.decision = PrefillDecision(False)
        self.streamed_bytes = 0

    def bank_device(self) -> torch.device:
        return torch.device("cpu")

    def memory_needs(self) -> ExpertNeeds:
        """Slots, the host store, and on a GPU the two layer buffers of streamed prefill."""
        streams = self.device.type == "cuda"
        stream_bytes = 2 * self.model_config.num_experts * self.expert_bytes if streams else 0
        return dataclasses.replace(super().memory_needs(), wants_slots=True, stream_bytes=stream_bytes,
                                   host_bytes=self.total_experts * self.expert_bytes)

    def finalize(self, plan) -> None:
        self.build_cache(plan.expert_slots)
        num_experts = self.model_config.num_experts
        if self.device.type == "cuda":
            self.stream = LayerStream(next(iter(self.banks.values())), num_experts, self.device)

    def build_cache(self, slots: int, eviction_policy: str | None = None) -> None:
        """(Re)build the slot cache and its pool at `slots` slots under `eviction_policy`
        (default: --moe-cache-policy), warm: filled with the first layers' experts in layer order (all
        of them when they fit), so a cache that holds every expert never misses. A captured
        decode graph holds the old pool's pointers: on a running engine, call
        ModelRunner.recapture_graphs() after this."""
        ec, num_experts = self.engine_config, self.model_config.num_experts
        eviction_policy = eviction_policy or ec.moe_cache_policy
        total = num_experts * len(self.moe_layer_of)
        self.cache = self.pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        top_k = self.model_config.top_k
        demand_width = ec.max_prefill_tokens if self.prefill_policy.auto else self.prefill_policy.threshold
        widest = max(DEFAULT_MAX_ROUTES, ec.max_running_requests * top_k, demand_width * top_k)
        self.cache = SlotCache(len(self.moe_layer_of), num_experts, slots, device=self.device, eviction_policy=eviction_policy,
                               lrfu_decay=ec.moe_lrfu_decay, collect_stats=ec.moe_collect_stats,
                               expert_bytes=self.expert_bytes, max_routes=widest)
        self.pool = next(iter(self.banks.values())).like(slots, self.device, zero=True)
        filled = self._warm_start()
        logger.info("expert cache: %d slots of %d experts (%.1f%%), %.2f GiB on %s (%s, %d bytes per expert); policy %s; "
                    "demand prefill: %s; warm start with %d experts", slots, total, 100.0 * slots / total,
                    slots * self.expert_bytes / 2**30, self.device, self.format_description(), self.expert_bytes,
                    eviction_policy, self.prefill_policy.threshold, filled)

    def _warm_start(self) -> int:
        return self.cache.fill([self.banks[l].tensors() for l in sorted(self.banks)], self.pool.tensors())

    def restart_cache(self) -> None:
        """Empty the cache, zero its statistics and warm it again as `build_cache` does, in
        place (captured graphs stay valid): a run measured from here starts from the state a
        routing simulation (routing/simulate.py) starts from, whatever graph capture admitted."""
        self.cache.reset()
        self._warm_start()

    # ---- per forward -------------------------------------------------------------------------
    def begin_forward(self, is_decode: bool, num_tokens: int) -> None:
        if is_decode:
            return
        self.decision = self.prefill_policy.begin(num_tokens)
        if self.decision.demand is False:
            self._start_stream()

    def _start_stream(self) -> None:
        if self.stream is not None:
            self.stream.begin(sorted(self.banks), self.banks)

    def _decide_at_first_layer(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        self.decision = self.prefill_policy.decide_auto(topk_ids, self.moe_layer_of[layer_id], self.cache.slot_of,
                                                self.expert_bytes)
        if not self.decision.demand:
            self._start_stream()

    def _through_cache(self, layer_id, hidden, topk_weights, topk_ids, phase, sum_routes):
        host = self.banks[layer_id]
        slot_ids = self.cache.load_experts(self.moe_layer_of[layer_id], topk_ids, host.tensors(), self.pool.tensors(),
                                           phase=phase)
        return self._compute(hidden, self.pool, topk_weights, slot_ids, host.num_experts, sum_routes)

    @staticmethod
    def _compute(hidden, banks: ExpertBanks, topk_weights, ids, num_routed_experts: int, sum_routes: bool):
        return fused_moe(hidden, banks.w13, banks.w2, topk_weights, ids, num_routed_experts=num_routed_experts,
                         sum_routes=sum_routes, **banks.kernel_args())

    def _streamed(self, layer_id, hidden, topk_weights, topk_ids, sum_routes):
        host = self.banks[layer_id]
        self.streamed_bytes += host.num_experts * self.expert_bytes
        if self.stream is None:  # CPU: the host banks are already where the compute runs
            return self._compute(hidden, host, topk_weights, topk_ids, host.num_experts, sum_routes)
        buffer, buf = self.stream.acquire(layer_id)
        out = self._compute(hidden, buffer, topk_weights, topk_ids, host.num_experts, sum_routes)
        self.stream.release(buf)
        return out

    def forward(self, layer_id, hidden, topk_weights, topk_ids, is_decode, sum_routes=True):
        if is_decode:
            return self._through_cache(layer_id, hidden, topk_weights, topk_ids, "decode", sum_routes)
        if self.decision.demand is None:
            self._decide_at_first_layer(layer_id, topk_ids)
        if self.decision.demand:
            return self._through_cache(layer_id, hidden, topk_weights, topk_ids, "prefill", sum_routes)
        return self._streamed(layer_id, hidden, topk_weights, topk_ids, sum_routes)

    def admits_prefill(self) -> bool:
        return bool(self.decision.demand)

    def stats(self) -> dict:
        out = {"strategy": self.name, "slots": self.cache.num_slots,
               "experts": self.cache.num_layers * self.cache.num_experts,
               "expert_bytes": self.expert_bytes, "expert_format": self.format_description(),
               "prefill_streamed_bytes": self.streamed_bytes,
               "prefill_chunks": dict(self.prefill_policy.decisions)}
        if self.cache.stats is not None:
            out.update(self.cache.stats.snapshot())
        return out
