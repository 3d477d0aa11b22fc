"""Expert slot cache admission as ONE Triton program per call: no host sync, fixed launch.

``admit(state, moe_layer, topk_ids, counters) -> slot_ids`` has the signature and the exact
results (maps, plan, slot ids, counters, bit for bit) of ``kernels/admission/reference.py``,
whose module docstring defines the semantics and the LRFU arithmetic.

Contract
- ``topk_ids``: int32/int64, any shape, ``N <= state.max_routes`` elements (contiguous);
  ids outside ``[0, E)`` are ignored and get slot -1.
- Reads and writes ``state``'s maps (``slot_of[L, E]`` i32, ``owner_of[S]`` i32,
  ``last_used[S]`` i64, ``score[S]`` f32, ``clock[1]`` i64), writes the plan
  (``plan_src/plan_dst[:count]`` i32, ``plan_count[1]`` i32), ``slot_ids[:N]`` i32 and the
  scratch buffers; adds to ``counters`` when given. The clock is read and incremented on
  the device, so the launch shape never depends on device data: CUDA-graph capturable.
- Aliasing: ``topk_ids`` may not alias any state buffer; every state buffer is distinct.
  The returned tensor is a view of ``state.slot_ids``, overwritten by the next call.
- ``ahead=True``: a lookahead admission (reference.py): the clock kept, the plan in
  ``ahead_*``, no slot ids, no counters.
- Invariant: ``slot_of``/``owner_of`` stay inverse maps; a slot used by this call (hit or
  filled) is never evicted by this call (``S >= E`` guarantees enough candidates).

How (one program, phases separated by barriers, every loop over fixed-size chunks):
0. (LRU policies without statistics, at most ``max_block_r`` routes) one pass first: each
   route's slot looked up; when all hit, their recency refreshed, the slot ids written and
   the plan left empty, and the call ends (the common decode step, about half the full
   path's time; benchmarks/RESULTS.md); when any misses, that pass wrote nothing and A-D
   run (the failed try costs such a call little).
A. mark each routed expert with the clock (``expert_mark[e] = now``): a mark array over the
   layer's E experts dedups any width with no [K, K] block (its cost grows with the routes;
   loading the marks first to store only unmarked experts saved nothing). The
   decode histogram is an atomic add per route.
B. walk the E experts in order: marked & resident -> hit (refresh), marked & absent -> miss,
   listed in ascending id by a prefix sum into ``plan_src``.
C. (only when there are misses) rank every candidate slot by an int64 key (the policy's,
   see the reference; LRU's lie in ``[0, now]``, LAYER_LRU's in ``[0, 2 * now]``, LRFU's
   are float32 bits, below ``2 ** 31``) and take the M smallest in (key, slot) order as
   victims, by one of two paths:
   - few misses (``M <= extract_max``) over a pool of at most ``max_block_s`` slots: the
     keys are computed once into registers, each packed with its slot as
     ``key << SLOT_BITS | slot`` (the bounds above keep that below 2**62 for any clock
     below 2**49), and M minimum reductions take the victims in order (one block-wide
     reduction per miss; faster than the radix path at a few misses, benchmarks/RESULTS.md).
   - otherwise a radix select: find the key ``T`` of the M-th smallest (the smallest ``T``
     with ``#{key <= T} >= M``) over ``[lo, hi]``, the candidates' smallest and largest
     key: each sweep over the slots takes a histogram of the digits ``(key - lo) >> shift``
     over ``RADIX = 2 ** RADIX_BITS`` buckets of the bracket, whose prefix sums are the
     counts at ``RADIX`` bounds, and narrows the bracket to the bucket holding ``T``;
     ``#{key < T}`` comes out of the same counts. Take the slots below ``T`` plus the first
     slots (by index) equal to ``T`` (one more sweep), and order those M victims by counting
     comparisons in 64 x 64 tiles. Sweeps over the slots: ``2 + ceil(bits(hi - lo) /
     RADIX_BITS)`` (keys, search, victims). A pool of one block keeps its keys in registers
     here too; a larger one goes through the key buffer.
   Then install the misses into the victims.
D. ``slot_ids`` = ``slot_of[layer, ids]``; counters.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.kernels.admission import AdmissionTuning
from moeferry.kernels.admission.state import AdmissionCounters, SlotState, check_call
from moeferry.kernels.triton_common import pdl_launch, wait_for_previous_kernel

_KEY_NONE = tl.constexpr(9223372036854775807)  # int64 max: "not a candidate"
_VICTIM_TILE = 64
PHASES = ("all-hits try", "mark routes", "hits and misses", "slot keys", "victims",
           "install", "slot ids and counters")
_CALLS_INDEX = tl.constexpr(len(PHASES))  # where phase_cycles() counts the calls
_phase_cycles: dict = {}  # device -> int64 [len(PHASES) + 1]: cycles per phase, then calls


@triton.jit
def _decay_pow(dt, decay_ptr, POW_BITS: tl.constexpr, POW_TAIL: tl.constexpr):
    result = tl.full(dt.shape, 1.0, tl.float32)
    for k in tl.static_range(POW_BITS):
        factor = tl.load(decay_ptr + k)
        result = result * tl.where(((dt >> k) & 1) == 1, factor, 1.0)
    return tl.where((dt >> POW_BITS) != 0, POW_TAIL, result)


@triton.jit
def _sm_clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _stamp(phase_ptr, index, since, ON: tl.constexpr):
    """(AdmissionTuning.phase_clock) Adds the SM cycles since ``since`` to ``phase_ptr[index]`` once
    every thread is done with the phase; returns the clock. Without ON, nothing."""
    if ON:
        tl.debug_barrier()
        clock = _sm_clock()
        tl.store(phase_ptr + index, tl.load(phase_ptr + index) + (clock - since))
        return clock
    else:
        return since


@triton.jit
def _mark_routes(topk_ptr, num_routes, num_experts, layer_base, mark, mark_ptr, freq_ptr,
                 COUNT_FREQ: tl.constexpr, BLOCK_R: tl.constexpr):
    # Route counts by atomics: a histogram per block of routes over the layer's experts
    # and one add of the row measured slower on an H200, and so did adds spread over 8 or
    # 32 copies of the row, folded in phase B (benchmarks/RESULTS.md).
    for start in range(0, num_routes, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        in_range = r < num_routes
        e = tl.load(topk_ptr + r, mask=in_range, other=-1).to(tl.int64)
        valid = in_range & (e >= 0) & (e < num_experts)
        tl.store(mark_ptr + e, tl.full([BLOCK_R], 0, tl.int64) + mark, mask=valid)
        if COUNT_FREQ:
            tl.atomic_add(freq_ptr + layer_base + e, tl.full([BLOCK_R], 1, tl.int64),
                          mask=valid, sem="relaxed")


@triton.jit
def _admit_if_all_hits(topk_ptr, num_routes, num_experts, layer_base, now, slot_of_ptr,
                       last_used_ptr, plan_count_ptr, out_ptr, WRITE_OUT: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    """The whole call when every route hits (LRU policies, no statistics, one block of
    routes): each route's slot refreshed (a repeated expert writes the same ``now`` twice)
    and written out, an empty plan; phases A, B and D in one pass with no barrier. Returns
    the routes that miss; when there are any it writes nothing and the full path runs."""
    r = tl.arange(0, BLOCK_R)
    in_range = r < num_routes
    e = tl.load(topk_ptr + r, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (e >= 0) & (e < num_experts)
    slot = tl.load(slot_of_ptr + layer_base + e, mask=valid, other=-1)
    misses = tl.sum((valid & (slot < 0)).to(tl.int32), 0)
    if misses == 0:
        tl.store(last_used_ptr + slot, tl.full([BLOCK_R], 0, tl.int64) + now, mask=valid)
        if WRITE_OUT:
            tl.store(out_ptr + r, slot, mask=in_range)
        tl.store(plan_count_ptr, 0)
    return misses


@triton.jit
def _refresh_hits_list_misses(num_experts, layer_base, now, mark, mark_ptr, slot_of_ptr,
                              last_used_ptr, score_ptr, plan_src_ptr, decay_ptr,
                              LRFU: tl.constexpr, POW_BITS: tl.constexpr,
                              POW_TAIL: tl.constexpr, BLOCK_E: tl.constexpr):
    num_distinct = tl.sum(tl.zeros([BLOCK_E], tl.int32), 0)
    num_misses = tl.sum(tl.zeros([BLOCK_E], tl.int32), 0)
    for start in range(0, num_experts, BLOCK_E):
        e = start + tl.arange(0, BLOCK_E)
        slot = tl.load(slot_of_ptr + layer_base + e, mask=e < num_experts, other=-1).to(tl.int64)
        seen = (e < num_experts) & (tl.load(mark_ptr + e, mask=e < num_experts, other=0) == mark)
        hit = seen & (slot >= 0)
        miss = (seen & (slot < 0)).to(tl.int32)
        if LRFU:
            last = tl.load(last_used_ptr + slot, mask=hit, other=0)
            old = tl.load(score_ptr + slot, mask=hit, other=0.0)
            decayed = old * _decay_pow(now - last, decay_ptr, POW_BITS, POW_TAIL)
            tl.store(score_ptr + slot, decayed + 1.0, mask=hit)
        tl.store(last_used_ptr + slot, tl.full([BLOCK_E], 0, tl.int64) + now, mask=hit)
        position = num_misses + tl.cumsum(miss, 0) - 1
        tl.store(plan_src_ptr + position, e.to(tl.int32), mask=miss == 1)
        num_misses += tl.sum(miss, 0)
        num_distinct += tl.sum(seen.to(tl.int32), 0)
    return num_distinct, num_misses


@triton.jit
def _slot_keys(s, in_range, now, layer_base, num_experts, owner_of_ptr, last_used_ptr,
               score_ptr, decay_ptr, LRFU: tl.constexpr, LAYER_LRU: tl.constexpr,
               POW_BITS: tl.constexpr, POW_TAIL: tl.constexpr):
    """The keys of slots ``s``: the policy's for candidates, _KEY_NONE for this call's
    slots and for lanes out of range."""
    last = tl.load(last_used_ptr + s, mask=in_range, other=0)
    owner = tl.load(owner_of_ptr + s, mask=in_range, other=-1)  # not masked by `candidate`:
    candidate = in_range & (last != now)  # the loads go out together
    if LRFU:
        score = tl.load(score_ptr + s, mask=in_range, other=0.0)
        decayed = score * _decay_pow(now - last, decay_ptr, POW_BITS, POW_TAIL)
        key = decayed.to(tl.int32, bitcast=True).to(tl.int64) + 1
    else:
        if LAYER_LRU:  # own slots in [1, now] by recency, others' in [now + 1, 2 now] MRU
            flat = owner.to(tl.int64)
            own = (flat >= layer_base) & (flat < layer_base + num_experts)
            key = tl.where(own, last + 1, 2 * now - last)
        else:
            key = last + 1
    key = tl.where((owner >= 0) & (last >= 0), key, 0)  # free, or warm-filled and unused
    return tl.where(candidate, key, _KEY_NONE)


@triton.jit
def _key_range(key):
    """(smallest key, largest candidate key) of a block; (_KEY_NONE, -1) when it has none."""
    return tl.min(key, 0), tl.max(tl.where(key != _KEY_NONE, key, -1), 0)


@triton.jit
def _write_slot_keys(num_slots, now, layer_base, num_experts, owner_of_ptr, last_used_ptr,
                     score_ptr, key_ptr, decay_ptr, LRFU: tl.constexpr,
                     LAYER_LRU: tl.constexpr, POW_BITS: tl.constexpr,
                     POW_TAIL: tl.constexpr, BLOCK_S: tl.constexpr):
    """key[s] for every slot (see _slot_keys); returns (min, max candidate) key."""
    lo = tl.max(tl.full([BLOCK_S], _KEY_NONE, tl.int64), 0)
    hi = tl.max(tl.full([BLOCK_S], -1, tl.int64), 0)
    for start in range(0, num_slots, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        in_range = s < num_slots
        key = _slot_keys(s, in_range, now, layer_base, num_experts, owner_of_ptr,
                         last_used_ptr, score_ptr, decay_ptr, LRFU, LAYER_LRU, POW_BITS,
                         POW_TAIL)
        tl.store(key_ptr + s, key, mask=in_range)
        block_lo, block_hi = _key_range(key)
        lo = tl.minimum(lo, block_lo)
        hi = tl.maximum(hi, block_hi)
    return lo, hi


@triton.jit
def _digit_histogram(key, lo, shift, RADIX: tl.constexpr):
    """hist[j] = #{key in the block : (key - lo) >> shift == j} for j < RADIX.

    Digits outside ``[0, RADIX)`` (keys below ``lo``, keys past the last bucket, padding
    ``_KEY_NONE``) are masked out, and zeroed before the cast to the histogram's int32."""
    digit = (key - lo) >> shift
    inside = (digit >= 0) & (digit < RADIX)
    return tl.histogram(tl.where(inside, digit, 0).to(tl.int32), RADIX, mask=inside)


