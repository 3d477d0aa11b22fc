"""The MoE router in plain torch: softmax over the experts, top-k, optional renormalisation.
The oracle for kernels/router/triton.py and the CPU path of layers/moe.py.

The arithmetic is the one MoEBlock had inline (and the HF reference models have), op for op:
fp32 softmax, torch.topk (sorted, descending), the k weights divided by their sum, then the
weights rounded through the logits' dtype and handed back as fp32, the ids as int32. So the
CPU path gives bit-identical results to the earlier code. Optional output buffers receive a
copy of the result.
"""
from __future__ import annotations

import torch

__all__ = ["softmax_topk"]


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 weights_out: torch.Tensor | None = None,
                 ids_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., E] (any float dtype) -> (weights [..., top_k] fp32, ids [..., top_k] int32),
    in descending weight order. Weights are rounded through logits.dtype as the reference
    models do; with ``renormalize`` the k weights are divided by their fp32 sum first."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights, ids = weights.to(logits.dtype).float(), ids.to(torch.int32)
    if weights_out is not None:
        weights = weights_out.copy_(weights)
    if ids_out is not None:
        ids = ids_out.copy_(ids)
    return weights, ids
