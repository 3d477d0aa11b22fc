"""The offload strategy: experts in (pinned) host memory, a device slot pool shared by every
MoE layer, device-side admission, and a prefill that either streams each layer's experts
that are not resident through a double buffer (the resident ones read from their slots) or
demand-loads a short chunk's experts through the slot cache.

Decode step of one MoE layer, all on the device and inside the decode CUDA graph:
  admit(layer, topk_ids) -> slot ids + copy plan;  gather copy of the misses;
  fused_moe over the slot pool at the slot ids (tiles sized by the layer's expert count).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from moeferry.kernels.fused_moe import fused_moe
from moeferry.moe.prefill_policy import PrefillDecision, PrefillPolicy
from moeferry.moe.slot_cache import DEFAULT_MAX_ROUTES, SlotCache
from moeferry.moe.strategies import ExpertBanks, ExpertNeeds, MoEStrategy

logger = logging.getLogger(__name__)


def missing_runs(missing: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of a [L, E] bool tensor on the host, (start, stop) of every run of consecutive
    True values (one vectorized pass: this runs before a chunk's first copy, the GPU idle)."""
    padded = np.zeros((missing.shape[0], missing.shape[1] + 2), dtype=np.int8)
    padded[:, 1:-1] = missing.numpy()
    edges = np.diff(padded, axis=1)
    runs: list[list[tuple[int, int]]] = [[] for _ in range(missing.shape[0])]
    for (row, start), (_, stop) in zip(np.argwhere(edges == 1).tolist(), np.argwhere(edges == -1).tolist()):
        runs[row].append((start, stop))
    return runs


