"""Expert slot cache admission, plain torch: the oracle for kernels/admission/triton.py.

Both modules expose ``admit(state, layer, topk_ids, counters) -> slot_ids`` with the same
contract; this one may sync with the host (it is the CPU path), the Triton one may not.

Admission of one call (``now`` is the clock after its increment):

1. ``D`` = sorted distinct expert ids among the routes. A route outside ``[0, E)`` (for
   example ``-1`` padding) is ignored: not counted anywhere, and its slot id is ``-1``.
2. Hits (``slot_of[layer, e] >= 0``) refresh their slot: ``last_used = now``; under LRFU
   ``score = 1 + score * decay_pow(now - last_used)`` first (product, then sum, both
   rounded to float32; no fused multiply-add).
3. Candidates are the slots not refreshed by step 2 (``last_used != now``). Each is ranked
   by an int64 key: ``0`` for a free slot (owner -1) and for a slot filled by the warm start
   and never used since (``last_used`` -1, see SlotCache.fill); otherwise ``last_used + 1`` (LRU), or
   ``float32_bits(score * decay_pow(now - last_used)) + 1`` (LRFU; scores are >= 0 so their
   bits order like the values), or for LAYER_LRU ``last_used + 1`` when the slot's owner
   belongs to ``moe_layer`` and ``2 * now - last_used`` when it belongs to another layer. The
   i-th miss, in ascending expert id, takes the i-th candidate in ascending
   ``(key, slot index)``. Its former owner's ``slot_of`` entry
   becomes -1; ``owner_of``, ``slot_of``, ``last_used = now`` and ``score = 1`` are set.
4. The copy plan holds the misses: ``plan_src[i]`` expert id, ``plan_dst[i]`` slot,
   ``plan_count = #misses``; entries past the count are left as they were.
5. ``slot_ids[r] = slot_of[layer, topk_ids[r]]`` after the update.
6. Counters (optional): ``calls[layer] += 1``, ``distinct[layer] += |D|``,
   ``misses[layer] += #misses``, ``freq[layer, e] += 1`` per valid route (when present).

LAYER_LRU, the order it gives: free slots first, then the layer's own slots by ascending
``last_used`` (least recently used first), then other layers' slots by DESCENDING
``last_used`` (most recently used first), ties by slot index. The key encodes exactly that
because an occupied candidate has ``0 <= last_used < now`` (every fill or hit stamps the
slot with its call's clock, and the clock only grows): own slots map into ``[1, now]``,
other layers' into ``[now + 1, 2 * now]``. Why: MoE layers are admitted cyclically, so under
plain LRU a step whose layers need more distinct experts than the cache holds evicts, at
every call, the slots of the layer admitted next, and every call misses (0% hits; LRU on a
loop larger than the cache). Under LAYER_LRU a layer first recycles its own least recently
used experts, so it keeps its share; when it must take slots from other layers (its routed
experts outnumber its own evictable slots), it takes them from the layer admitted most
recently, i.e. the one whose next admission is furthest away (Belady's choice on a cycle),
instead of from the layer admitted next. It is meant for decode steps that visit every
layer in order; a layer that is never admitted again keeps its slots until others' fill up.

A lookahead admission (``ahead=True``: a prefetch of a later layer's predicted experts)
is the same call with three differences: the clock is NOT advanced (``now`` is the clock as
the last call left it), so every slot that call used (``last_used == now``) stays out of the
candidates and the experts of the layer still computing are never evicted; its plan goes to
``ahead_src/ahead_dst/ahead_count``, so its copies can run beside the next call's; and it
writes no ``slot_ids`` (the previous call's are still being read) and counts nothing. It
needs ``S >= |D_last| + |D|`` candidates, the caller's to guarantee (SlotCache.admit_ahead).
It refreshes and fills with the same ``now``, so the routed layer's own admission that
follows finds the prefetched experts as hits.

``decay_pow(dt)`` is exact in float32 and shared by every implementation: with
``pow2[k] = decay ** (2 ** k)`` built by repeated float32 squaring (``pow2[0] = decay``),
``decay_pow(dt)`` multiplies ``1.0`` by ``pow2[k]`` for every set bit ``k < pow_bits`` of
``dt`` in ascending ``k``; if ``dt >> pow_bits`` is non-zero the result is ``pow_tail``
(0.0, or 1.0 when decay is 1). ``pow_bits`` is the first k at which the squares stop
changing (they reach 0.0, or stay 1.0).

Invariant kept: ``slot_of`` and ``owner_of`` are inverse maps over resident experts; a slot
used by a call (hit or freshly filled) is never evicted by that same call, because the
cache has at least as many slots as a layer has experts (``S >= E >= |D|``).
"""
from __future__ import annotations

import torch

from moeferry.kernels.admission.state import AdmissionCounters, DecayPowers, SlotState, check_call


