"""RMSNorm, residual add + RMSNorm, rotate-half RoPE, and q/k norm + RoPE + KV-cache store in
plain torch: the oracle for kernels/norm_rope/triton.py and the CPU path of layers/norm.py and
the attention prologue (``apply_rotary`` is the rotary part of ``qk_norm_rope_store``).

The arithmetic is the modules' own, op for op (normalise in fp32, cast to the input dtype,
multiply by the weight; cos/sin cast to q's dtype, then q * cos + rotate_half(q) * sin), so
a module that calls these on CPU gives bit-identical results to its earlier inline code.
Optional ``out`` buffers receive a copy of the result and may alias the inputs they name.
"""
from __future__ import annotations

import torch

from moeferry.kernels.fused_moe.reference import sum_route_partials


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2, -1) + eps)) over the last dim of x [..., D]; weight [D].
    The dtype is torch's promotion of (weight.dtype, x.dtype)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * x32.to(dtype)
    return y if out is None else out.copy_(y)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       out: torch.Tensor | None = None,
                       residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual [N, D] of one dtype.
    ``residual_out`` may be x or residual itself (the sum is written in place). x may also be
    [N, K, D] partial rows of any float dtype (fused_moe(sum_routes=False)): their float32 sum
    over k in order, rounded to residual's dtype, takes x's place."""
    if x.dim() == 3:
        x = sum_route_partials(x).to(residual.dtype)
    if x.dtype != residual.dtype:
        raise ValueError(f"x is {x.dtype} but residual is {residual.dtype}")
    total = x + residual if residual_out is None else torch.add(x, residual, out=residual_out)
    return rms_norm(total, weight, eps, out=out), total


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, *, q_out: torch.Tensor | None = None,
                 k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [N, Hq, D] and k [N, Hkv, D] at positions [N] (int64) with the
    rows of the tables cos, sin [P, D] (fp32), cast to q's dtype. ``q_out``/``k_out`` may be
    q/k themselves."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    q_rot = q * c + rotate_half(q) * s
    k_rot = k * c + rotate_half(k) * s
    if q_out is not None:
        q_rot = q_out.copy_(q_rot)
    if k_out is not None:
        k_rot = k_out.copy_(k_rot)
    return q_rot, k_rot


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       out_slots: torch.Tensor, *, q_norm_weight: torch.Tensor | None = None,
                       k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       q_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention prologue of one layer: per-head rms_norm of q and k when the weights are
    given (both or neither), apply_rotary, then k_cache[out_slots] = k_rot and
    v_cache[out_slots] = v (index_copy_). Returns (q_rot, k_rot); q_rot is copied to ``q_out``
    (which may be q itself) when given."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight: give both or neither")
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    q_rot, k_rot = apply_rotary(q, k, positions, cos, sin, q_out=q_out)
    k_cache.index_copy_(0, out_slots, k_rot)
    v_cache.index_copy_(0, out_slots, v)
    return q_rot, k_rot
