"""RMSNorm, residual add + RMSNorm, and q/k norm + rotate-half RoPE + KV-cache store as single
Triton launches.

``rms_norm``, ``fused_add_rms_norm`` and ``qk_norm_rope_store`` have the signatures and the
results (to the rounding of the fp32 row reduction and rsqrt) of
``kernels/norm_rope/reference.py``. They replace the ~7 small torch kernels of an fp32 RMSNorm
and the add before it; ``qk_norm_rope_store`` replaces an attention layer's per-head q/k
norms, the ~12 kernels of rotary on q and k, and both KV-cache stores (rotary alone is that
op without norm weights).

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

from moeferry.kernels.triton_common import output_buffer, pdl_launch, rounded, wait_for_previous_kernel

_TILE = 2048  # elements per program for short rows (per-head q/k norm and rotary)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, inner, D, eps,
                     x_s0, x_s1, r_s0, r_s1, part_stride,
                     ADD: tl.constexpr, PARTS: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    outer, head = (rows // inner).to(tl.int64), (rows % inner).to(tl.int64)
    x_off = (outer * x_s0 + head * x_s1)[:, None] + cols[None, :]
    dense_off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 1:  # x is the first of PARTS partial rows: their fp32 sum in order, rounded
        for part in tl.static_range(1, PARTS):
            x += tl.load(x_ptr + part * part_stride + x_off, mask=mask, other=0.0).to(tl.float32)
        x = rounded(x, x_ptr.dtype.element_ty)
    if ADD:
        r_off = (outer * r_s0 + head * r_s1)[:, None] + cols[None, :]
        r = tl.load(res_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
        x = rounded(x + r, res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + dense_off, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    xn = rounded(x * inv[:, None], x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = rounded(w[None, :] * xn, out_ptr.dtype.element_ty)
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


def _norm_launch(x, residual, weight, eps, out, residual_out, parts=1, part_stride=0):
    x, inner, x_s0, x_s1 = _rows_view(x)
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight {tuple(weight.shape)} for rows of {d}")
    n_rows = x.numel() // d if d else 0
    out = output_buffer(out, x.shape, torch.promote_types(weight.dtype, x.dtype), x.device, "out")
    if residual is not None:
        residual, _, r_s0, r_s1 = _rows_view(residual)
        residual_out = output_buffer(residual_out, x.shape, x.dtype, x.device, "residual_out")
    else:
        r_s0 = r_s1 = 0
    if n_rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(d)
    rows = max(1, _TILE // block)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x, residual if residual is not None else x, weight.contiguous(), out,
        residual_out if residual is not None else out, n_rows, inner, d, eps,
        x_s0, x_s1, r_s0, r_s1, part_stride,
        ADD=residual is not None, PARTS=parts, ROWS=rows, BLOCK=block,
        num_warps=8 if block >= 4096 else 4, enable_fp_fusion=False, **pdl_launch(x.device))
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
    residual stream updated in place); ``out`` must not overlap any other argument.

    x may also be [N, K, D], partial rows in residual's dtype (a MoE layer's K weighted route
    outputs, fused_moe(sum_routes=False)): x[n] is then their fp32 sum over k = 0..K-1 in
    order, rounded to that dtype, the bits of the MoE kernel's own sum; residual_out may not
    be x then."""
    parts, part_stride = 1, 0
    if x.dim() == 3:
        if x.stride(-1) != 1:
            x = x.contiguous()
        if residual_out is not None and residual_out.data_ptr() == x.data_ptr():
            raise ValueError("residual_out may not be the partial rows x")
        parts, part_stride, x = x.shape[1], x.stride(1), x[:, 0]
    if x.dtype != residual.dtype or x.shape != residual.shape or x.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} must be [N, D] (or [N, K, D] partials) of one dtype")
    return _norm_launch(x, residual, weight, eps, out, residual_out, parts, part_stride)


