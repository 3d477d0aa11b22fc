"""The linear layer in plain torch, F.linear: the oracle for kernels/linear/triton.py and the
path of every call the skinny kernel does not take (CPU tensors, more than a few rows)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N], as nn.Linear computes it."""
    return F.linear(x, weight, bias)
