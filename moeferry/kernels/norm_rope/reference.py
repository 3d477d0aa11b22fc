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

from moeferry.kernels.fused_moe.common import sum_route_partials
from moeferry.kernels.norm_rope.common import apply_rotary, rms_norm, rotate_half  # noqa: F401


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
