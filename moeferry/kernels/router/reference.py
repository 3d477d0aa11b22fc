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

__all__ = ["grouped_topk", "softmax_topk"]


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


def grouped_topk(logits: torch.Tensor, top_k: int, renormalize: bool, *, scoring: str,
                 correction_bias: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routers: logits [T, E] fp32 -> (weights [T, top_k] fp32, ids [T, top_k] int32).

    scoring "softmax" (DeepSeek-V2: greedy, or group-limited with num_groups > 1, a group scored
    by its best expert) or "sigmoid" (DeepSeek-V3 `noaux_tc`: `correction_bias` is added to the
    scores for the choice only, a group scored by the sum of its best two). Experts outside the
    `topk_groups` best of the `num_groups` groups are never chosen. The weights are the chosen
    experts' unbiased scores, divided by their sum (plus 1e-20) with `renormalize`, then times
    `scaling` (routed_scaling_factor); in fp32, never rounded through a lower dtype (the HF
    models keep the router in fp32). Ids in descending order of the choice score.
    """
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        t, e = choice.shape
        grouped = choice.view(t, num_groups, e // num_groups)
        if scoring == "softmax":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep_groups = group_scores.topk(topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        fill = 0.0 if scoring == "softmax" else float("-inf")
        choice = choice.masked_fill(~keep.repeat_interleave(e // num_groups, dim=1), fill)
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids.to(torch.int32)
