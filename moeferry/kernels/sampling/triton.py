"""Batched sampling as one Triton program per row: the contract of the package docstring, the
results of reference.py (same uniforms bit for bit, same tokens, log-probs to float rounding).

A program streams its row of V logits in blocks of BLOCK lanes; lane l sees the tokens
l, l + BLOCK, ... and keeps per-lane accumulators, reduced once after the pass (BLOCK is a
multiple of COLUMNS, so lane l belongs to column l % COLUMNS). The passes over the row:
- materialize (rows with penalties, a logit bias or a token mask): the processed z into the row of
  ``logprobs_out``, which the later passes read instead of the logits;
- stats: max, sum of exp(z - max), per-lane max and sum (the column masses of a draw over
  every token); greedy rows also the argmax; rows with top_k or min_p the four largest z of
  every lane, from which the k-th largest z comes without another pass (a bisection over the
  lanes in registers) unless a lane holds four of the largest, and so do the columns of K
  unless a lane's fourth reaches K;
- check (sampled rows with top_p < 1, once per round): the mass of K above the drawn token and
  the next round's column masses; the first one also writes the log-probs when z comes from
  the logits (not from the materialized row, which it still reads);
- log-probs (rows whose slot asks for them, when no check pass wrote them).
A draw reads no row: 1,024 Gumbel keys pick a column, one strided load of its <= V / 1024
tokens picks the token. Passes per row:
    greedy                                   1, +1 for the log-probs
    sampled, top_p = 1 (with or without top_k / min_p)   1, +1 for the log-probs
    sampled, top_p < 1                       2 (log-probs included), +1 per rejected round
                                             (each round's token lies outside the nucleus
                                             with probability < 1 - top_p)
    penalties or bias                        +1 (materialize), and the log-probs need their
                                             own pass
    top_k when a lane holds 4 of the k largest, or min_p / top_k when a lane's fourth
    reaches K (rare for k up to a few hundred)                     +1 (the mass of K)
    ... and when a lane holds 4 of the k largest, or k > 4 * BLOCK  + one pass per bisection
                                             step for the k-th largest z (up to 32)
    32 rejected rounds                       +1 (the argmax, the fallback)
Compiled for sm_90 (BLOCK 4096, 16 warps: 120 registers, no spills) the stats pass issues
about 14 instructions an element and the check pass 14 to 16, so one program takes about 17k
issue cycles (some 9 us at 1.98 GHz) to stream a 151,936-token row: an estimate from the
SASS, not a measurement.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.kernels.sampling.reference import COLUMNS, MAX_ROUNDS, U_MIN
from moeferry.kernels.sampling.state import SamplingState
from moeferry.kernels.triton_common import INTERPRETED, output_buffer, pdl_launch, wait_for_previous_kernel

__all__ = ["sample"]

_BLOCK = 4096  # lanes a pass loads at once: 8 a thread at 16 warps
_NUM_WARPS = 16
_NEG_INF = tl.constexpr(float("-inf"))
_LOWEST = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX: exp(z - it) needs no -inf guard
_LOG2E = tl.constexpr(1.4426950408889634)
_INTERPRETED = tl.constexpr(INTERPRETED)
_U_MIN = tl.constexpr(U_MIN)


@triton.jit
def _uniform(seed, position, round_, level: tl.constexpr, index):
    """reference.uniforms: u in [2**-32, 1) from Philox(seed; index, position, 2 * round + level)."""
    c0 = index.to(tl.uint32)
    zero = c0 * 0
    c1 = zero + (position & 0xFFFFFFFF).to(tl.uint32)
    c2 = zero + (position >> 32).to(tl.uint32)
    c3 = zero + (2 * round_ + level)
    bits, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    return tl.maximum(tl.uint_to_uniform_float(bits), _U_MIN)


@triton.jit
def _gumbel(seed, position, round_, level: tl.constexpr, index):
    return -tl.log(-tl.log(_uniform(seed, position, round_, level, index)))


@triton.jit
def _key(z):
    """int32 keys ordered like the floats z (NaN aside); -0.0 and +0.0 share one key."""
    bits = (z + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _from_key(key):
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _lanes(start, BLOCK: tl.constexpr):
    """The offsets start + [0, BLOCK) as a [BLOCK / 4, 4] tile: loads and stores of 16 bytes
    a thread then share one layout (a flat block would store in another one than it loads,
    through shared memory and barriers)."""
    return start + tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]


@triton.jit
def _column_sum(lanes, BLOCK: tl.constexpr, COLUMNS: tl.constexpr):
    return tl.sum(tl.reshape(lanes, [BLOCK // COLUMNS, COLUMNS]), 0)


@triton.jit
def _exp(x):
    """exp(x) by the instruction tl.exp uses, ex2.approx(x * log2 e), in its flush-to-zero form:
    without the fix-up of denormal results (below 1e-38, nothing in a sum of masses next to
    the max's 1), 3 instructions fewer an element."""
    if _INTERPRETED:
        return tl.exp(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * _LOG2E],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _load_z(src, scale, offs, start, V, BLOCK: tl.constexpr):
    """z at the lanes offs = start + [0, BLOCK); -inf past V. Only the last block is masked
    (the masked load fills its registers first, 3 instructions an element)."""
    if start + BLOCK <= V:
        z = tl.load(src + offs)
    else:
        z = tl.load(src + offs, mask=offs < V, other=_NEG_INF)
    return z * scale


@triton.jit
def _store_row(dst, offs, values, start, V, BLOCK: tl.constexpr):
    if start + BLOCK <= V:
        tl.store(dst + offs, values)
    else:
        tl.store(dst + offs, values, mask=offs < V)


@triton.jit
def _penalized(logits_row, counts_row, mask_row, offs, valid, rep, freq, pres, penalized):
    """The logits at offs after the repetition, frequency and presence penalties."""
    z = tl.load(logits_row + offs, mask=valid, other=_NEG_INF)
    if penalized:
        count = tl.load(counts_row + offs, mask=valid, other=0)
        seen = (tl.load(mask_row + offs, mask=valid, other=0) != 0) | (count > 0)
        z = tl.where(seen, tl.where(z > 0, tl.div_rn(z, rep), z * rep), z)
        z = z - (freq * count.to(tl.float32) + pres * (count > 0).to(tl.float32))
    return z


@triton.jit
def _allowed(z, allowed_row, offs, valid, constrained, MASKED: tl.constexpr):
    """z where the packed bitmask ``allowed_row`` (bit v % 32 of int32 word v // 32) holds token
    offs, -inf elsewhere; z itself when the row is not constrained. MASKED=False compiles none
    of it (a call without masks passes a stand-in pointer of another dtype)."""
    if MASKED:
        if constrained:
            words = tl.load(allowed_row + offs // 32, mask=valid, other=0)
            z = tl.where(((words >> (offs % 32)) & 1) != 0, z, _NEG_INF)
    return z


@triton.jit
def _materialize(logits_row, out_row, counts_row, mask_row, bias_ids_row, bias_values_row, allowed_row,
                 V, NB, inv_t, rep, freq, pres, penalized, constrained, BLOCK: tl.constexpr,
                 BIAS_BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """out_row = (penalized logits + bias, -inf outside the allowed tokens of a constrained row)
    * inv_t. The biased tokens are rewritten after every block is stored, hence the barriers
    (other threads stored those elements)."""
    for start in range(0, V, BLOCK):
        offs = _lanes(start, BLOCK)
        valid = offs < V
        z = _penalized(logits_row, counts_row, mask_row, offs, valid, rep, freq, pres, penalized)
        z = _allowed(z, allowed_row, offs, valid, constrained, MASKED)
        tl.store(out_row + offs, z * inv_t, mask=valid)
    tl.debug_barrier()
    j = tl.arange(0, BIAS_BLOCK)
    ids = tl.load(bias_ids_row + j, mask=j < NB, other=-1)
    used = (ids >= 0) & (ids < V)
    z = _penalized(logits_row, counts_row, mask_row, ids, used, rep, freq, pres, penalized)
    z = (z + tl.load(bias_values_row + j, mask=used, other=0.0))
    z = _allowed(z, allowed_row, ids, used, constrained, MASKED) * inv_t
    tl.store(out_row + ids, z, mask=used)
    tl.debug_barrier()


@triton.jit
def _stats(src, scale, V, BLOCK: tl.constexpr, ARGMAX: tl.constexpr, LISTS: tl.constexpr):
    """(max, sum exp(z - max), lane max, lane sum of exp(z - lane max), lane argmax (ARGMAX),
    the lane's 2nd, 3rd and 4th largest z (LISTS)) in one pass. The lane sums are updated
    online with one exp per element: exp(-|z - lane max|) scales either the sum or z's term.
    Lanes start at -FLT_MAX rather than -inf (no -inf - -inf), taken back to -inf at the end:
    logits are finite or -inf, and above -FLT_MAX."""
    lane_max = tl.full([BLOCK // 4, 4], _LOWEST, tl.float32)
    lane_sum = tl.zeros([BLOCK // 4, 4], tl.float32)
    lane_arg = tl.zeros([BLOCK // 4, 4], tl.int32)
    second = tl.full([BLOCK // 4, 4], _NEG_INF, tl.float32)
    third = tl.full([BLOCK // 4, 4], _NEG_INF, tl.float32)
    fourth = tl.full([BLOCK // 4, 4], _NEG_INF, tl.float32)
    for start in range(0, V, BLOCK):
        offs = _lanes(start, BLOCK)
        z = _load_z(src, scale, offs, start, V, BLOCK)
        hi = tl.maximum(lane_max, z)
        lo = tl.minimum(lane_max, z)
        e = _exp(lo - hi)
        rises = z > lane_max
        lane_sum = tl.where(rises, lane_sum * e + 1.0, lane_sum + e)
        if ARGMAX:
            lane_arg = tl.where(rises, offs, lane_arg)
        if LISTS:  # lo is the value that leaves the lane max: insert it below
            carry = tl.minimum(second, lo)
            second = tl.maximum(second, lo)
            fourth = tl.maximum(fourth, tl.minimum(third, carry))
            third = tl.maximum(third, carry)
        lane_max = hi
    lane_max = tl.where(lane_max == _LOWEST, _NEG_INF, lane_max)
    if LISTS:
        second = tl.where(second == _LOWEST, _NEG_INF, second)
        third = tl.where(third == _LOWEST, _NEG_INF, third)
        fourth = tl.where(fourth == _LOWEST, _NEG_INF, fourth)
    m = tl.max(lane_max)
    total = tl.sum(lane_sum * _exp(lane_max - m))
    return m, total, lane_max, lane_sum, lane_arg, second, third, fourth


@triton.jit
def _kth_largest_key(keys, k):
    """The k-th largest of ``keys`` (int32, any shape, k <= its size) by bisection on the key:
    ``lo`` keeps at least k keys at or above it; a step that finds exactly k at or above the
    midpoint ends on the smallest of them."""
    lo = tl.min(keys).to(tl.int64)
    hi = tl.max(keys).to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        above = keys >= mid.to(tl.int32)
        count = tl.sum(above.to(tl.int32))
        if count == k:
            lo = tl.min(tl.where(above, keys, 2147483647)).to(tl.int64)
            hi = lo
        elif count > k:
            lo = mid
        else:
            hi = mid - 1
    return lo.to(tl.int32)


@triton.jit
def _count_at_least(src, scale, V, key, BLOCK: tl.constexpr):
    """(#{z >= key}, the smallest key at or above it) over the row, in one pass."""
    count = tl.zeros([BLOCK // 4, 4], tl.int32)
    smallest = tl.full([BLOCK // 4, 4], 2147483647, tl.int32)
    for start in range(0, V, BLOCK):
        offs = _lanes(start, BLOCK)
        valid = offs < V
        z_key = _key(_load_z(src, scale, offs, start, V, BLOCK))
        above = valid & (z_key >= key)
        count += above.to(tl.int32)
        smallest = tl.minimum(smallest, tl.where(above, z_key, 2147483647))
    return tl.sum(count), tl.min(smallest)


@triton.jit
def _kth_largest_of_row(src, scale, V, k, floor, ceiling, BLOCK: tl.constexpr):
    """The k-th largest z of the row, given floor <= it <= ceiling: _kth_largest_key with a
    pass over the row per step (the rare case the lane lists cannot settle)."""
    lo = _key(floor).to(tl.int64)
    hi = _key(ceiling).to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        count, smallest = _count_at_least(src, scale, V, mid.to(tl.int32), BLOCK)
        smallest = smallest.to(tl.int64)
        lo = tl.where(count >= k, tl.where(count == k, smallest, mid), lo)
        hi = tl.where(count >= k, tl.where(count == k, smallest, hi), mid - 1)
    return _from_key(lo.to(tl.int32))


@triton.jit
def _top_k_threshold(src, scale, V, k, m, lane_max, second, third, fourth, BLOCK: tl.constexpr):
    """The k-th largest z of the row. If no lane's 2nd largest reaches the k-th largest lane
    max, every z at or above that is a lane max: it is the answer. Else the k-th largest of
    the lanes' four largest is, unless a lane's 4th reaches it (that lane may hide more): then
    a bisection over the row from there (from -inf when k exceeds the lists)."""
    threshold = m * 0.0 + _NEG_INF
    settled = k < 0
    if k <= BLOCK:
        threshold = _from_key(_kth_largest_key(_key(lane_max), k))
        settled = tl.max(second) < threshold
    if (settled == 0) & (k <= 4 * BLOCK):
        lists = tl.join(tl.join(lane_max, second), tl.join(third, fourth))
        threshold = _from_key(_kth_largest_key(_key(lists), k))
        worst = tl.max(fourth)
        settled = (worst < threshold) | (worst == _NEG_INF)
    if settled == 0:
        threshold = _kth_largest_of_row(src, scale, V, k, threshold, m, BLOCK)
    return threshold


@triton.jit
def _check(src, scale, lp_row, V, z_x, keep_from, m, log_total, write_lp,
           BLOCK: tl.constexpr, COLUMNS: tl.constexpr, KEPT: tl.constexpr):
    """One pass: (mass of K above z_x, mass of K when KEPT else 0, the column masses of K above
    z_x), masses as sums of exp(z - max); writes the log-probs into lp_row when write_lp."""
    above = tl.zeros([BLOCK // 4, 4], tl.float32)
    kept = tl.zeros([BLOCK // 4, 4], tl.float32)
    for start in range(0, V, BLOCK):
        offs = _lanes(start, BLOCK)
        z = _load_z(src, scale, offs, start, V, BLOCK)
        e = _exp(z - m)
        keep = z >= keep_from
        above += tl.where(keep & (z > z_x), e, 0.0)
        if KEPT:
            kept += tl.where(keep, e, 0.0)
        if write_lp:
            _store_row(lp_row, offs, (z - m) - log_total, start, V, BLOCK)
    return tl.sum(above), tl.sum(kept), _column_sum(above, BLOCK, COLUMNS)


@triton.jit
def _draw(src, scale, V, column_mass, seed, position, round_, keep_from, floor,
          COLUMNS: tl.constexpr, ROWS: tl.constexpr):
    """reference.draw over the candidates {z >= keep_from, z > floor} whose column masses are
    column_mass: (token, its z)."""
    columns = tl.arange(0, COLUMNS)
    weighted = column_mass > 0
    column_key = tl.log(tl.where(weighted, column_mass, 1.0)) + _gumbel(seed, position, round_, 0, columns)
    column_key = tl.where(weighted, column_key, _NEG_INF)
    column = tl.min(tl.where(column_key == tl.max(column_key, 0), columns, COLUMNS), 0)
    tokens = tl.arange(0, ROWS) * COLUMNS + column
    valid = tokens < V
    z = tl.load(src + tokens, mask=valid, other=_NEG_INF) * scale
    candidate = valid & (z >= keep_from) & (z > floor)
    key = tl.where(candidate, z + _gumbel(seed, position, round_, 1, tokens), _NEG_INF)
    token = tl.min(tl.where(candidate & (key == tl.max(key, 0)), tokens, V), 0)
    return token, tl.max(tl.where(tokens == token, z, _NEG_INF), 0)


@triton.jit
def _first_index_of(src, scale, V, value, BLOCK: tl.constexpr):
    first = tl.full([BLOCK // 4, 4], V, tl.int32)
    for start in range(0, V, BLOCK):
        offs = _lanes(start, BLOCK)
        z = _load_z(src, scale, offs, start, V, BLOCK)
        first = tl.minimum(first, tl.where(z == value, offs, V))
    return tl.min(first)


@triton.jit
def _write_logprobs(src, scale, lp_row, V, m, log_total, BLOCK: tl.constexpr):
    for start in range(0, V, BLOCK):
        offs = _lanes(start, BLOCK)
        z = _load_z(src, scale, offs, start, V, BLOCK)
        _store_row(lp_row, offs, (z - m) - log_total, start, V, BLOCK)


@triton.jit
def _first_round_columns(m, total_lanes, keep_from, lane_max, second, third, fourth,
                         BLOCK: tl.constexpr, COLUMNS: tl.constexpr):
    """(column masses of K, mass of K, whether the lane lists missed some of K): K is every
    token when keep_from is -inf, else the listed z >= keep_from if no lane's 4th reaches it."""
    lanes = total_lanes
    if keep_from != _NEG_INF:
        lanes = (tl.where(lane_max >= keep_from, _exp(lane_max - m), 0.0)
                 + tl.where(second >= keep_from, _exp(second - m), 0.0)
                 + tl.where(third >= keep_from, _exp(third - m), 0.0)
                 + tl.where(fourth >= keep_from, _exp(fourth - m), 0.0))
    missed = (keep_from != _NEG_INF) & (tl.max(fourth) >= keep_from)
    return _column_sum(lanes, BLOCK, COLUMNS), tl.sum(lanes), missed


@triton.jit
def _sampled(src, scale, lp_row, V, top_k, top_p, min_p, seed, position, may_write_lp,
             BLOCK: tl.constexpr, COLUMNS: tl.constexpr, ROWS: tl.constexpr,
             MAX_ROUNDS: tl.constexpr):
    """(token, its z, max, log sum, whether a pass wrote the log-probs) of a sampled row:
    reference.sample_row. may_write_lp (int32 0/1): the first check pass writes them."""
    lp_pending = may_write_lp
    top_k_on = (top_k > 0) & (top_k < V)
    min_p_on = min_p > 0.0
    if top_k_on | min_p_on:
        m, total, lane_max, lane_sum, no_arg, second, third, fourth = _stats(src, scale, V, BLOCK,
                                                                             False, True)
    else:
        m, total, lane_max, lane_sum, no_arg, second, third, fourth = _stats(src, scale, V, BLOCK,
                                                                             False, False)
    log_total = tl.log(total)
    keep_from = tl.where(min_p_on, m + tl.log(tl.where(min_p_on, min_p, 1.0)), _NEG_INF)
    if top_k_on:
        keep_from = tl.maximum(keep_from, _top_k_threshold(src, scale, V, top_k, m, lane_max,
                                                           second, third, fourth, BLOCK))
    column_mass, kept_mass, missed = _first_round_columns(
        m, lane_sum * _exp(lane_max - m), keep_from, lane_max, second, third, fourth, BLOCK, COLUMNS)
    if missed:
        all_above, kept_mass, column_mass = _check(src, scale, lp_row, V, _NEG_INF, keep_from, m,
                                                   log_total, lp_pending != 0, BLOCK, COLUMNS, True)
        lp_pending = lp_pending * 0

    token, z_token = _draw(src, scale, V, column_mass, seed, position, 0, keep_from, _NEG_INF,
                           COLUMNS, ROWS)
    accepted = (top_p >= 1.0).to(tl.int32)
    rounds = 1
    while (accepted == 0) & (rounds <= MAX_ROUNDS):
        above, no_mass, column_mass = _check(src, scale, lp_row, V, z_token, keep_from, m, log_total,
                                             lp_pending != 0, BLOCK, COLUMNS, False)
        lp_pending = lp_pending * 0
        accepted = (above < top_p * kept_mass).to(tl.int32)
        if (accepted == 0) & (rounds < MAX_ROUNDS):
            token, z_token = _draw(src, scale, V, column_mass, seed, position, rounds, keep_from,
                                   z_token, COLUMNS, ROWS)
        rounds += 1
    if accepted == 0:
        token = _first_index_of(src, scale, V, m, BLOCK)
        z_token = m
    return token, z_token, m, log_total, may_write_lp - lp_pending


@triton.jit
def _sample_kernel(logits_ptr, logits_stride, row_slot_ptr, positions_ptr,
                   temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, repetition_ptr, frequency_ptr,
                   presence_ptr, seed_ptr, full_logprobs_ptr, counts_ptr, prompt_mask_ptr,
                   bias_ids_ptr, bias_values_ptr, tokens_ptr, token_logprobs_ptr, logprobs_ptr,
                   token_mask_ptr, mask_rows_ptr, V, NB, W, BLOCK: tl.constexpr, COLUMNS: tl.constexpr,
                   ROWS: tl.constexpr, BIAS_BLOCK: tl.constexpr, MAX_ROUNDS: tl.constexpr,
                   MASKED: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    if slot < 0:
        tl.store(tokens_ptr + row, 0)
        tl.store(token_logprobs_ptr + row, 0.0)
    else:
        temperature = tl.load(temperature_ptr + slot)
        greedy = temperature == 0.0
        inv_t = tl.div_rn(1.0, tl.where(greedy, 1.0, temperature))
        rep = tl.load(repetition_ptr + slot)
        freq = tl.load(frequency_ptr + slot)
        pres = tl.load(presence_ptr + slot)
        penalized = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
        constrained = slot < 0  # False; a row of a masked call reads its flag
        if MASKED:
            constrained = tl.load(mask_rows_ptr + row) != 0
        materialized = penalized | (tl.load(bias_ids_ptr + slot * NB) >= 0) | constrained
        lp_row = logprobs_ptr + row * V
        src = logits_ptr + row * logits_stride
        if materialized:
            _materialize(src, lp_row, counts_ptr + slot * V, prompt_mask_ptr + slot * V,
                         bias_ids_ptr + slot * NB, bias_values_ptr + slot * NB, token_mask_ptr + row * W,
                         V, NB, inv_t, rep, freq, pres, penalized, constrained, BLOCK, BIAS_BLOCK, MASKED)
            src = lp_row
        scale = tl.where(materialized, 1.0, inv_t)
        lp_pending = (tl.load(full_logprobs_ptr + slot) != 0).to(tl.int32)
        if greedy:
            m, total, lane_max, lane_sum, lane_arg, second, third, fourth = _stats(src, scale, V, BLOCK,
                                                                                   True, False)
            token = tl.min(tl.where(lane_max == m, lane_arg, V))
            z_token = m
            log_total = tl.log(total)
        else:
            # A check pass cannot write the log-probs over the materialized z it reads.
            may_write_lp = lp_pending * (1 - materialized.to(tl.int32))
            token, z_token, m, log_total, written = _sampled(
                src, scale, lp_row, V, tl.load(top_k_ptr + slot), tl.load(top_p_ptr + slot),
                tl.load(min_p_ptr + slot), tl.load(seed_ptr + slot), tl.load(positions_ptr + row),
                may_write_lp, BLOCK, COLUMNS, ROWS, MAX_ROUNDS)
            lp_pending = lp_pending - written
        if lp_pending != 0:
            _write_logprobs(src, scale, lp_row, V, m, log_total, BLOCK)
        token = tl.minimum(token, V - 1)  # V only when no z compared (NaN): stay in the row
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(token_logprobs_ptr + row, (z_token - m) - log_total)
        tl.atomic_add(counts_ptr + slot * V + token, 1)


def _check_inputs(logits: torch.Tensor, row_slot: torch.Tensor, positions: torch.Tensor,
                  state: SamplingState, token_mask: torch.Tensor | None, mask_rows: torch.Tensor | None) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected [B, V] float32 with unit last stride, got "
                         f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}")
    b, v = logits.shape
    if v != state.vocab:
        raise ValueError(f"logits have {v} tokens, the sampling state {state.vocab}")
    for name, tensor, dtype in (("row_slot", row_slot, torch.int32), ("positions", positions, torch.int64)):
        if tuple(tensor.shape) != (b,) or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(f"{name}: expected contiguous [{b}] {dtype}, got "
                             f"{tuple(tensor.shape)} {tensor.dtype}")
    devices = {t.device for t in (logits, row_slot, positions, state.output_counts)}
    if token_mask is not None:
        words = -(-v // 32)
        if (token_mask.dim() != 2 or token_mask.shape[0] != b or token_mask.shape[1] < words
                or token_mask.dtype != torch.int32 or token_mask.stride(1) != 1):
            raise ValueError(f"token_mask: expected [{b}, >= {words}] int32 with unit last stride, got "
                             f"{tuple(token_mask.shape)} {token_mask.dtype}")
        if mask_rows is None or tuple(mask_rows.shape) != (b,) or mask_rows.dtype != torch.int32:
            raise ValueError(f"mask_rows: expected [{b}] int32 beside token_mask")
        devices |= {token_mask.device, mask_rows.device}
    if len(devices) != 1:
        raise ValueError(f"sampling inputs on several devices: {sorted(map(str, devices))}")


def sample(logits: torch.Tensor, row_slot: torch.Tensor, positions: torch.Tensor,
           state: SamplingState, *, logprobs_out: torch.Tensor | None = None,
           tokens_out: torch.Tensor | None = None, token_logprobs_out: torch.Tensor | None = None,
           token_mask: torch.Tensor | None = None, mask_rows: torch.Tensor | None = None,
           block: int = _BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, token_logprobs [B] f32, logprobs [B, V] f32) in one launch; see the
    package docstring. ``block`` (a power of two, multiple of COLUMNS) tunes the pass width:
    results depend on it only through the order of float sums."""
    _check_inputs(logits, row_slot, positions, state, token_mask, mask_rows)
    if block % COLUMNS or block & (block - 1):
        raise ValueError(f"block must be a power of two and a multiple of {COLUMNS}, got {block}")
    b, v = logits.shape
    device = logits.device
    logprobs_out = output_buffer(logprobs_out, (b, v), torch.float32, device, "logprobs_out")
    tokens_out = output_buffer(tokens_out, (b,), torch.int64, device, "tokens_out")
    token_logprobs_out = output_buffer(token_logprobs_out, (b,), torch.float32, device,
                                       "token_logprobs_out")
    if b and logprobs_out.data_ptr() == logits.data_ptr():  # later passes reread the logits
        raise ValueError("logprobs_out may not alias logits")
    if b == 0:
        return tokens_out, token_logprobs_out, logprobs_out
    s = state
    _sample_kernel[(b,)](
        logits, logits.stride(0), row_slot, positions, s.temperature, s.top_k, s.top_p, s.min_p,
        s.repetition_penalty, s.frequency_penalty, s.presence_penalty, s.seed, s.full_logprobs,
        s.output_counts, s.prompt_mask, s.bias_ids, s.bias_values, tokens_out, token_logprobs_out,
        logprobs_out, logits if token_mask is None else token_mask,
        row_slot if mask_rows is None else mask_rows, v, s.max_bias,
        0 if token_mask is None else token_mask.stride(0), BLOCK=block, COLUMNS=COLUMNS,
        ROWS=triton.next_power_of_2(triton.cdiv(v, COLUMNS)),
        BIAS_BLOCK=triton.next_power_of_2(s.max_bias), MAX_ROUNDS=MAX_ROUNDS, MASKED=token_mask is not None,
        num_warps=_NUM_WARPS, enable_fp_fusion=False, **pdl_launch(device))
    return tokens_out, token_logprobs_out, logprobs_out
