"""The MoE router's scores and top-k: one Triton launch on CUDA tensors (triton.py, the full
contract), the plain-torch reference (reference.py, MoEBlock's original arithmetic) otherwise;
`impl` names one. DeepSeek's grouped routers (`grouped_topk`) have only the reference so far:
a few small torch ops per MoE layer, capturable in the decode graph.
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation

__all__ = ["grouped_topk", "softmax_topk"]


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 weights_out: torch.Tensor | None = None, ids_out: torch.Tensor | None = None,
                 impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] fp32, ids [T, top_k] int32): fp32 softmax over the
    experts, the top_k in descending order (ties to the lowest index), optionally divided by
    their sum, weights rounded through logits.dtype."""
    return implementation("router", logits, impl).softmax_topk(
        logits, top_k, renormalize, weights_out=weights_out, ids_out=ids_out)


def grouped_topk(logits: torch.Tensor, top_k: int, renormalize: bool, *, scoring: str,
                 correction_bias: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] fp32, ids [T, top_k] int32) by DeepSeek's rules:
    softmax or sigmoid scores, an optional choice-only bias, group-limited choice, routed
    scaling (the full contract: reference.grouped_topk)."""
    from moeferry.kernels.router import reference

    return reference.grouped_topk(logits, top_k, renormalize, scoring=scoring, correction_bias=correction_bias,
                                  num_groups=num_groups, topk_groups=topk_groups, scaling=scaling)
