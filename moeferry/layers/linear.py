"""The engine's linear projection: nn.Linear's parameters and state dict, with the forward
through kernels/linear.py (the skinny Triton kernel for decode-sized batches on CUDA,
F.linear otherwise). Still a module call, so forward hooks on it fire as on nn.Linear."""

from __future__ import annotations

import torch
from torch import nn

from moeferry.kernels.linear import linear


class Linear(nn.Linear):
    """nn.Linear whose forward is kernels.linear.linear(x, weight, bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