@triton.jit
def _bucket_counts(key_ptr, keys, num_slots, lo, shift, RADIX: tl.constexpr,
                   BLOCK_S: tl.constexpr, KEYS_IN_REGISTERS: tl.constexpr):
    """_digit_histogram over every slot: of ``keys`` (the whole pool in one block) when
    KEYS_IN_REGISTERS, else of ``key_ptr[:num_slots]`` in one sweep."""
    if KEYS_IN_REGISTERS:
        hist = _digit_histogram(keys, lo, shift, RADIX)
    else:
        hist = tl.zeros([RADIX], tl.int32)
        for start in range(0, num_slots, BLOCK_S):
            s = start + tl.arange(0, BLOCK_S)
            key = tl.load(key_ptr + s, mask=s < num_slots, other=_KEY_NONE)
            hist += _digit_histogram(key, lo, shift, RADIX)
    return hist


@triton.jit
def _threshold_key(key_ptr, keys, num_slots, lo, hi, num_misses, RADIX: tl.constexpr,
                   RADIX_BITS: tl.constexpr, BLOCK_S: tl.constexpr,
                   KEYS_IN_REGISTERS: tl.constexpr):
    """(T, #{key < T}): T the smallest key with #{key <= T} >= num_misses, T in [lo, hi].

    Takes ``lo`` = the smallest key and ``hi`` = the largest candidate key, so that
    ``#{key <= hi} >= num_misses`` (the module contract's ``S >= E``). Keeps ``T`` in
    ``[lo, hi]``, ``below = #{key < lo}`` and ``hi - lo < RADIX << shift``: a sweep counts
    the keys at most each bound ``lo + (j + 1) * 2**shift - 1`` (``below`` plus a prefix
    sum of the buckets), moves to the first bucket whose bound has enough (``hi`` itself
    when no bound below ``hi`` has), and lowers ``shift`` by RADIX_BITS, so the sweep at
    ``shift == 0`` ends with ``lo == hi``. Same T as a bisection over the same counts, in
    ``ceil(bits(hi - lo) / RADIX_BITS)`` sweeps instead of ``bits(hi - lo)``. The keys are
    ``keys`` (the whole pool as one block) when KEYS_IN_REGISTERS, else ``key_ptr[:num_slots]``.
    """
    below = num_misses * 0  # #{key < lo}: nothing is below the smallest key
    shift = num_misses * 0
    while ((hi - lo) >> shift) >= RADIX:  # multiples of RADIX_BITS: the last sweep has 0
        shift += RADIX_BITS
    rows = tl.arange(0, RADIX)
    while lo < hi:
        hist = _bucket_counts(key_ptr, keys, num_slots, lo, shift, RADIX, BLOCK_S,
                              KEYS_IN_REGISTERS)
        counts = below + tl.cumsum(hist, 0)  # #{key <= lo + (j + 1) * 2**shift - 1}
        # Bound j lies strictly below hi exactly when j < top (no overflow: top < RADIX).
        top = (hi - lo) >> shift
        short = (rows < top) & (counts < num_misses)  # a prefix: counts grow with j
        k = tl.sum(short.to(tl.int32), 0).to(tl.int64)  # T's bucket
        below = tl.maximum(below, tl.max(tl.where(short, counts, 0), 0))
        hi = tl.where(k < top, lo + ((k + 1) << shift) - 1, hi)  # <= hi - lo: no overflow
        lo = lo + (k << shift)
        shift -= RADIX_BITS
    return lo, below


