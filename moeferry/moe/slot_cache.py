"""The GPU expert slot cache: which experts of which layer sit in which slot of the pool.

One ``SlotCache`` serves every MoE layer of a model. ``admit`` (device-side admission,
kernels/admission/) turns a call's routes into slot ids and writes a copy plan;
``copy_misses`` (kernels/gather_copy/) brings the planned experts from host memory into
their slots. Both run on the current stream without host syncs on the GPU path, so a decode
step's admissions and copies replay inside one CUDA graph.
"""
from __future__ import annotations

import torch

from moeferry.kernels.admission import AdmissionTuning, SlotState, admit
from moeferry.kernels.gather_copy import GatherTuning, gather_copy, row_bytes
from moeferry.moe.stats import PHASES, MoEStats

DEFAULT_MAX_ROUTES = 8192


def slots_for_gb(gb: float, expert_bytes: int) -> int:
    """The experts --moe-cache-gb holds: whole experts in gb GiB (2**30 bytes)."""
    return int(gb * 2**30 // expert_bytes)


class SlotCache:
    """Device-side slot cache over ``num_slots`` slots shared by ``num_layers`` MoE layers of
    ``num_experts`` experts each.

    State (``self.state``, allocated once, updated in place, never reallocated):
    ``slot_of[L, E]`` int32 (-1: absent), ``owner_of[S]`` int32 (``moe_layer * E + e``, -1:
    free), ``last_used[S]`` int64, ``score[S]`` float32 (LRFU), ``clock[1]`` int64, the copy
    plan ``plan_src/plan_dst[P]`` int32 + ``plan_count[1]``, ``P = min(E, max_routes)``.

    Eviction policies (``eviction_policy``; exact victim order in kernels/admission/reference.py):
    ``"lru"`` evicts the least recently used slot of any layer; ``"lrfu"`` the lowest
    decayed-frequency score (``lrfu_decay``); ``"layer_lru"`` first the layer's own least
    recently used slots, then other layers' MOST recently used ones. Layers are admitted
    cyclically, so when one decode step needs more distinct experts over all layers than
    there are slots, ``"lru"`` always evicts the layer admitted next and hits nothing;
    ``"layer_lru"`` keeps each layer's share and takes any extra slots from the layer
    admitted last (furthest from its next use): hits stay near the cached fraction of
    the experts under uniform routing.

    Invariants: ``slot_of`` and ``owner_of`` are inverse maps; a slot used by an admission is
    never evicted by that admission (hence ``S >= E``); after ``copy_misses`` every occupied
    slot of the pool holds its owner's rows. Call ``copy_misses`` after each admission that
    may miss and before the next admission: the plan is rewritten by every call, and stream
    order keeps a call's fresh slots loaded before a later call can evict them.
    """

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, *,
                 device: torch.device | str = "cpu", eviction_policy: str = "lru",
                 lrfu_decay: float = 0.5, max_routes: int = DEFAULT_MAX_ROUTES,
                 collect_stats: bool = True, expert_bytes: int = 0,
                 impl: str | None = None, tuning: AdmissionTuning = AdmissionTuning()):
        if num_slots < num_experts:
            raise ValueError(f"a slot cache of {num_slots} slots cannot hold one layer's "
                             f"{num_experts} experts: use at least {num_experts} slots")
        if num_layers < 1 or num_experts < 1 or max_routes < 1:
            raise ValueError(f"need at least one layer, expert and route, got "
                             f"{num_layers=}, {num_experts=}, {max_routes=}")
        device = torch.device(device)
        self.state = SlotState.allocate(num_layers, num_experts, num_slots, max_routes,
                                        device, eviction_policy, lrfu_decay)
        self.expert_bytes = expert_bytes
        self.stats = (MoEStats(num_layers, num_experts, device, expert_bytes)
                      if collect_stats else None)
        self.impl, self.tuning = impl, tuning

    # -- the two operations -------------------------------------------------------------

    def admit(self, moe_layer: int, topk_ids: torch.Tensor, phase: str = "decode") -> torch.Tensor:
        """Admit every expert routed by ``topk_ids`` into MoE layer ``moe_layer``; returns slot ids
        shaped like ``topk_ids`` (int32 view of a static buffer, valid until the next call).
        ``phase`` picks the statistics bucket (decode or prefill)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        counters = self.stats.bucket(phase) if self.stats is not None else None
        return admit(self.state, moe_layer, topk_ids, counters, tuning=self.tuning, impl=self.impl)

    def copy_misses(self, host_banks: list[torch.Tensor], slot_banks: list[torch.Tensor]) -> None:
        """Copy the last admission's misses: rows ``plan_src`` of the layer's host banks
        (``[E, ...]``, pinned) into rows ``plan_dst`` of the slot banks (``[S, ...]``).
        The statistics' ``expert_bytes``, unless given to the constructor, is taken from the
        banks' row sizes here."""
        for host, slot in zip(host_banks, slot_banks):
            if host.shape[0] != self.num_experts or slot.shape[0] != self.num_slots:
                raise ValueError(f"banks must be [{self.num_experts}, ...] and "
                                 f"[{self.num_slots}, ...], got {tuple(host.shape)} and "
                                 f"{tuple(slot.shape)}")
        if self.stats is not None and not self.stats.expert_bytes:
            self.stats.expert_bytes = sum(row_bytes(bank) for bank in host_banks)
        s = self.state
        gather_copy(host_banks, slot_banks, s.plan_src, s.plan_dst, s.plan_count, impl=self.impl)

    def admit_ahead(self, moe_layer: int, predicted_ids: torch.Tensor) -> None:
        """Lookahead: admit MoE layer ``moe_layer``'s predicted experts before it routes, beside
        the experts of the last admission, which stay (kernels/admission/reference.py); the
        plan goes to ``ahead_*`` for ``copy_ahead``. Counts nothing. The caller guarantees room:
        ``num_slots`` at least the last call's distinct experts plus the predicted ones
        (``has_room_ahead``)."""
        admit(self.state, moe_layer, predicted_ids, None, tuning=self.tuning, impl=self.impl, ahead=True)

    def has_room_ahead(self, routes: int, predicted: int) -> bool:
        """Whether a lookahead of ``predicted`` routes fits beside a call of ``routes``."""
        return self.num_slots >= min(self.num_experts, routes) + min(self.num_experts, predicted)

    def copy_ahead(self, host_banks: list[torch.Tensor], slot_banks: list[torch.Tensor],
                   tuning: GatherTuning = GatherTuning()) -> None:
        """Copy the last lookahead admission's misses, as ``copy_misses`` copies a call's (the
        gather run with ``tuning``: a lookahead's copies run beside compute, which a smaller
        grid slows less)."""
        s = self.state
        gather_copy(host_banks, slot_banks, s.ahead_src, s.ahead_dst, s.ahead_count, tuning=tuning, impl=self.impl)

    def load_experts(self, moe_layer: int, topk_ids: torch.Tensor, host_banks: list[torch.Tensor],
                     slot_banks: list[torch.Tensor], phase: str = "decode") -> torch.Tensor:
        """``admit`` then ``copy_misses``: the routes' experts resident, their slot ids."""
        slot_ids = self.admit(moe_layer, topk_ids, phase)
        self.copy_misses(host_banks, slot_banks)
        return slot_ids

    @torch.no_grad()
    def fill(self, host_banks: list[list[torch.Tensor]], slot_banks: list[torch.Tensor]) -> int:
        """Warm start of an EMPTY cache: layer l's experts ``host_banks[l]`` (one ``[E, ...]``
        tensor per bank, layers in order) go to consecutive slots until the slots run out,
        copied in one block per layer and bank. A filled slot keeps ``last_used`` -1 (and
        LRFU score 0) until an admission uses it: until then it ranks as a victim like a free
        slot, so experts the warm start guessed wrong go before any expert in use. Not
        counted in the statistics. With empty bank lists only the maps are filled (a
        simulation's warm start, routing/simulate.py). Returns the experts filled."""
        s, num_experts = self.state, self.num_experts
        if bool((s.owner_of >= 0).any()):
            raise RuntimeError("fill() needs an empty cache: call reset() first")
        filled = 0
        for moe_layer, banks in enumerate(host_banks[:self.num_layers]):
            count = min(num_experts, self.num_slots - filled)
            if count <= 0:
                break
            slots = torch.arange(filled, filled + count, dtype=torch.int32, device=s.slot_of.device)
            s.slot_of[moe_layer, :count] = slots
            s.owner_of[filled:filled + count] = moe_layer * num_experts + torch.arange(
                count, dtype=torch.int32, device=s.owner_of.device)
            for host, slot in zip(banks, slot_banks):
                slot[filled:filled + count].copy_(host[:count], non_blocking=True)
            filled += count
        s.last_used[:filled] = -1
        s.score[:filled] = 0.0
        return filled

    def set_statistics(self, on: bool) -> None:
        """Count admissions from now on (fresh counters) or stop counting. The admission kernel
        compiles the counters in: recapture any decode graph after this."""
        self.stats = MoEStats(self.num_layers, self.num_experts, self.state.slot_of.device,
                              self.expert_bytes) if on else None

    def reset(self) -> None:
        """Empty the cache and zero the statistics, in place."""
        self.state.reset()
        if self.stats is not None:
            self.stats.reset()

    def __getattr__(self, name: str):
        """The state's fields and sizes (``slot_of``, ``owner_of``, ``plan_count``,
        ``num_slots``, ``eviction_policy``, ...) read as the cache's own."""
        state = self.__dict__.get("state")
        if state is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(state, name)
