"""MoE router dispatch by device: the single-launch Triton kernel (kernels/triton/router.py)
on CUDA tensors, the plain-torch reference (kernels/reference/router.py, MoEBlock's original
arithmetic) otherwise. ``use_triton`` forces either (Triton on CPU tensors needs
TRITON_INTERPRET=1, set before triton is imported). Triton is imported lazily so CPU-only
callers never pay for it. See the Triton module for the full contract.
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation

__all__ = ["add_norm_route", "fusable", "softmax_topk"]


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 weights_out: torch.Tensor | None = None, ids_out: torch.Tensor | None = None,
                 use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] fp32, ids [T, top_k] int32): fp32 softmax over the
    experts, the top_k in descending order (ties to the lowest index), optionally divided by
    their sum, weights rounded through logits.dtype."""
    return implementation("router", use_triton, logits).softmax_topk(
        logits, top_k, renormalize, weights_out=weights_out, ids_out=ids_out)


def fusable(rows: int, hidden: int, experts: int) -> bool:
    """Whether the Triton add_norm_route takes a call of this size (the Triton module says why)."""
    from moeferry.kernels.triton.router import fusable as triton_fusable

    return triton_fusable(rows, hidden, experts)


def add_norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   gate_weight: torch.Tensor, top_k: int, renormalize: bool, ticket: torch.Tensor, *,
                   logits_out: torch.Tensor | None = None, use_triton: bool | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, residual_out, weights, ids) = (rms_norm(x + residual), x + residual, and
    softmax_topk of h @ gate_weight.T): a MoE layer's entry, one launch on CUDA for a call
    that ``fusable`` takes. ``ticket``: a [1] int32 zero on x's device that the caller owns
    (the kernel's arrival counter, left 0); ``logits_out`` [T, E] receives the logits."""
    return implementation("router", use_triton, x).add_norm_route(
        x, residual, norm_weight, eps, gate_weight, top_k, renormalize, ticket, logits_out=logits_out)
