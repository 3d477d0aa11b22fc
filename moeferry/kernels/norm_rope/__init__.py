"""RMSNorm, residual add + RMSNorm, and q/k norm + rotary + KV-cache store: the Triton kernels
(triton.py) on CUDA tensors, the plain-torch reference (reference.py, the modules' own
arithmetic) otherwise; `impl` names one. Both take the same arguments; the full contract
(shapes, dtypes, aliasing) is in triton.py.
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation

__all__ = ["fused_add_rms_norm", "qk_norm_rope_store", "rms_norm"]

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None,
             impl: str | None = None) -> torch.Tensor:
    """x [N, D] or [N, H, D], weight [D] -> weight * normalise(x) over the last dim, in
    promote_types(weight.dtype, x.dtype)."""
    return implementation("norm_rope", x, impl).rms_norm(x, weight, eps, out=out)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                       impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [N, D] -> (rms_norm(x + residual), x + residual); residual_out may be x or
    residual (in place). x may also be a MoE layer's partial rows [N, K, D]
    (ops.fused_moe(sum_routes=False)), summed here as the MoE kernel would have."""
    return implementation("norm_rope", x, impl).fused_add_rms_norm(x, residual, weight, eps, out=out,
                                                   residual_out=residual_out)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       out_slots: torch.Tensor, *, q_norm_weight: torch.Tensor | None = None,
                       k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       q_out: torch.Tensor | None = None,
                       impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k, v [N, Hkv, D] -> (q_rot, k_rot): per-head rms_norm of q and k when both
    weights are given, apply_rotary at positions [N], then k_cache[out_slots] = k_rot and
    v_cache[out_slots] = v (caches [slots, Hkv, D], in place); q_out may be q (in place)."""
    return implementation("norm_rope", q, impl).qk_norm_rope_store(q, k, v, positions, cos, sin, k_cache, v_cache, out_slots,
                                                   q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
                                                   eps=eps, q_out=q_out)
