"""Generated routes on the device (routing/profiles.py draws them, routing/forced.py forces
them on a model's routers): a forward's draw and each layer's forcing, each one launch inside
a captured decode graph, where a chain of small torch ops would cost the measured step tens of
kernels that no real router runs.

    draw_routes(fixed [L, T, E] float32, gumbel_keys [L, T, E] int64, keep_keys [L, T, K] int64,
                step [1] int64, routes [L, T, K] int64, keep: float) -> None

`routes` holds each row's previous routes and is rewritten in place with the new ones; for
every (layer l, row t):

    natural[e] = fixed[l, t, e] + gumbel(uniform(gumbel_keys[l, t, e], step))
    score[e]   = natural[e] + BIG where e = routes[l, t, j] and uniform(keep_keys[l, t, j], step)
                 < keep (a kept expert of the previous token; never when keep is 0)
    routes[l, t] = the K experts of the largest scores, ordered by their natural scores,
                   largest first

with uniform(key, step) = ((hash32((key + step) mod 2^32) >> 8) + 0.5) / 2^24 in float32 and
gumbel(u) = -log(-log(u)). Ties between scores are broken by the lower expert id in the Triton
kernel and as torch.topk does in the reference: the scores are continuous draws, so a tie is an
event of probability ~0, and every strategy of one device draws with the same implementation.

    oracle_predict(wrong_keys [L, T, E] int64, keep_keys [L, T, K] int64, step [1] int64,
                   true_ids [L, T, K] int64, recall: float, width: int) -> [L, T, width] int64

A prefetcher's prediction of stated recall for routes that carry no hidden state: true id j of
a row is kept when uniform(keep_keys[.., j], step) < recall; the prediction is the kept true ids
in their order, then the ids outside the row's true set with the largest
uniform(wrong_keys[.., e], step), largest first (the Triton kernel takes the lower id among
equal uniforms, the reference as torch.topk does). Needs width <= E - K, so that no dropped
true id is ever predicted.

    force_logits(logits [T, E], ids [T, K] int64) -> [T, E]

A new tensor of `logits`' values at each row's ids and FORCED_OFF elsewhere, so a softmax top-k
router picks exactly the forced experts and weighs them by its own logits.
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation

__all__ = ["BIG", "FORCED_OFF", "MASK32", "draw_routes", "force_logits", "gumbel", "hash32", "oracle_predict",
           "uniforms"]

BIG = 1e4  # a kept expert's bonus: above any Gumbel draw's spread
FORCED_OFF = -1e4  # a logit no softmax weight survives next to a router's (|logits| of a few units)
MASK32 = 0xFFFFFFFF


def hash32(x):
    """A 32-bit integer mix of int64 values (tensors or ints) in [0, 2^32); multipliers under
    2^31, so no product leaves int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, step: torch.Tensor | None = None) -> torch.Tensor:
    """float32 uniforms in (0, 1), one per key, mixed with a draw's `step` key."""
    x = keys if step is None else hash32((keys + step) & MASK32)
    return ((x >> 8).float() + 0.5) / float(1 << 24)


def gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u))


def draw_routes(fixed: torch.Tensor, gumbel_keys: torch.Tensor, keep_keys: torch.Tensor, step: torch.Tensor,
                routes: torch.Tensor, keep: float, *, impl: str | None = None) -> None:
    layers, rows, experts = fixed.shape
    if gumbel_keys.shape != fixed.shape or keep_keys.shape != routes.shape or routes.shape[:2] != (layers, rows):
        raise ValueError(f"draw_routes: fixed {tuple(fixed.shape)}, gumbel_keys {tuple(gumbel_keys.shape)}, "
                         f"keep_keys {tuple(keep_keys.shape)} and routes {tuple(routes.shape)} disagree")
    if not 0 < routes.shape[2] <= experts:
        raise ValueError(f"draw_routes: top-{routes.shape[2]} of {experts} experts")
    implementation("generated_routes", fixed, impl).draw_routes(fixed, gumbel_keys, keep_keys, step, routes, keep)


def oracle_predict(wrong_keys: torch.Tensor, keep_keys: torch.Tensor, step: torch.Tensor, true_ids: torch.Tensor,
                   recall: float, width: int, *, impl: str | None = None) -> torch.Tensor:
    experts, k = wrong_keys.shape[-1], true_ids.shape[-1]
    if wrong_keys.shape[:-1] != true_ids.shape[:-1] or keep_keys.shape != true_ids.shape or wrong_keys.dim() != 3:
        raise ValueError(f"oracle_predict: wrong_keys {tuple(wrong_keys.shape)}, keep_keys {tuple(keep_keys.shape)} "
                         f"and true_ids {tuple(true_ids.shape)} disagree (they are [L, T, E], [L, T, K], [L, T, K])")
    if not 0 < width <= experts - k:
        raise ValueError(f"oracle_predict: {width} predictions at top-{k} of {experts} experts")
    return implementation("generated_routes", true_ids, impl).oracle_predict(wrong_keys, keep_keys, step, true_ids,
                                                                             recall, width)


def force_logits(logits: torch.Tensor, ids: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    if logits.dim() != 2 or ids.dim() != 2 or ids.shape[0] != logits.shape[0]:
        raise ValueError(f"force_logits takes logits [T, E] and ids [T, K], got {tuple(logits.shape)} and "
                         f"{tuple(ids.shape)}")
    return implementation("generated_routes", logits, impl).force_logits(logits, ids)
