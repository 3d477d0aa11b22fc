"""RMSNorm, computed in float32 as the reference implementations do."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = w * (x / sqrt(mean(x^2) + eps)), normalised in float32, scaled in the input dtype."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