@triton.jit
def _take_victims(key, s, threshold, num_from_ties, num_ties, num_taken, vkey_ptr,
                  vslot_ptr):
    """Appends a block's victims (see _collect_victims); returns the updated counts."""
    tie = (key == threshold).to(tl.int32)
    tie_rank = num_ties + tl.cumsum(tie, 0) - 1
    take = ((key < threshold) | ((tie == 1) & (tie_rank < num_from_ties))).to(tl.int32)
    position = num_taken + tl.cumsum(take, 0) - 1
    tl.store(vkey_ptr + position, key, mask=take == 1)
    tl.store(vslot_ptr + position, s.to(tl.int32), mask=take == 1)
    return num_ties + tl.sum(tie, 0), num_taken + tl.sum(take, 0)


@triton.jit
def _collect_victims(key_ptr, keys, num_slots, threshold, num_from_ties, vkey_ptr,
                     vslot_ptr, BLOCK_S: tl.constexpr, KEYS_IN_REGISTERS: tl.constexpr):
    """Victims in slot order: keys below T, then the first ``num_from_ties`` equal to T."""
    num_ties = tl.sum(tl.zeros([BLOCK_S], tl.int32), 0)
    num_taken = tl.sum(tl.zeros([BLOCK_S], tl.int32), 0)
    if KEYS_IN_REGISTERS:
        _take_victims(keys, tl.arange(0, BLOCK_S), threshold, num_from_ties, num_ties,
                      num_taken, vkey_ptr, vslot_ptr)
    else:
        for start in range(0, num_slots, BLOCK_S):
            s = start + tl.arange(0, BLOCK_S)
            key = tl.load(key_ptr + s, mask=s < num_slots, other=_KEY_NONE)
            num_ties, num_taken = _take_victims(key, s, threshold, num_from_ties, num_ties,
                                                num_taken, vkey_ptr, vslot_ptr)


