"""RMSNorm, residual add + RMSNorm, and q/k norm + rotary + KV-cache store dispatch by device: the Triton kernels (kernels/triton/norm_rope.py) on CUDA tensors, the plain-torch reference
(kernels/reference/norm_rope.py, the modules' own arithmetic) otherwise. ``use_triton`` forces
either (Triton on CPU tensors needs TRITON_INTERPRET=1, set before triton is imported).
Triton is imported lazily so CPU-only callers never pay for it. Both paths take the same
arguments; see the Triton module for the full contract (shapes, dtypes, aliasing).
"""
from __future__ import annotations

import functools

import torch

from moeferry.kernels import implementation

__all__ = ["fused_add_rms_norm", "qk_norm_rope_store", "rms_norm"]

_impl = functools.partial(implementation, "norm_rope")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None,
             use_triton: bool | None = None) -> torch.Tensor:
    """x [N, D] or [N, H, D], weight [D] -> weight * normalise(x) over the last dim, in
    promote_types(weight.dtype, x.dtype)."""
    return _impl(use_triton, x).rms_norm(x, weight, eps, out=out)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                       use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [N, D] -> (rms_norm(x + residual), x + residual); residual_out may be x or
    residual (in place). x may also be a MoE layer's partial rows [N, K, D]
    (ops.fused_moe(sum_routes=False)), summed here as the MoE kernel would have."""
    return _impl(use_triton, x).fused_add_rms_norm(x, residual, weight, eps, out=out,
                                                   residual_out=residual_out)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       out_slots: torch.Tensor, *, q_norm_weight: torch.Tensor | None = None,
                       k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       q_out: torch.Tensor | None = None,
                       use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k, v [N, Hkv, D] -> (q_rot, k_rot): per-head rms_norm of q and k when both
    weights are given, apply_rotary at positions [N], then k_cache[out_slots] = k_rot and
    v_cache[out_slots] = v (caches [slots, Hkv, D], in place); q_out may be q (in place)."""
    return _impl(use_triton, q).qk_norm_rope_store(q, k, v, positions, cos, sin, k_cache, v_cache, out_slots,
                                                   q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
                                                   eps=eps, q_out=q_out)
