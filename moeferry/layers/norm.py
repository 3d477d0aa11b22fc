"""RMSNorm, computed in float32 as the reference implementations do."""

import torch
from torch import nn

from moeferry.kernels import norm_rope


class RMSNorm(nn.Module):
    """y = w * (x / sqrt(mean(x^2) + eps)), normalised in float32, scaled in the input dtype."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] or [N, H, D] (each head normalised on its own); one kernel on CUDA."""
        return norm_rope.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual), one launch on CUDA; x, residual [N, D], or x a
        MoE block's per-route outputs [N, K, D], summed first (MoEBlock.forward)."""
        return norm_rope.fused_add_rms_norm(x, residual, self.weight, self.eps)
