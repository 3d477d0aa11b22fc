"""Linear layers: the skinny Triton kernel (triton.py, the full contract) for decode-sized
calls on CUDA (its shape rule: `skinny`), F.linear (reference.py; cuBLAS on the GPU)
otherwise; `impl` names one.
"""
from __future__ import annotations

import math

import torch

from moeferry.kernels import implementation

__all__ = ["SKINNY_MAX_MACS", "SKINNY_MAX_ROWS", "linear", "skinny"]

# Where the kernel beats cuBLAS on an H200 (benchmarks/bench_linear.py): at most one 16-row
# tile, and at most SKINNY_MAX_MACS multiply-adds, where its CUDA-core path streams the weight
# in thousands of short programs. Qwen3-30B-A3B per layer: qkv (5120 x 2048) at 1 row, o_proj
# (2048 x 4096) at 1-2 rows, the router gate (128 x 2048) at 1-16 rows; not the lm_head.
# Past that budget the tensor-core path, like cuBLAS, is bound by its few programs, and
# cuBLAS was as fast or faster.
SKINNY_MAX_ROWS = 16
SKINNY_MAX_MACS = 1 << 24
_SKINNY_DTYPES = (torch.bfloat16, torch.float16)


def skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton kernel takes this call by default: x on CUDA with 1..SKINNY_MAX_ROWS
    rows once its leading dims are flattened and rows * N * K <= SKINNY_MAX_MACS, a contiguous
    bf16/fp16 weight of x's dtype (a strided weight would be read at a fraction of HBM
    bandwidth)."""
    rows = math.prod(x.shape[:-1])
    return (x.is_cuda and x.dim() >= 1 and 1 <= rows <= SKINNY_MAX_ROWS
            and rows * weight.numel() <= SKINNY_MAX_MACS
            and x.dtype in _SKINNY_DTYPES and weight.dtype == x.dtype and weight.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           impl: str | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x.dtype, fp32 accumulation."""
    module = implementation("linear", x, impl, triton_eligible=skinny(x, weight))
    y = module.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
