"""Token sampling over a batch of logits, one SamplingParams per row."""

from __future__ import annotations

import torch


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = probs.cumsum(-1)
        drop = (cum - probs) >= top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, params: list, generators: list) -> list[int]:
    """logits [B, V] float32 -> one token per row. Greedy rows take the argmax; the others
    sample from temperature-scaled, top-k/top-p filtered probabilities with their own CPU
    generator (so a seed gives the same tokens on every device)."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            out.append(greedy[row])
            continue
        row_logits = _filter_top_k_top_p(logits[row].cpu() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row_logits, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out