def decay_pow(dt: torch.Tensor, decay: DecayPowers) -> torch.Tensor:
    """float32 ``decay ** dt`` for int64 ``dt >= 0``, by the table (see module docstring)."""
    result = torch.ones(dt.shape, dtype=torch.float32, device=dt.device)
    for k in range(decay.bits):
        bit_set = ((dt >> k) & 1) == 1
        result = result * torch.where(bit_set, decay.table[k], torch.ones_like(result))
    return torch.where((dt >> decay.bits) != 0, torch.full_like(result, decay.tail), result)


def _slot_keys(state: SlotState, moe_layer: int, now: int) -> torch.Tensor:
    """Victim ranking keys of all slots, before excluding this call's slots."""
    if state.eviction_policy == "lrfu":
        decayed = state.score * decay_pow(now - state.last_used, state.decay)
        key = decayed.view(torch.int32).to(torch.int64) + 1
    elif state.eviction_policy == "layer_lru":
        own = torch.div(state.owner_of, state.num_experts, rounding_mode="floor") == moe_layer
        key = torch.where(own, state.last_used + 1, 2 * now - state.last_used)
    else:
        key = state.last_used + 1
    occupied_and_used = (state.owner_of >= 0) & (state.last_used >= 0)
    return torch.where(occupied_and_used, key, torch.zeros_like(key))


def _refresh_hits(state: SlotState, hit_slots: torch.Tensor, now: int) -> None:
    if state.eviction_policy == "lrfu":
        p = decay_pow(now - state.last_used[hit_slots], state.decay)
        state.score[hit_slots] = (state.score[hit_slots] * p) + 1.0
    state.last_used[hit_slots] = now


def _choose_victims(state: SlotState, moe_layer: int, num_misses: int, now: int) -> torch.Tensor:
    candidates = torch.nonzero(state.last_used != now).flatten()
    keys = _slot_keys(state, moe_layer, now)[candidates]
    order = torch.sort(keys, stable=True).indices  # candidates ascend by slot: ties by index
    return candidates[order[:num_misses]]


def _install(state: SlotState, moe_layer: int, misses: torch.Tensor, victims: torch.Tensor,
             now: int) -> None:
    old_owner = state.owner_of[victims].long()
    state.slot_of.view(-1)[old_owner[old_owner >= 0]] = -1
    state.owner_of[victims] = (moe_layer * state.num_experts + misses).to(torch.int32)
    state.slot_of[moe_layer, misses] = victims.to(torch.int32)
    state.last_used[victims] = now
    state.score[victims] = 1.0


def admit(state: SlotState, moe_layer: int, topk_ids: torch.Tensor,
          counters: AdmissionCounters | None = None, tuning=None, ahead: bool = False) -> torch.Tensor | None:
    """Admit one call's routes; returns ``slot_ids`` shaped like ``topk_ids`` (int32 view of
    ``state.slot_ids``), or None for a lookahead admission (``ahead``). See the module
    docstring for the exact semantics. ``tuning`` (the Triton kernel's) changes nothing here."""
    num_routes = check_call(state, moe_layer, topk_ids)
    if not ahead:
        state.clock.add_(1)
    now = int(state.clock.item())
    plan_src, plan_dst, plan_count = ((state.ahead_src, state.ahead_dst, state.ahead_count) if ahead
                                      else (state.plan_src, state.plan_dst, state.plan_count))
    ids = topk_ids.reshape(-1).long()
    valid = (ids >= 0) & (ids < state.num_experts)
    distinct = torch.unique(ids[valid])  # sorted
    slots = state.slot_of[moe_layer, distinct].long()
    _refresh_hits(state, slots[slots >= 0], now)
    misses = distinct[slots < 0]
    num_misses = misses.numel()
    if num_misses:
        victims = _choose_victims(state, moe_layer, num_misses, now)
        if victims.numel() < num_misses:
            raise RuntimeError(f"{num_misses} misses, {victims.numel()} candidate slots: a lookahead "
                               "admission needs room beside the last call's experts")
        _install(state, moe_layer, misses, victims, now)
        plan_src[:num_misses] = misses.to(torch.int32)
        plan_dst[:num_misses] = victims.to(torch.int32)
    plan_count.fill_(num_misses)
    if ahead:
        return None
    out = state.slot_ids[:num_routes]
    safe_ids = torch.where(valid, ids, torch.zeros_like(ids))
    out.copy_(torch.where(valid, state.slot_of[moe_layer, safe_ids], torch.full_like(out, -1)))
    if counters is not None:
        _count(counters, moe_layer, ids[valid], distinct.numel(), num_misses)
    return out.view(topk_ids.shape)


def _count(counters: AdmissionCounters, moe_layer: int, valid_ids: torch.Tensor,
           num_distinct: int, num_misses: int) -> None:
    counters.calls[moe_layer] += 1
    counters.distinct[moe_layer] += num_distinct
    counters.misses[moe_layer] += num_misses
    if counters.freq is not None:
        counters.freq[moe_layer].index_add_(0, valid_ids, torch.ones_like(valid_ids))
