"""Plain torch: the oracle of kernels/generated_routes (the contract is its __init__.py)."""
from __future__ import annotations

import torch

from moeferry.kernels.generated_routes import BIG, FORCED_OFF, gumbel, uniforms


def draw_routes(fixed, gumbel_keys, keep_keys, step, routes, keep):
    natural = fixed + gumbel(uniforms(gumbel_keys, step))
    scores = natural
    if keep > 0:
        kept = uniforms(keep_keys, step) < keep
        scores = natural.scatter_add(2, routes, kept.float() * BIG)
    chosen = scores.topk(routes.shape[2], dim=2).indices
    # order the chosen experts as an unbiased router would (by their own scores): a kept
    # expert is not first in line
    order = natural.gather(2, chosen).argsort(dim=2, descending=True)
    routes.copy_(chosen.gather(2, order))


def force_logits(logits, ids):
    return torch.full_like(logits, FORCED_OFF).scatter_(1, ids, logits.gather(1, ids))


def oracle_predict(wrong_keys, keep_keys, step, true_ids, recall, width):
    k = true_ids.shape[-1]
    keep = (uniforms(keep_keys, step) < recall).float()
    # a kept true id scores 2 + its place, a dropped one -1: kept first, dropped never chosen
    place = torch.arange(k, 0, -1, device=true_ids.device, dtype=torch.float32) / (k + 1)
    scores = uniforms(wrong_keys, step).scatter(-1, true_ids.long(), keep * (2.0 + place) - (1.0 - keep))
    return scores.topk(width, dim=-1).indices
