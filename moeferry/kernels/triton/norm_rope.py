"""RMSNorm, residual add + RMSNorm, and rotate-half RoPE as single Triton launches.

``rms_norm``, ``fused_add_rms_norm`` and ``apply_rotary`` have the signatures and the results
(to the rounding of the fp32 row reduction and rsqrt) of ``kernels/reference/norm_rope.py``,
which replace the ~7 small torch kernels of an fp32 RMSNorm, the add before it, and the ~12
of rotary on q and k during a decode step.

Common contract
- Every call reads only tensor shapes, strides and dtypes on the host: the grid is fixed by
  them, nothing is read back, so a call captures in a CUDA graph and replays with new values
  in the same buffers (the outputs it allocates come from the graph's pool).
- Inputs may be strided views with a unit last stride (a q slice of a fused qkv output,
  a row slice of the residual stream); outputs given by the caller must be contiguous.
- Each output element is written exactly once; an element is read and then written by the
  same program, so an output may alias the input of the same shape where stated.
- Rounding follows the torch ops being replaced: the sum of the residual add is rounded to
  the input dtype, the normalised row to the input dtype before the weight multiply, and the
  two rotary products and their sum each to q's dtype, and no multiply-add is fused into an
  FMA (enable_fp_fusion=False), so the rotary result and the residual sum equal the reference
  bit for bit and the norms differ only by the row reduction's order and rsqrt.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE = 2048  # elements per program for short rows (per-head q/k norm, rotary heads)


@triton.jit
def _rounded(x, dt):
    """fp32 x rounded to the nearest dt value (ties to even), returned as fp32. bf16 is rounded
    on the bits: the same result as the GPU's cvt.rn, and correct under TRITON_INTERPRET, whose
    fp32 -> bf16 cast truncates."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        y = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(dt).to(tl.float32)
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, inner, D, eps,
                     x_s0, x_s1, r_s0, r_s1,
                     ADD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    outer, head = (rows // inner).to(tl.int64), (rows % inner).to(tl.int64)
    x_off = (outer * x_s0 + head * x_s1)[:, None] + cols[None, :]
    dense_off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r_off = (outer * r_s0 + head * r_s1)[:, None] + cols[None, :]
        r = tl.load(res_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
        x = _rounded(x + r, res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + dense_off, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    xn = _rounded(x * inv[:, None], x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = _rounded(w[None, :] * xn, out_ptr.dtype.element_ty)
    tl.store(out_ptr + dense_off, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x, inner, stride of dim 0, stride of the head dim) for x [N, D] or [N, H, D]; rows are
    enumerated as n * inner + h."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"expected [N, D] or [N, H, D], got {tuple(x.shape)}")


def _output(out: torch.Tensor | None, shape, dtype, device, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"{name}: expected contiguous {tuple(shape)} {dtype}, "
                         f"got {tuple(out.shape)} {out.dtype} contiguous={out.is_contiguous()}")
    return out


def _norm_launch(x, residual, weight, eps, out, residual_out):
    x, inner, x_s0, x_s1 = _rows_view(x)
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight {tuple(weight.shape)} for rows of {d}")
    n_rows = x.numel() // d if d else 0
    out = _output(out, x.shape, torch.promote_types(weight.dtype, x.dtype), x.device, "out")
    if residual is not None:
        residual, _, r_s0, r_s1 = _rows_view(residual)
        residual_out = _output(residual_out, x.shape, x.dtype, x.device, "residual_out")
    else:
        r_s0 = r_s1 = 0
    if n_rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(d)
    rows = max(1, _TILE // block)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x, residual if residual is not None else x, weight.contiguous(), out,
        residual_out if residual is not None else out, n_rows, inner, d, eps,
        x_s0, x_s1, r_s0, r_s1,
        ADD=residual is not None, ROWS=rows, BLOCK=block,
        num_warps=8 if block >= 4096 else 4, enable_fp_fusion=False)
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim, one launch.

    x [N, D] or [N, H, D] (each head a row: per-head q/k norm), bf16|fp16|fp32, unit last
    stride; weight [D]; eps a float. Returns ``out`` (shape of x, dtype
    ``promote_types(weight.dtype, x.dtype)``, contiguous; allocated unless given; must not
    overlap x unless it is x itself with that dtype and layout)."""
    return _norm_launch(x, None, weight, eps, out, None)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       out: torch.Tensor | None = None,
                       residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual_out) = (rms_norm(x + residual), x + residual), one launch.

    x, residual [N, D] of one dtype, unit last stride. residual_out [N, D] in that dtype, the
    sum rounded once; normed [N, D] as rms_norm gives for it. Both contiguous, allocated unless
    given. ``residual_out`` may be x or residual itself when that one is contiguous (the
    residual stream updated in place); ``out`` must not overlap any other argument."""
    if x.dtype != residual.dtype or x.shape != residual.shape or x.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} must be [N, D] of one dtype")
    return _norm_launch(x, residual, weight, eps, out, residual_out)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr, n_rows, HQ, HKV,
                   q_s0, q_s1, k_s0, k_s1, table_stride,
                   HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # Row r is head r % (HQ + HKV) of token r // (HQ + HKV): its q heads, then its k heads.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_HALF)
    live = rows < n_rows
    mask = live[:, None] & (cols < HALF)[None, :]
    token, head = (rows // (HQ + HKV)).to(tl.int64), (rows % (HQ + HKV)).to(tl.int64)
    is_q = (head < HQ)[:, None]
    src = tl.where(is_q, q_ptr + (token * q_s0 + head * q_s1)[:, None],
                   k_ptr + (token * k_s0 + (head - HQ) * k_s1)[:, None]) + cols[None, :]
    dst = tl.where(is_q, q_out_ptr + (token * HQ + head)[:, None] * (2 * HALF),
                   k_out_ptr + (token * HKV + head - HQ)[:, None] * (2 * HALF)) + cols[None, :]
    dt = q_out_ptr.dtype.element_ty
    table = (tl.load(pos_ptr + token, mask=live, other=0).to(tl.int64) * table_stride)[:, None] + cols[None, :]
    c1 = _rounded(tl.load(cos_ptr + table, mask=mask, other=0.0), dt)
    c2 = _rounded(tl.load(cos_ptr + table + HALF, mask=mask, other=0.0), dt)
    s1 = _rounded(tl.load(sin_ptr + table, mask=mask, other=0.0), dt)
    s2 = _rounded(tl.load(sin_ptr + table + HALF, mask=mask, other=0.0), dt)
    # Both halves of an element pair are loaded and stored by the same thread (same offsets,
    # same layout), which is what makes q_out = q in place safe.
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x) = cat(-x2, x1). Each product and the sum are rounded to q's dtype, as the
    # torch ops round them.
    lo = _rounded(_rounded(x1 * c1, dt) + _rounded(-x2 * s1, dt), dt)
    hi = _rounded(_rounded(x2 * c2, dt) + _rounded(x1 * s2, dt), dt)
    tl.store(dst, lo.to(dt), mask=mask)
    tl.store(dst + HALF, hi.to(dt), mask=mask)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, *, q_out: torch.Tensor | None = None,
                 k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q and k in one launch.

    q [N, Hq, D], k [N, Hkv, D]: one dtype (bf16|fp16|fp32), D even, unit last stride, any
    token/head strides. positions [N] int64 (or int32) on the same device; cos, sin [P, D]
    float32 with a unit last stride (the module's tables). Invariant expected of the caller:
    ``0 <= positions < P`` (not checked: that would read back to the host; a position out of
    range reads outside the table). Writes q_out [N, Hq, D] and k_out [N, Hkv, D] (dtype of q,
    contiguous, allocated unless given); q_out may be q and k_out may be k (in place), no other
    overlap. A program rotates ROWS consecutive (token, head) rows of the N * (Hq + Hkv), q
    heads and k heads alike, gathering each row's cos/sin (cached across a token's heads)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    if k.dtype != q.dtype or k.shape[0] != n or k.shape[2] != d or d % 2:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype}: "
                         "need one dtype, the same N and an even head_dim")
    if cos.shape != sin.shape or cos.shape[-1] != d or cos.stride() != sin.stride():
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} for head_dim {d}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q_out = _output(q_out, q.shape, q.dtype, q.device, "q_out")
    k_out = _output(k_out, k.shape, q.dtype, q.device, "k_out")
    if n == 0:
        return q_out, k_out
    half = d // 2
    block_half = triton.next_power_of_2(half)
    rows = max(1, _TILE // 2 // block_half)
    n_rows = n * (hq + hkv)
    _rotary_kernel[(triton.cdiv(n_rows, rows),)](
        q, k, q_out, k_out, positions, cos, sin, n_rows, hq, hkv, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), cos.stride(0), HALF=half, ROWS=rows, BLOCK_HALF=block_half,
        num_warps=4, enable_fp_fusion=False)
    return q_out, k_out