@triton.jit
def _qk_norm_rope_store_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr,
                               q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, n_rows, HQ, HKV, eps,
                               q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, kc_s0, kc_s1, vc_s0, vc_s1,
                               table_stride,
                               NORM: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr,
                               BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    # Row r is head r % (HQ + 2 HKV) of token r // (HQ + 2 HKV): its q heads, k heads, v heads.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_HALF)
    live = rows < n_rows
    col_ok = cols < HALF
    mask = live[:, None] & col_ok[None, :]
    token, head = (rows // (HQ + 2 * HKV)).to(tl.int64), (rows % (HQ + 2 * HKV)).to(tl.int64)
    is_q = head < HQ
    is_v = head >= HQ + HKV
    is_k = ~is_q & ~is_v
    kv_head = tl.where(is_v, head - HQ - HKV, head - HQ)  # k or v head; unused on q rows
    src = tl.where(is_q[:, None], q_ptr + (token * q_s0 + head * q_s1)[:, None],
                   tl.where(is_k[:, None], k_ptr + (token * k_s0 + kv_head * k_s1)[:, None],
                            v_ptr + (token * v_s0 + kv_head * v_s1)[:, None])) + cols[None, :]
    # Both halves of an element pair are loaded and stored by the same thread (same offsets,
    # same layout), which is what makes q_out = q in place safe.
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)

    dt = q_out_ptr.dtype.element_ty
    if NORM:
        # rms_norm of each q/k head: normalised row rounded to the input dtype, then the weight
        # product rounded to the output dtype (v rows compute it too, unused).
        inv = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / (2 * HALF) + eps)[:, None]
        qw1 = tl.load(qw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        qw2 = tl.load(qw_ptr + cols + HALF, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        kw1 = tl.load(kw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        kw2 = tl.load(kw_ptr + cols + HALF, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        xdt = q_ptr.dtype.element_ty
        y1 = rounded(tl.where(is_q[:, None], qw1, kw1) * rounded(x1 * inv, xdt), dt)
        y2 = rounded(tl.where(is_q[:, None], qw2, kw2) * rounded(x2 * inv, xdt), dt)
    else:
        y1 = x1
        y2 = x2

    # Rotary of the q/k rows as the reference rounds it: cos/sin rounded to the output dtype,
    # each product and the sum rounded to it, no FMA.
    qk_mask = mask & ~is_v[:, None]
    table = (tl.load(pos_ptr + token, mask=live & ~is_v, other=0).to(tl.int64) * table_stride)[:, None] + cols[None, :]
    c1 = rounded(tl.load(cos_ptr + table, mask=qk_mask, other=0.0), dt)
    c2 = rounded(tl.load(cos_ptr + table + HALF, mask=qk_mask, other=0.0), dt)
    s1 = rounded(tl.load(sin_ptr + table, mask=qk_mask, other=0.0), dt)
    s2 = rounded(tl.load(sin_ptr + table + HALF, mask=qk_mask, other=0.0), dt)
    lo = rounded(rounded(y1 * c1, dt) + rounded(-y2 * s1, dt), dt)
    hi = rounded(rounded(y2 * c2, dt) + rounded(y1 * s2, dt), dt)

    dst = tl.where(is_q[:, None], q_out_ptr + (token * HQ + head)[:, None] * (2 * HALF),
                   k_out_ptr + (token * HKV + kv_head)[:, None] * (2 * HALF)) + cols[None, :]
    tl.store(dst, lo.to(dt), mask=qk_mask)
    tl.store(dst + HALF, hi.to(dt), mask=qk_mask)
    # The cache rows: k_rot into k_cache[slot], v unchanged into v_cache[slot].
    slot = tl.load(slot_ptr + token, mask=live & ~is_q, other=0).to(tl.int64)
    k_mask = mask & is_k[:, None]
    kc = k_cache_ptr + (slot * kc_s0 + kv_head * kc_s1)[:, None] + cols[None, :]
    tl.store(kc, lo.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(kc + HALF, hi.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    v_mask = mask & is_v[:, None]
    vc = v_cache_ptr + (slot * vc_s0 + kv_head * vc_s1)[:, None] + cols[None, :]
    tl.store(vc, x1.to(v_cache_ptr.dtype.element_ty), mask=v_mask)
    tl.store(vc + HALF, x2.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       out_slots: torch.Tensor, *, q_norm_weight: torch.Tensor | None = None,
                       k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       q_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (when the weights are given), rotary, and the KV-cache store
    of k and v, one launch: rms_norm, rms_norm, apply_rotary and the two index_copy_ of a
    decode step's attention prologue.

    q [N, Hq, D], k and v [N, Hkv, D]: one dtype (bf16|fp16|fp32), D even, unit last stride,
    any token/head strides (slices of a fused qkv projection). positions and out_slots [N]
    int64 (or int32); cos, sin [P, D] float32 tables (RotaryEmbedding's). q_norm_weight and
    k_norm_weight [D]: both or neither; the normed heads are in
    ``promote_types(weight.dtype, q.dtype)`` (q's dtype without norm), the same for q and k,
    and that is the dtype of q_rot, k_rot and k_cache. k_cache, v_cache [slots, Hkv, D] with
    a unit last stride (any slot/head strides), v_cache in v's dtype; written in place.

    Writes q_rot into ``q_out`` [N, Hq, D] (contiguous, allocated unless given; may be q itself
    when q is contiguous, no other overlap), k_rot into a new [N, Hkv, D], k_rot into
    k_cache[out_slots] and v into v_cache[out_slots]; returns (q_rot, k_rot). Invariants
    expected of the caller, not checked (that would read back to the host): ``0 <= positions
    < P`` and ``0 <= out_slots < slots``. Rows sharing a slot (the padding rows of a captured
    batch all write the scratch slot) race for it: the slot ends up holding garbage, as with
    index_copy_, and every other slot is exact. A program handles ROWS consecutive (token, head)
    rows of the N * (Hq + 2 Hkv), q, k and v heads alike."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected [N, H, D]")
    n, hq, d = q.shape
    hkv = k.shape[1]
    if (k.dtype != q.dtype or v.dtype != q.dtype or k.shape != v.shape or k.shape[0] != n
            or k.shape[2] != d or d % 2):
        raise ValueError(f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} "
                         f"{v.dtype}: need one dtype, the same N, k and v alike and an even head_dim")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight: give both or neither")
    norm = q_norm_weight is not None
    dtype = q.dtype
    if norm:
        if q_norm_weight.shape != (d,) or k_norm_weight.shape != (d,):
            raise ValueError(f"norm weights {tuple(q_norm_weight.shape)}, {tuple(k_norm_weight.shape)} "
                             f"for head_dim {d}")
        dtype = torch.promote_types(q_norm_weight.dtype, q.dtype)
        if torch.promote_types(k_norm_weight.dtype, k.dtype) != dtype:
            raise ValueError(f"q_norm_weight {q_norm_weight.dtype} and k_norm_weight {k_norm_weight.dtype} "
                             f"give q and k different dtypes")
    if cos.shape != sin.shape or cos.shape[-1] != d or cos.stride() != sin.stride():
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} for head_dim {d}")
    for name, cache, want in (("k_cache", k_cache, dtype), ("v_cache", v_cache, v.dtype)):
        if cache.dim() != 3 or tuple(cache.shape[1:]) != (hkv, d) or cache.dtype != want or cache.stride(-1) != 1:
            raise ValueError(f"{name}: expected [slots, {hkv}, {d}] {want} with a unit last stride, got "
                             f"{tuple(cache.shape)} {cache.dtype} strides {cache.stride()}")
    if positions.shape != (n,) or out_slots.shape != (n,):
        raise ValueError(f"positions {tuple(positions.shape)} and out_slots {tuple(out_slots.shape)} for N={n}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q_out = output_buffer(q_out, q.shape, dtype, q.device, "q_out")
    k_out = torch.empty(k.shape, dtype=dtype, device=k.device)
    if n == 0:
        return q_out, k_out
    half = d // 2
    block_half = triton.next_power_of_2(half)
    n_rows = n * (hq + 2 * hkv)
    rows = max(1, _TILE // 2 // block_half)
    weights = (q_norm_weight.contiguous(), k_norm_weight.contiguous()) if norm else (q_out, q_out)
    _qk_norm_rope_store_kernel[(triton.cdiv(n_rows, rows),)](
        q, k, v, *weights, positions, cos, sin, out_slots, q_out, k_out, k_cache, v_cache,
        n_rows, hq, hkv, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), cos.stride(0),
        NORM=norm, HALF=half, ROWS=rows, BLOCK_HALF=block_half,
        num_warps=4, enable_fp_fusion=False, **pdl_launch(q.device))
    return q_out, k_out
