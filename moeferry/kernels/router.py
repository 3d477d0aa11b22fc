"""MoE router dispatch by device: the single-launch Triton kernel (kernels/triton/router.py)
on CUDA tensors, the plain-torch reference (kernels/reference/router.py, MoEBlock's original
arithmetic) otherwise. ``use_triton`` forces either (Triton on CPU tensors needs
TRITON_INTERPRET=1, set before triton is imported). Triton is imported lazily so CPU-only
callers never pay for it. See the Triton module for the full contract.
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation

__all__ = ["softmax_topk"]


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 weights_out: torch.Tensor | None = None, ids_out: torch.Tensor | None = None,
                 use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] fp32, ids [T, top_k] int32): fp32 softmax over the
    experts, the top_k in descending order (ties to the lowest index), optionally divided by
    their sum, weights rounded through logits.dtype."""
    return implementation("router", use_triton, logits).softmax_topk(
        logits, top_k, renormalize, weights_out=weights_out, ids_out=ids_out)
