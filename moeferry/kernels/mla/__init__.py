"""Multi-head latent attention decode over the paged latent cache (layers/mla.py).

Every head of a request attends to the same per-token row [rank + rope] (the latent and the
rope key): MQA with one key head whose value is the key's first `rank` elements. The Triton kernel
(triton.py, the full contract) runs on CUDA tensors, the plain-torch reference (reference.py,
the oracle) otherwise; `impl` names one.
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation

__all__ = ["mla_decode_attention"]


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                         page_size: int, scale: float, rank: int, *, impl: str | None = None) -> torch.Tensor:
    """q [B, H, rank + rope] (the absorbed query: W_UK-projected nope part, then the rotated
    rope part); cache [slots, 1, rank + rope]; page_table [B, P] int32; seq_lens [B] (the new
    token included) -> [B, H, rank] in q's dtype: softmax(scale * q.k) over each request's
    first seq_lens positions, times the latents cache[..., :rank]. Reads nothing past a
    request's length; fixed shapes and no host sync: CUDA-graph capturable."""
    return implementation("mla", q, impl).mla_decode_attention(q, cache, page_table, seq_lens, page_size, scale, rank)
