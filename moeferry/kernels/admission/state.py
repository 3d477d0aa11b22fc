"""The admission state every implementation reads and writes: the slot cache's device maps,
the copy plan, the statistics counters and the LRFU decay table (see reference.py for the
semantics of an admission, and SlotCache for the life cycle)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from moeferry.kernels import size_of

POLICIES = ("lru", "lrfu", "layer_lru")


class AdmissionCounters(NamedTuple):
    """One statistics bucket (decode or prefill): int64 device tensors, ``[L]`` and ``[L, E]``."""

    calls: torch.Tensor
    distinct: torch.Tensor
    misses: torch.Tensor
    freq: torch.Tensor | None  # route histogram; None where not collected (prefill)


@dataclass(frozen=True)
class DecayPowers:
    """``decay ** (2 ** k)`` for k < bits, in float32, and the value past them (see module)."""

    table: torch.Tensor  # float32 [max(bits, 1)]
    bits: int
    tail: float

    @classmethod
    def build(cls, decay: float, device) -> "DecayPowers":
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"lrfu_decay must be in (0, 1], got {decay}")
        powers = [np.float32(decay)]
        while powers[-1] != 0.0 and powers[-1] != 1.0 and len(powers) < 62:
            powers.append(np.float32(powers[-1] * powers[-1]))
        tail = float(powers[-1]) if powers[-1] in (0.0, 1.0) else 0.0
        bits = len(powers) - 1 if powers[-1] in (0.0, 1.0) else len(powers)
        table = torch.tensor([float(p) for p in powers], dtype=torch.float32, device=device)
        return cls(table=table, bits=bits, tail=tail)


@dataclass(frozen=True)
class SlotState:
    """Every tensor an admission reads or writes, allocated once (static for CUDA graphs).

    Maps: ``slot_of[L, E]`` int32, ``owner_of[S]`` int32 (flat ``moe_layer * E + e``),
    ``last_used[S]`` int64, ``score[S]`` float32 (LRFU only, kept at 0 under LRU),
    ``clock[1]`` int64. Plan: ``plan_src[P]``, ``plan_dst[P]`` int32, ``plan_count[1]`` int32
    with ``P = min(E, max_routes)``, views of one buffer ``plan[1 + 2P]`` (count, sources,
    destinations: kernels/gather_copy/copy_engine.py's plan, staged to the host by the copy
    engine's posting kernel); a lookahead admission's own plan ``ahead_src``, ``ahead_dst[P]``,
    ``ahead_count[1]``, views of ``ahead_plan[1 + 2P]`` alike (its copies run beside the next
    call's, so they never share a plan).
    Output: ``slot_ids[max_routes]`` int32. Scratch for the Triton kernel (the reference does
    not touch it): ``expert_mark[E]`` int64,
    ``slot_key[S]`` int64, ``victim_key[P]`` int64, ``victim_slot[P]`` int32,
    ``ordered_victims[P]`` int32.
    """

    slot_of: torch.Tensor
    owner_of: torch.Tensor
    last_used: torch.Tensor
    score: torch.Tensor
    clock: torch.Tensor
    plan_src: torch.Tensor
    plan_dst: torch.Tensor
    plan_count: torch.Tensor
    plan: torch.Tensor
    ahead_src: torch.Tensor
    ahead_dst: torch.Tensor
    ahead_count: torch.Tensor
    ahead_plan: torch.Tensor
    slot_ids: torch.Tensor
    expert_mark: torch.Tensor
    slot_key: torch.Tensor
    victim_key: torch.Tensor
    victim_slot: torch.Tensor
    ordered_victims: torch.Tensor
    decay: DecayPowers
    eviction_policy: str
    max_routes: int

    @classmethod
    def allocate(cls, num_layers: int, num_experts: int, num_slots: int, max_routes: int,
                 device, eviction_policy: str = "lru", lrfu_decay: float = 0.5) -> "SlotState":
        if eviction_policy not in POLICIES:
            raise ValueError(f"cache policy must be one of {POLICIES}, got {eviction_policy!r}")
        plan_size = min(num_experts, max_routes)

        def buf(n, dtype, fill=0):
            return torch.full(n, fill, dtype=dtype, device=device)

        plan = buf((1 + 2 * plan_size,), torch.int32)
        ahead_plan = buf((1 + 2 * plan_size,), torch.int32)
        return cls(
            slot_of=buf((num_layers, num_experts), torch.int32, -1),
            owner_of=buf((num_slots,), torch.int32, -1),
            last_used=buf((num_slots,), torch.int64, -1),
            score=buf((num_slots,), torch.float32),
            clock=buf((1,), torch.int64),
            plan_src=plan[1:1 + plan_size],
            plan_dst=plan[1 + plan_size:],
            plan_count=plan[:1],
            plan=plan,
            ahead_src=ahead_plan[1:1 + plan_size],
            ahead_dst=ahead_plan[1 + plan_size:],
            ahead_count=ahead_plan[:1],
            ahead_plan=ahead_plan,
            slot_ids=buf((max_routes,), torch.int32, -1),
            expert_mark=buf((num_experts,), torch.int64),
            slot_key=buf((num_slots,), torch.int64),
            victim_key=buf((plan_size,), torch.int64),
            victim_slot=buf((plan_size,), torch.int32),
            ordered_victims=buf((plan_size,), torch.int32),
            decay=DecayPowers.build(lrfu_decay, device),
            eviction_policy=eviction_policy,
            max_routes=max_routes,
        )

    num_layers = size_of("slot_of", 0)
    num_experts = size_of("slot_of", 1)
    num_slots = size_of("owner_of", 0)

    def reset(self) -> None:
        """Empty the cache in place (clock and plan included); nothing is reallocated."""
        for t, v in ((self.slot_of, -1), (self.owner_of, -1), (self.last_used, -1),
                     (self.score, 0), (self.clock, 0), (self.plan_count, 0),
                     (self.ahead_count, 0), (self.expert_mark, 0)):
            t.fill_(v)


def check_call(state: SlotState, moe_layer: int, topk_ids: torch.Tensor) -> int:
    """Validate an admission's arguments (no device sync); returns the number of routes."""
    if not 0 <= moe_layer < state.num_layers:
        raise ValueError(f"moe_layer {moe_layer} out of range [0, {state.num_layers})")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.device != state.slot_of.device:
        raise ValueError(f"topk_ids on {topk_ids.device}, cache on {state.slot_of.device}")
    num_routes = topk_ids.numel()
    if num_routes > state.max_routes:
        raise ValueError(f"{num_routes} routes exceed the cache's max_routes={state.max_routes}")
    return num_routes
