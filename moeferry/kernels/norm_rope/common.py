"""What the norm/RoPE oracle and the engine's CPU paths share: RMSNorm and rotate-half RoPE in
plain torch (the modules' own arithmetic, op for op; reference.py says the contract).
Production code imports these from here, never from the oracle."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2, -1) + eps)) over the last dim of x [..., D]; weight [D].
    The dtype is torch's promotion of (weight.dtype, x.dtype)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * x32.to(dtype)
    return y if out is None else out.copy_(y)


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
