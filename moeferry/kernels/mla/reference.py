"""MLA decode attention in plain torch: the oracle of kernels/mla (and its CPU path).

Fixed shapes: the whole page table is gathered and masked by length, as the paged decode
reference of kernels/attention does, so it captures in a CUDA graph. Scores and softmax in
fp32; the probabilities rounded to q's dtype before the weighted sum, as the decompressed
attention does.
"""
from __future__ import annotations

import torch


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                         page_size: int, scale: float, rank: int) -> torch.Tensor:
    """q [B, H, rank + rope]; cache [slots, 1, rank + rope] -> [B, H, rank] (kernels/mla)."""
    b = q.shape[0]
    max_pages = page_table.shape[1]
    offs = torch.arange(page_size, device=q.device)
    slots = (page_table.long()[:, :, None] * page_size + offs).reshape(b, max_pages * page_size)
    rows = cache[slots, 0]  # [B, L, rank + rope]
    scores = torch.einsum("bhd,bld->bhl", q, rows).float() * scale
    valid = torch.arange(max_pages * page_size, device=q.device)[None, :] < seq_lens.long()[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.einsum("bhl,blr->bhr", probs, rows[..., :rank])