@triton.jit
def _order_victims(num_victims, vkey_ptr, vslot_ptr, ordered_ptr, TILE: tl.constexpr):
    """ordered[rank] = victim, rank = #victims before it in (key, slot) order."""
    for j0 in range(0, num_victims, TILE):
        j = j0 + tl.arange(0, TILE)
        key_j = tl.load(vkey_ptr + j, mask=j < num_victims, other=_KEY_NONE)
        rank = tl.zeros([TILE], tl.int32)
        for k0 in range(0, num_victims, TILE):
            k = k0 + tl.arange(0, TILE)
            key_k = tl.load(vkey_ptr + k, mask=k < num_victims, other=_KEY_NONE)
            before = (key_k[None, :] < key_j[:, None]) | (
                (key_k[None, :] == key_j[:, None]) & (k[None, :] < j[:, None]))
            before = before & (k[None, :] < num_victims)
            rank += tl.sum(before.to(tl.int32), 1)
        slot = tl.load(vslot_ptr + j, mask=j < num_victims, other=0)
        tl.store(ordered_ptr + rank, slot, mask=j < num_victims)


@triton.jit
def _extract_victims(keys, num_misses, ordered_ptr, BLOCK_S: tl.constexpr,
                     SLOT_BITS: tl.constexpr):
    """ordered[i] = the i-th victim in (key, slot) order, by ``num_misses`` minimum
    reductions over the register block: each candidate packed as ``key << SLOT_BITS | slot``
    (distinct, ordered like (key, slot); the caller checks that they stay below 2**62), the
    minimum taken and struck out. One reduction per miss, against the radix path's sweeps,
    victim list and ordering, which win once misses are many."""
    s = tl.arange(0, BLOCK_S).to(tl.int64)
    packed = tl.where(keys != _KEY_NONE, (keys << SLOT_BITS) | s, _KEY_NONE)
    for i in range(num_misses):
        smallest = tl.min(packed, 0)
        packed = tl.where(packed == smallest, _KEY_NONE, packed)
        tl.store(ordered_ptr + i, (smallest & (BLOCK_S - 1)).to(tl.int32))


