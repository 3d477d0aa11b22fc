"""Generated routes as two Triton kernels (the contract: kernels/generated_routes/__init__.py).

`_draw_kernel`: one program per (layer, row) holds the row's E scores in registers, picks the
K largest one at a time (the largest, the lowest expert id among equals, then masked out),
ranks the chosen by their natural scores and writes them over the row's previous routes,
which it read first. `_oracle_kernel` picks a row's predictions the same way from the oracle's
scores. `_force_kernel`: one program per row keeps the logits at the row's ids.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.kernels.generated_routes import BIG, FORCED_OFF
from moeferry.kernels.triton_common import pdl_launch, wait_for_previous_kernel


@triton.jit
def _uniform(keys, step):
    """((hash32((keys + step) mod 2^32) >> 8) + 0.5) / 2^24, the hash in uint32 arithmetic
    (its products wrap mod 2^32, as the reference's masked int64 products do)."""
    x = (keys + step).to(tl.uint32)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 16)
    return ((x >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # / 2^24, exact


@triton.jit
def _draw_kernel(fixed_ptr, gumbel_ptr, keep_ptr, step_ptr, routes_ptr, keep,
                 f_l, f_t, g_l, g_t, k_l, k_t, r_l, r_t, num_experts,
                 K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, KEEP: tl.constexpr,
                 BIG_VALUE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    layer, row = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    j = tl.arange(0, BLOCK_K)
    is_expert, is_route = e < num_experts, j < K
    step = tl.load(step_ptr)
    fixed = tl.load(fixed_ptr + layer * f_l + row * f_t + e, mask=is_expert, other=0.0)
    u = _uniform(tl.load(gumbel_ptr + layer * g_l + row * g_t + e, mask=is_expert, other=0), step)
    natural = fixed + -tl.log(-tl.log(u))
    score = tl.where(is_expert, natural, float("-inf"))
    routes = routes_ptr + layer * r_l + row * r_t
    if KEEP:
        previous = tl.load(routes + j, mask=is_route, other=-1)
        kept = _uniform(tl.load(keep_ptr + layer * k_l + row * k_t + j, mask=is_route, other=0), step) < keep
        bonus = tl.max(((previous[:, None] == e[None, :]) & (kept & is_route)[:, None]).to(tl.int32), axis=0)
        score = tl.where(is_expert, natural + tl.where(bonus > 0, BIG_VALUE, 0.0), score)
    chosen = tl.zeros([BLOCK_K], tl.int32)
    chosen_natural = tl.full([BLOCK_K], float("-inf"), tl.float32)
    for i in tl.static_range(K):
        best = tl.max(score, axis=0)
        pick = tl.min(tl.where(score == best, e, BLOCK_E), axis=0)
        chosen = tl.where(j == i, pick, chosen)
        chosen_natural = tl.where(j == i, tl.sum(tl.where(e == pick, natural, 0.0), axis=0), chosen_natural)
        score = tl.where(e == pick, float("-inf"), score)
    before = (chosen_natural[:, None] > chosen_natural[None, :]) | (
        (chosen_natural[:, None] == chosen_natural[None, :]) & (j[:, None] < j[None, :]))
    rank = tl.sum((before & is_route[:, None]).to(tl.int32), axis=0)
    tl.store(routes + rank, chosen.to(tl.int64), mask=is_route)


@triton.jit
def _oracle_kernel(wrong_ptr, keep_ptr, step_ptr, true_ptr, out_ptr, recall,
                   w_l, w_t, k_l, k_t, t_l, t_t, o_l, o_t, num_experts,
                   K: tl.constexpr, WIDTH: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    layer, row = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    j = tl.arange(0, BLOCK_K)
    w = tl.arange(0, BLOCK_W)
    is_expert, is_route = e < num_experts, j < K
    step = tl.load(step_ptr)
    wrong = _uniform(tl.load(wrong_ptr + layer * w_l + row * w_t + e, mask=is_expert, other=0), step)
    true = tl.load(true_ptr + layer * t_l + row * t_t + j, mask=is_route, other=-1)
    kept = _uniform(tl.load(keep_ptr + layer * k_l + row * k_t + j, mask=is_route, other=0), step) < recall
    place = tl.math.div_rn((K - j).to(tl.float32), tl.full([BLOCK_K], K + 1, tl.float32))
    true_score = tl.where(kept, 2.0 + place, -1.0)  # kept first, in their order
    match = true[:, None] == e[None, :]
    is_true = tl.max(match.to(tl.int32), axis=0) > 0
    score = tl.where(is_true, tl.sum(tl.where(match, true_score[:, None], 0.0), axis=0), wrong)
    score = tl.where(is_expert, score, float("-inf"))
    picked = tl.zeros([BLOCK_W], tl.int64)
    for i in tl.static_range(WIDTH):
        best = tl.max(score, axis=0)
        pick = tl.min(tl.where(score == best, e, BLOCK_E), axis=0)
        picked = tl.where(w == i, pick.to(tl.int64), picked)
        score = tl.where(e == pick, float("-inf"), score)
    tl.store(out_ptr + layer * o_l + row * o_t + w, picked, mask=w < WIDTH)


@triton.jit
def _force_kernel(logits_ptr, ids_ptr, out_ptr, logits_t, ids_t, out_t, num_experts,
                  K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, OFF: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    j = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + row * ids_t + j, mask=j < K, other=-1)
    forced = tl.max((ids[:, None] == e[None, :]).to(tl.int32), axis=0) > 0
    logits = tl.load(logits_ptr + row * logits_t + e, mask=e < num_experts)
    off = tl.full([BLOCK_E], OFF, tl.float32).to(logits.dtype)
    tl.store(out_ptr + row * out_t + e, tl.where(forced, logits, off), mask=e < num_experts)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def draw_routes(fixed, gumbel_keys, keep_keys, step, routes, keep):
    layers, rows, experts = fixed.shape
    if routes.stride(2) != 1:
        raise ValueError("draw_routes rewrites routes in place: its last dimension must be contiguous")
    fixed, gumbel_keys, keep_keys = _unit_last(fixed), _unit_last(gumbel_keys), _unit_last(keep_keys)
    k = routes.shape[2]
    _draw_kernel[(layers, rows)](fixed, gumbel_keys, keep_keys, step, routes, float(keep),
                                 fixed.stride(0), fixed.stride(1), gumbel_keys.stride(0), gumbel_keys.stride(1),
                                 keep_keys.stride(0), keep_keys.stride(1), routes.stride(0), routes.stride(1),
                                 experts, K=k, BLOCK_E=triton.next_power_of_2(experts),
                                 BLOCK_K=triton.next_power_of_2(k), KEEP=keep > 0, BIG_VALUE=BIG,
                                 num_warps=1 if experts <= 256 else 4, **pdl_launch(fixed.device))


def oracle_predict(wrong_keys, keep_keys, step, true_ids, recall, width):
    wrong_keys, keep_keys, true_ids = _unit_last(wrong_keys), _unit_last(keep_keys), _unit_last(true_ids)
    layers, rows, experts = wrong_keys.shape
    k = true_ids.shape[2]
    out = torch.empty((layers, rows, width), dtype=torch.int64, device=true_ids.device)
    _oracle_kernel[(layers, rows)](wrong_keys, keep_keys, step, true_ids, out, float(recall),
                                   wrong_keys.stride(0), wrong_keys.stride(1), keep_keys.stride(0), keep_keys.stride(1),
                                   true_ids.stride(0), true_ids.stride(1), out.stride(0), out.stride(1), experts,
                                   K=k, WIDTH=width, BLOCK_E=triton.next_power_of_2(experts),
                                   BLOCK_K=triton.next_power_of_2(k), BLOCK_W=triton.next_power_of_2(width),
                                   num_warps=1 if experts <= 256 else 4, **pdl_launch(true_ids.device))
    return out


def force_logits(logits, ids):
    logits, ids = _unit_last(logits), _unit_last(ids)
    out = torch.empty_like(logits)
    rows, experts = logits.shape
    k = ids.shape[1]
    _force_kernel[(rows,)](logits, ids, out, logits.stride(0), ids.stride(0), out.stride(0), experts, K=k,
                           BLOCK_E=triton.next_power_of_2(experts), BLOCK_K=triton.next_power_of_2(k),
                           OFF=FORCED_OFF, num_warps=1 if experts <= 256 else 4, **pdl_launch(logits.device))
    return out
