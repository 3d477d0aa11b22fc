"""The MoE router's scores and top-k: one Triton launch on CUDA tensors (triton.py, the full
contract), the plain-torch reference (reference.py, MoEBlock's original arithmetic) otherwise;
`impl` names one.
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation

__all__ = ["softmax_topk"]


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 weights_out: torch.Tensor | None = None, ids_out: torch.Tensor | None = None,
                 impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] fp32, ids [T, top_k] int32): fp32 softmax over the
    experts, the top_k in descending order (ties to the lowest index), optionally divided by
    their sum, weights rounded through logits.dtype."""
    return implementation("router", logits, impl).softmax_topk(
        logits, top_k, renormalize, weights_out=weights_out, ids_out=ids_out)