@triton.jit
def _install_misses(num_misses, layer_base, now, plan_src_ptr, plan_dst_ptr, ordered_ptr,
                    slot_of_ptr, owner_of_ptr, last_used_ptr, score_ptr,
                    TILE: tl.constexpr):
    # An evicted owner is never one of this call's experts (those are hits, whose slots are
    # not candidates), so clearing old entries and writing new ones cannot collide.
    for i0 in range(0, num_misses, TILE):
        i = i0 + tl.arange(0, TILE)
        todo = i < num_misses
        e = tl.load(plan_src_ptr + i, mask=todo, other=0).to(tl.int64)
        slot = tl.load(ordered_ptr + i, mask=todo, other=0)
        old = tl.load(owner_of_ptr + slot, mask=todo, other=-1)
        tl.store(slot_of_ptr + old, tl.full([TILE], -1, tl.int32), mask=todo & (old >= 0))
        tl.store(owner_of_ptr + slot, (layer_base + e).to(tl.int32), mask=todo)
        tl.store(slot_of_ptr + layer_base + e, slot, mask=todo)
        tl.store(last_used_ptr + slot, tl.full([TILE], 0, tl.int64) + now, mask=todo)
        tl.store(score_ptr + slot, tl.full([TILE], 1.0, tl.float32), mask=todo)
        tl.store(plan_dst_ptr + i, slot, mask=todo)


