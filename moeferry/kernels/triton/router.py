"""The MoE router as one Triton launch: fp32 softmax, top-k, optional renormalisation and the
casts, in place of the ~8 small torch kernels of kernels/reference/router.py (the oracle).

Contract of ``softmax_topk`` (the reference's signature and results):
    logits       [T, E] bf16|fp16|fp32, unit last stride, any row stride; read only.
                 1 <= E <= MAX_EXPERTS, 1 <= top_k <= E.
    weights_out  [T, top_k] fp32, contiguous (written; allocated unless given): the softmax
                 probabilities of the chosen experts in descending order, divided by their
                 fp32 sum when ``renormalize``, then rounded to logits.dtype and back.
    ids_out      [T, top_k] int32, contiguous (written; allocated unless given): the experts.
Every element of both outputs is written; neither may overlap logits.

Order and ties: round k takes the largest logit not yet taken (softmax is monotone, so this
is torch.topk's descending order on the probabilities), ties going to the lowest expert
index. Selecting on the logits rather than on the rounded probabilities keeps the order a
function of the inputs alone: two distinct logits never tie. Rows holding NaN give NaN
weights and unspecified, but in-range, ids.

Numerics: max-subtracted exp and an fp32 sum over the row, IEEE division; the weights differ
from torch's by the sum's order and exp's last bit (a few fp32 ulps), so after rounding to
bf16/fp16 they equal the reference's or are one ulp of that dtype away.

The grid is (T,) and nothing is read back, so a call captures in a CUDA graph and replays with
new logits in the same buffers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.kernels.triton.common import output_buffer, pdl_launch, rounded, wait_for_previous_kernel

__all__ = ["MAX_EXPERTS", "add_norm_route", "fusable", "softmax_topk"]

MAX_EXPERTS = 4096  # one program holds a whole row: BLOCK_E / (32 * 8 warps) = 16 values a thread
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# add_norm_route: every program holds the [T, H] rows (T * H <= FUSED_MAX_ELEMENTS) and the
# last one ranks the [T, E] logits (E <= FUSED_MAX_EXPERTS) in chunks of [T, E, _RANK_CHUNK].
FUSED_MAX_ROWS = 4
FUSED_MAX_ELEMENTS = 8192
FUSED_MAX_EXPERTS = 512


@triton.jit
def _softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, E, row_stride,
                         K: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    x = tl.load(logits_ptr + row * row_stride + experts, mask=valid, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    total = tl.sum(tl.where(valid, tl.exp(x - top), 0.0), axis=0)

    slots = tl.arange(0, BLOCK_K)
    chosen_x = tl.full([BLOCK_K], float("-inf"), tl.float32)
    chosen_id = tl.zeros([BLOCK_K], tl.int32)
    free = valid
    for k in range(K):
        best = tl.max(tl.where(free, x, float("-inf")), axis=0)
        # `free &` matters when logits are -inf: a taken -inf must not be taken again.
        pick = tl.min(tl.where(free & (x == best), experts, BLOCK_E), axis=0)
        pick = tl.minimum(pick, E - 1)  # no match only if best is NaN; keep the id in range
        free = free & (experts != pick)
        chosen_x = tl.where(slots == k, best, chosen_x)
        chosen_id = tl.where(slots == k, pick, chosen_id)

    used = slots < K
    w = tl.div_rn(tl.where(used, tl.exp(chosen_x - top), 0.0), total)
    if RENORMALIZE:
        w = tl.div_rn(w, tl.sum(w, axis=0))
    w = rounded(w, logits_ptr.dtype.element_ty)
    out = row * K + slots
    tl.store(weights_ptr + out, w, mask=used)
    tl.store(ids_ptr + out, chosen_id, mask=used)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 weights_out: torch.Tensor | None = None,
                 ids_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] fp32, ids [T, top_k] int32) of logits [T, E] in one launch; see the
    module docstring for the contract."""
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise ValueError(f"logits: expected [T, E] bf16|fp16|fp32, got {tuple(logits.shape)} {logits.dtype}")
    t, e = logits.shape
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"{e} experts: the router kernel holds a row in one program, 1..{MAX_EXPERTS}")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} out of 1..{e}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights_out = output_buffer(weights_out, (t, top_k), torch.float32, logits.device, "weights_out")
    ids_out = output_buffer(ids_out, (t, top_k), torch.int32, logits.device, "ids_out")
    if t == 0:
        return weights_out, ids_out
    block_e = triton.next_power_of_2(e)
    _softmax_topk_kernel[(t,)](
        logits, weights_out, ids_out, e, logits.stride(0),
        K=top_k, RENORMALIZE=bool(renormalize), BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=min(8, max(1, block_e // 256)), **pdl_launch(logits.device))
    return weights_out, ids_out


@triton.jit
def _add_norm_route_kernel(x_ptr, res_ptr, norm_w_ptr, gate_ptr, h_ptr, res_out_ptr, logits_ptr,
                           weights_ptr, ids_ptr, ticket_ptr, T, E, H, eps, x_stride, res_stride,
                           gate_stride, K: tl.constexpr, RENORMALIZE: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
                           RANK_CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program e: the residual add and RMSNorm of all T rows (every program, redundantly; it
    stores its 1/E share of both), then logit e of each row. The program that arrives last at
    the ticket ranks the logits and writes the top-k, then resets the ticket for the next call."""
    wait_for_previous_kernel(PDL)
    e = tl.program_id(0)
    rows = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    row_ok, col_ok = rows < T, cols < H
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # The arithmetic of norm_rope's add + RMSNorm: the sum rounded to the stream's dtype, the
    # normalised row to it, the weight product to h's dtype.
    s = rounded(x + r, res_out_ptr.dtype.element_ty)
    inv = tl.rsqrt(tl.sum(s * s, axis=1) / H + eps)
    xn = rounded(s * inv[:, None], res_out_ptr.dtype.element_ty)
    norm_w = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    h = rounded(norm_w[None, :] * xn, h_ptr.dtype.element_ty)
    share = tl.cdiv(H, tl.num_programs(0))
    mine = mask & ((cols >= e * share) & (cols < (e + 1) * share))[None, :]
    dense = rows[:, None] * H + cols[None, :]
    tl.store(res_out_ptr + dense, s.to(res_out_ptr.dtype.element_ty), mask=mine)
    tl.store(h_ptr + dense, h.to(h_ptr.dtype.element_ty), mask=mine)

    gate = tl.load(gate_ptr + e.to(tl.int64) * gate_stride + cols, mask=col_ok, other=0.0).to(tl.float32)
    logit = rounded(tl.sum(h * gate[None, :], axis=1), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + rows * E + e, logit.to(logits_ptr.dtype.element_ty), mask=row_ok)
    tl.debug_barrier()  # every thread's logit stored before the release below
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        _rank_top_k(logits_ptr, weights_ptr, ids_ptr, rows, row_ok, E, K, RENORMALIZE, BLOCK_E, RANK_CHUNK)
        tl.store(ticket_ptr, 0)


@triton.jit
def _rank_top_k(logits_ptr, weights_ptr, ids_ptr, rows, row_ok, E, K: tl.constexpr,
                RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, RANK_CHUNK: tl.constexpr):
    """Top-k of the rows of logits [T, E] by rank: expert i goes to place #{j : x_j > x_i, or
    x_j == x_i and j < i} when that is below K (softmax_topk's order: descending, ties to the
    lowest index), so no sequence of K max-reductions. NaN ranks as -inf (the ranks stay a
    permutation, every place is written once); its row's weights come out NaN. Loads bypass L1
    (.cg): the logits were written by other programs of this launch."""
    experts = tl.arange(0, BLOCK_E)
    valid = row_ok[:, None] & (experts < E)[None, :]
    x = tl.load(logits_ptr + rows[:, None] * E + experts[None, :], mask=valid, other=float("-inf"),
                cache_modifier=".cg").to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # padding rows: finite, never stored
    key = tl.where(x == x, x, float("-inf"))
    rank = tl.zeros(x.shape, tl.int32)
    for j0 in tl.static_range(0, BLOCK_E, RANK_CHUNK):  # unrolled: every chunk's load issued at once
        others = j0 + tl.arange(0, RANK_CHUNK)
        y = tl.load(logits_ptr + rows[:, None] * E + others[None, :],
                    mask=row_ok[:, None] & (others < E)[None, :], other=float("-inf"),
                    cache_modifier=".cg").to(tl.float32)
        y = tl.where(y == y, y, float("-inf"))
        before = (y[:, None, :] > key[:, :, None]) | (
            (y[:, None, :] == key[:, :, None]) & (others[None, None, :] < experts[None, :, None]))
        rank += tl.sum((before & (others < E)[None, None, :]).to(tl.int32), axis=2)
    chosen = valid & (rank < K)
    top = tl.max(x, axis=1)
    p = tl.where(valid, tl.exp(x - top[:, None]), 0.0)
    total = tl.where(row_ok, tl.sum(p, axis=1), 1.0)  # (padding rows: no 0 / 0)
    w = tl.div_rn(p, total[:, None])
    if RENORMALIZE:
        w = tl.div_rn(w, tl.where(row_ok, tl.sum(tl.where(chosen, w, 0.0), axis=1), 1.0)[:, None])
    w = rounded(w, logits_ptr.dtype.element_ty)
    place = rows[:, None] * K + rank
    tl.store(weights_ptr + place, w, mask=chosen)
    tl.store(ids_ptr + place, experts[None, :] + tl.zeros(x.shape, tl.int32), mask=chosen)


def fusable(rows: int, hidden: int, experts: int) -> bool:
    """Whether add_norm_route takes a call of this size (its programs hold the rows in
    registers and its last program ranks all the logits at once)."""
    return (1 <= rows <= FUSED_MAX_ROWS and triton.next_power_of_2(rows) * triton.next_power_of_2(hidden)
            <= FUSED_MAX_ELEMENTS and 1 <= experts <= FUSED_MAX_EXPERTS)


def add_norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   gate_weight: torch.Tensor, top_k: int, renormalize: bool, ticket: torch.Tensor, *,
                   logits_out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, residual_out, weights, ids) of a MoE layer's entry in one launch: residual_out =
    x + residual, h = RMSNorm(residual_out) (norm_rope.fused_add_rms_norm's arithmetic), the
    router logits h @ gate_weight.T in h's dtype (fp32 sums), and softmax_topk of them.

    x, residual [T, H] of one dtype (bf16|fp16|fp32), unit last stride; norm_weight [H];
    gate_weight [E, H] contiguous, in h's dtype (promote_types(norm_weight.dtype, x.dtype));
    ``fusable(T, H, E)`` must hold. ticket: a [1] int32 tensor on x's device holding 0, owned
    by the caller and used by one launch at a time (a launch leaves it 0 again). Returns new
    contiguous tensors: h [T, H], residual_out [T, H], weights [T, top_k] fp32 and ids
    [T, top_k] int32 as softmax_topk gives them (ids equal for equal logits; weights within
    an ulp of the logits' dtype). h and the logits can differ from the unfused ops' by the
    order of the fp32 row sums (the norm's and the dot product's). ``logits_out`` [T, E] in
    h's dtype, contiguous, receives the logits when given (tests look at them)."""
    t, hidden = x.shape if x.dim() == 2 else (0, 0)
    e = gate_weight.shape[0] if gate_weight.dim() == 2 else 0
    if (x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype or x.dtype not in _DTYPES
            or x.stride(1) != 1 or residual.stride(1) != 1):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype}: "
                         "[T, H] of one dtype with a unit last stride expected")
    h_dtype = torch.promote_types(norm_weight.dtype, x.dtype)
    if (norm_weight.shape != (hidden,) or gate_weight.shape != (e, hidden) or gate_weight.dtype != h_dtype
            or not gate_weight.is_contiguous()):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)}, gate_weight {tuple(gate_weight.shape)} "
                         f"{gate_weight.dtype} for x {tuple(x.shape)}: [H] and a contiguous [E, H] {h_dtype}")
    if not fusable(t, hidden, e):
        raise ValueError(f"{t} rows of {hidden} over {e} experts: not fusable (see fusable)")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} out of 1..{e}")
    if ticket.shape != (1,) or ticket.dtype != torch.int32 or ticket.device != x.device:
        raise ValueError(f"ticket: a [1] int32 tensor on {x.device} expected")
    h = torch.empty((t, hidden), dtype=h_dtype, device=x.device)
    residual_out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    logits = output_buffer(logits_out, (t, e), h_dtype, x.device, "logits_out")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    block_t, block_e = triton.next_power_of_2(t), triton.next_power_of_2(e)
    _add_norm_route_kernel[(e,)](
        x, residual, norm_weight.contiguous(), gate_weight, h, residual_out, logits, weights, ids, ticket,
        t, e, hidden, eps, x.stride(0), residual.stride(0), gate_weight.stride(0),
        K=top_k, RENORMALIZE=bool(renormalize), BLOCK_T=block_t, BLOCK_H=triton.next_power_of_2(hidden),
        BLOCK_E=block_e, RANK_CHUNK=max(1, min(32, 8192 // (block_t * block_e))),
        num_warps=8, enable_fp_fusion=False, **pdl_launch(x.device))
    return h, residual_out, weights, ids