class LayerStream:
    """Streamed prefill over the slot pool: a chunk's experts resident in slots are computed
    from their slots; every other expert of MoE layer l crosses the link into buffer l % 2,
    rows `base + (l % 2) * E + e` of the same banks (past the pool's `base` slots), on a copy
    stream, layer l+1's copy running behind layer l's compute. One fused_moe per layer then
    reads slots and buffer rows alike, at the routes' expert ids mapped to rows on the device
    (`acquire`'s map). Copies go by runs of consecutive missing expert ids, one copy per run
    and bank (scale banks included), on the copy engines.

    `begin` reads the residency (`slot_of`) to the host once per chunk (or takes the copy the
    auto decision read), one device sync. It
    holds for the whole forward: only admission writes the maps, a streamed forward admits
    nothing, and the buffers lie past the slots, so streaming never evicts decode's experts.
    A strategy without a slot cache (`cpu`) passes no residency: every expert streams.

    Invariants: a buffer is overwritten only after the compute that read it has finished
    (event `consumed`); compute on a buffer starts only after its copy finished (event
    `ready`); a layer with every expert resident copies nothing and waits for nothing. On the
    CPU the copies are plain and in order, through the same map.
    """

    def __init__(self, banks: ExpertBanks, base: int, num_experts: int, num_layers: int):
        if banks.num_experts < base + 2 * num_experts:
            raise ValueError(f"stream banks of {banks.num_experts} rows: need {base} slots + 2 x {num_experts}")
        self.banks, self.base, self.num_experts = banks, base, num_experts
        device = banks.w13.device
        buffer = base + (torch.arange(num_layers) % 2)[:, None] * num_experts + torch.arange(num_experts)
        self.buffer_rows = buffer.to(device=device, dtype=torch.int32)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.copy_stream is not None:  # copies come after the banks' allocation (a zero fill)
            self.copy_stream.wait_stream(torch.cuda.current_stream(device))
        self.ready = [torch.cuda.Event() for _ in range(2)] if self.copy_stream else []
        self.consumed = [torch.cuda.Event() for _ in range(2)] if self.copy_stream else []
        self.order: list[int] = []
        self.position: dict[int, int] = {}

    def begin(self, host_banks: dict[int, ExpertBanks], slot_of: torch.Tensor | None,
              slot_of_host: torch.Tensor | None = None) -> None:
        """Start a chunk over every MoE layer of `host_banks` (in layer order): read which
        experts `slot_of` [L, E] holds (None: none; `slot_of_host`: its host copy when the
        caller has read it already), map each (layer, expert) to its row, and issue the first
        layer's copies."""
        self.order, self.position = sorted(host_banks), {l: i for i, l in enumerate(sorted(host_banks))}
        self.host = host_banks
        if slot_of is None:
            self.row_of = self.buffer_rows
            missing = torch.ones(self.buffer_rows.shape, dtype=torch.bool)
        else:
            self.row_of = torch.where(slot_of >= 0, slot_of, self.buffer_rows)
            missing = (slot_of.cpu() if slot_of_host is None else slot_of_host) < 0  # the chunk's one read
        self.runs = missing_runs(missing)
        self.copied = missing.sum(dim=1).tolist()
        self._issue_copy(0)

    def _issue_copy(self, index: int) -> None:
        runs = self.runs[index]
        if not runs:
            return
        buf = index % 2
        first = self.base + buf * self.num_experts
        pairs = list(zip(self.banks.tensors(), self.host[self.order[index]].tensors()))
        if self.copy_stream is None:
            for dst, src in pairs:
                for start, stop in runs:
                    dst[first + start:first + stop].copy_(src[start:stop])
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.consumed[buf])
            for dst, src in pairs:
                for start, stop in runs:
                    dst[first + start:first + stop].copy_(src[start:stop], non_blocking=True)
            self.ready[buf].record(self.copy_stream)

    def acquire(self, layer_id: int) -> tuple[torch.Tensor, int]:
        """The layer's map [E] int32 (expert -> row of `banks`) once its copies have landed, the
        next layer's copies issued first; and how many experts it copied."""
        index = self.position[layer_id]
        if index + 1 < len(self.order):
            self._issue_copy(index + 1)
        if self.copy_stream is not None and self.runs[index]:
            torch.cuda.current_stream().wait_event(self.ready[index % 2])
        return self.row_of[index], self.copied[index]

    def release(self, layer_id: int) -> None:
        """The layer's compute is enqueued: its buffer may be overwritten behind it."""
        index = self.position[layer_id]
        if self.copy_stream is not None and self.runs[index]:
            self.consumed[index % 2].record(torch.cuda.current_stream())


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
        self.slot_of_host: torch.Tensor | None = None  # auto: the residency a prefill chunk read once
        self.streamed_bytes = 0

    def bank_device(self) -> torch.device:
        return torch.device("cpu")

    def memory_needs(self) -> ExpertNeeds:
        """Slots, the host store, and the two layer buffers of streamed prefill (rows past the slots)."""
        stream_bytes = 2 * self.model_config.num_experts * self.expert_bytes
        return dataclasses.replace(super().memory_needs(), wants_slots=True, stream_bytes=stream_bytes,
                                   host_bytes=self.total_experts * self.expert_bytes)

    def finalize(self, plan) -> None:
        self.build_cache(plan.expert_slots)

    def build_cache(self, slots: int, eviction_policy: str | None = None) -> None:
        """(Re)build the slot cache and its pool at `slots` slots under `eviction_policy`
        (default: --moe-cache-policy), warm: filled with the first layers' experts in layer order (all
        of them when they fit), so a cache that holds every expert never misses. A captured
        decode graph holds the old pool's pointers: on a running engine, call
        ModelRunner.recapture_graphs() after this. The pool's banks hold two layers' more rows
        past the slots: the prefill stream's buffers (`LayerStream`), which the cache never sees."""
        ec, num_experts = self.engine_config, self.model_config.num_experts
        eviction_policy = eviction_policy or ec.moe_cache_policy
        total = num_experts * len(self.moe_layer_of)
        self.cache = self.pool = self.stream = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        top_k = self.model_config.top_k
        demand_width = ec.max_prefill_tokens if self.prefill_policy.auto else self.prefill_policy.threshold
        widest = max(DEFAULT_MAX_ROUTES, ec.max_running_requests * top_k, demand_width * top_k)
        self.cache = SlotCache(len(self.moe_layer_of), num_experts, slots, device=self.device, eviction_policy=eviction_policy,
                               lrfu_decay=ec.moe_lrfu_decay, collect_stats=ec.moe_collect_stats,
                               expert_bytes=self.expert_bytes, max_routes=widest)
        banks = next(iter(self.banks.values())).like(slots + 2 * num_experts, self.device, zero=True)
        self.pool = banks.head(slots)
        self.stream = LayerStream(banks, slots, num_experts, len(self.moe_layer_of))
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
        # auto: the residency, read once, before the chunk's work is queued (nothing admits until
        # its first MoE layer decides); the decision and the stream both read this copy
        auto = self.prefill_policy.auto and self.cache is not None
        self.slot_of_host = self.cache.slot_of.cpu() if auto else None
        self.decision = self.prefill_policy.begin(num_tokens, self.slot_of_host)
        if self.decision.demand is False:
            self._start_stream(self.slot_of_host)

    def _start_stream(self, slot_of_host: torch.Tensor | None = None) -> None:
        self.stream.begin(self.banks, self.cache.slot_of if self.cache is not None else None, slot_of_host)

    def _decide_at_first_layer(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        self.decision = self.prefill_policy.decide_auto(topk_ids, self.moe_layer_of[layer_id], self.slot_of_host,
                                                        self.expert_bytes)
        if not self.decision.demand:
            self._start_stream(self.slot_of_host)

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
        """The chunk's layer over slots and stream buffer at once (LayerStream); only the
        experts not resident crossed the link, and only they count as streamed bytes."""
        row_of, copied = self.stream.acquire(layer_id)
        self.streamed_bytes += copied * self.expert_bytes
        rows = row_of.index_select(0, topk_ids.reshape(-1)).view(topk_ids.shape)
        out = self._compute(hidden, self.stream.banks, topk_weights, rows, self.model_config.num_experts, sum_routes)
        self.stream.release(layer_id)
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