@triton.jit
def _write_slot_ids(topk_ptr, num_routes, num_experts, layer_base, slot_of_ptr, out_ptr,
                    BLOCK_R: tl.constexpr):
    for start in range(0, num_routes, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        in_range = r < num_routes
        e = tl.load(topk_ptr + r, mask=in_range, other=-1).to(tl.int64)
        valid = in_range & (e >= 0) & (e < num_experts)
        slot = tl.load(slot_of_ptr + layer_base + e, mask=valid, other=-1)
        tl.store(out_ptr + r, slot, mask=in_range)


@triton.jit
def _radix_victims(key_ptr, keys, num_slots, lo, hi, num_misses, vkey_ptr, vslot_ptr,
                   ordered_ptr, RADIX: tl.constexpr, RADIX_BITS: tl.constexpr,
                   BLOCK_S: tl.constexpr, KEYS_IN_REGISTERS: tl.constexpr,
                   TILE: tl.constexpr):
    """ordered[:num_misses] = the victims in (key, slot) order: threshold key by radix
    select, the victims listed in slot order, then ranked."""
    threshold, num_below = _threshold_key(key_ptr, keys, num_slots, lo, hi, num_misses,
                                          RADIX, RADIX_BITS, BLOCK_S, KEYS_IN_REGISTERS)
    _collect_victims(key_ptr, keys, num_slots, threshold, num_misses - num_below,
                     vkey_ptr, vslot_ptr, BLOCK_S, KEYS_IN_REGISTERS)
    tl.debug_barrier()
    _order_victims(num_misses, vkey_ptr, vslot_ptr, ordered_ptr, TILE)


@triton.jit(do_not_specialize=["num_routes", "moe_layer"])  # one compile serves every layer
def _admit_kernel(
    topk_ptr, num_routes, moe_layer, num_experts, num_slots,
    slot_of_ptr, owner_of_ptr, last_used_ptr, score_ptr, clock_ptr,
    plan_src_ptr, plan_dst_ptr, plan_count_ptr, out_ptr,
    mark_ptr, key_ptr, vkey_ptr, vslot_ptr, ordered_ptr, decay_ptr,
    calls_ptr, distinct_ptr, misses_ptr, freq_ptr, phase_ptr,
    LRFU: tl.constexpr, LAYER_LRU: tl.constexpr, POW_BITS: tl.constexpr,
    POW_TAIL: tl.constexpr, COUNT_STATS: tl.constexpr, COUNT_FREQ: tl.constexpr,
    PHASE_CLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
    RADIX: tl.constexpr, RADIX_BITS: tl.constexpr, KEYS_IN_REGISTERS: tl.constexpr,
    SLOT_BITS: tl.constexpr, EXTRACT_MAX: tl.constexpr, TILE: tl.constexpr,
    ALL_HITS_FAST_PATH: tl.constexpr, AHEAD: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    t = 0
    if PHASE_CLOCK:
        tl.store(phase_ptr + _CALLS_INDEX, tl.load(phase_ptr + _CALLS_INDEX) + 1)
        t = _sm_clock()
    # A lookahead call keeps the last call's clock (its slots stay out of the candidates) and
    # marks its routes with a value no clock takes (a mark array entry is 0 or a past mark).
    if AHEAD:
        now = tl.load(clock_ptr)
        mark = -now - 1
    else:
        now = tl.load(clock_ptr) + 1
        tl.store(clock_ptr, now)
        mark = now
    layer_base = moe_layer.to(tl.int64) * num_experts
    misses_seen = 1
    if ALL_HITS_FAST_PATH:
        misses_seen = _admit_if_all_hits(topk_ptr, num_routes, num_experts, layer_base, now,
                                         slot_of_ptr, last_used_ptr, plan_count_ptr, out_ptr,
                                         not AHEAD, BLOCK_R)
    t = _stamp(phase_ptr, 0, t, PHASE_CLOCK)
    if misses_seen > 0:
        _mark_routes(topk_ptr, num_routes, num_experts, layer_base, mark, mark_ptr, freq_ptr,
                     COUNT_FREQ, BLOCK_R)
        tl.debug_barrier()
        t = _stamp(phase_ptr, 1, t, PHASE_CLOCK)
        num_distinct, num_misses = _refresh_hits_list_misses(
            num_experts, layer_base, now, mark, mark_ptr, slot_of_ptr, last_used_ptr, score_ptr,
            plan_src_ptr, decay_ptr, LRFU, POW_BITS, POW_TAIL, BLOCK_E)
        tl.debug_barrier()
        t = _stamp(phase_ptr, 2, t, PHASE_CLOCK)
        if num_misses > 0:
            if KEYS_IN_REGISTERS:  # the whole pool is one block: its keys never leave registers
                s = tl.arange(0, BLOCK_S)
                keys = _slot_keys(s, s < num_slots, now, layer_base, num_experts, owner_of_ptr,
                                  last_used_ptr, score_ptr, decay_ptr, LRFU, LAYER_LRU,
                                  POW_BITS, POW_TAIL)
                t = _stamp(phase_ptr, 3, t, PHASE_CLOCK)
                # Every candidate key is at most 2 now + 1 (LRU, LAYER_LRU) or 2**31 (LRFU):
                # packed with its slot from 0, no reduction for the keys' range first.
                key_bound = tl.maximum(2 * now + 1, 1 << 31)
                if (num_misses <= EXTRACT_MAX) & (key_bound < (1 << (62 - SLOT_BITS))):
                    _extract_victims(keys, num_misses, ordered_ptr, BLOCK_S, SLOT_BITS)
                else:
                    lo, hi = _key_range(keys)
                    _radix_victims(key_ptr, keys, num_slots, lo, hi, num_misses, vkey_ptr,
                                   vslot_ptr, ordered_ptr, RADIX, RADIX_BITS, BLOCK_S,
                                   KEYS_IN_REGISTERS, TILE)
            else:
                lo, hi = _write_slot_keys(num_slots, now, layer_base, num_experts, owner_of_ptr,
                                          last_used_ptr, score_ptr, key_ptr, decay_ptr, LRFU,
                                          LAYER_LRU, POW_BITS, POW_TAIL, BLOCK_S)
                tl.debug_barrier()
                t = _stamp(phase_ptr, 3, t, PHASE_CLOCK)
                _radix_victims(key_ptr, lo, num_slots, lo, hi, num_misses, vkey_ptr, vslot_ptr,
                               ordered_ptr, RADIX, RADIX_BITS, BLOCK_S, KEYS_IN_REGISTERS, TILE)
            tl.debug_barrier()
            t = _stamp(phase_ptr, 4, t, PHASE_CLOCK)
            _install_misses(num_misses, layer_base, now, plan_src_ptr, plan_dst_ptr, ordered_ptr,
                            slot_of_ptr, owner_of_ptr, last_used_ptr, score_ptr, TILE)
            tl.debug_barrier()
            t = _stamp(phase_ptr, 5, t, PHASE_CLOCK)
        tl.store(plan_count_ptr, num_misses)
        if not AHEAD:
            _write_slot_ids(topk_ptr, num_routes, num_experts, layer_base, slot_of_ptr, out_ptr,
                            BLOCK_R)
        if COUNT_STATS:
            tl.store(calls_ptr + moe_layer, tl.load(calls_ptr + moe_layer) + 1)
            tl.store(distinct_ptr + moe_layer, tl.load(distinct_ptr + moe_layer) + num_distinct)
            tl.store(misses_ptr + moe_layer, tl.load(misses_ptr + moe_layer) + num_misses)
        _stamp(phase_ptr, 6, t, PHASE_CLOCK)


def phase_cycles(device) -> torch.Tensor:
    """(AdmissionTuning.phase_clock) int64 [len(PHASES) + 1] on ``device``: the SM cycles each
    phase of PHASES took, summed over the calls since it was zeroed, then the number of calls.
    Each phase ends at a barrier of the whole program; a phase a call skips adds nothing."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _phase_cycles:
        _phase_cycles[device] = torch.zeros(len(PHASES) + 1, dtype=torch.int64, device=device)
    return _phase_cycles[device]


def _block(n: int, low: int, high: int) -> int:
    return max(low, min(high, triton.next_power_of_2(max(n, 1))))


def admit(state: SlotState, moe_layer: int, topk_ids: torch.Tensor,
          counters: AdmissionCounters | None = None,
          tuning: AdmissionTuning = AdmissionTuning(), ahead: bool = False) -> torch.Tensor | None:
    """One launch, grid (1,): admit ``topk_ids`` into MoE layer ``moe_layer`` (see module
    contract); a lookahead admission (``ahead``, reference.py) counts nothing and returns None."""
    num_routes = check_call(state, moe_layer, topk_ids)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        raise ValueError("topk_ids must be contiguous")
    count_stats = counters is not None and not ahead
    count_freq = count_stats and counters.freq is not None
    stats = counters if count_stats else (state.clock,) * 3 + (None,)
    freq = counters.freq if count_freq else state.clock
    block_s = _block(state.num_slots, 16, tuning.max_block_s)
    phases = phase_cycles(ids.device) if tuning.phase_clock else state.clock
    _admit_kernel[(1,)](
        ids, num_routes, moe_layer, state.num_experts, state.num_slots,
        state.slot_of, state.owner_of, state.last_used, state.score, state.clock,
        *((state.ahead_src, state.ahead_dst, state.ahead_count) if ahead
          else (state.plan_src, state.plan_dst, state.plan_count)), state.slot_ids,
        state.expert_mark, state.slot_key, state.victim_key, state.victim_slot,
        state.ordered_victims, state.decay.table,
        stats[0], stats[1], stats[2], freq, phases,
        LRFU=state.eviction_policy == "lrfu", LAYER_LRU=state.eviction_policy == "layer_lru", POW_BITS=state.decay.bits, POW_TAIL=state.decay.tail,
        COUNT_STATS=count_stats, COUNT_FREQ=count_freq, PHASE_CLOCK=tuning.phase_clock,
        BLOCK_R=_block(num_routes, 16, tuning.max_block_r), BLOCK_E=_block(state.num_experts, 16, 1024),
        BLOCK_S=block_s, RADIX=1 << tuning.radix_bits, RADIX_BITS=tuning.radix_bits,
        KEYS_IN_REGISTERS=tuning.keys_in_registers and state.num_slots <= block_s,
        SLOT_BITS=block_s.bit_length() - 1, EXTRACT_MAX=tuning.extract_max, TILE=_VICTIM_TILE,
        ALL_HITS_FAST_PATH=(tuning.all_hits_fast_path and state.eviction_policy != "lrfu" and not count_stats
                            and num_routes <= tuning.max_block_r), AHEAD=ahead,
        num_warps=tuning.num_warps_wide if num_routes > tuning.max_block_r else tuning.num_warps,
        enable_fp_fusion=False, **pdl_launch(ids.device),
    )
    return None if ahead else state.slot_ids[:num_routes].view(topk_ids.shape)
