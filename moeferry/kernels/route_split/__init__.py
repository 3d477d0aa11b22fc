"""Which routes of a MoE layer the host channel computes (the `hybrid` strategy,
moe/split_policy.py): decided on the device, inside the decode graph, with no host sync.

    split_routes(topk_ids [T, K] int, slot_of_layer [E] int32, split float32 [2], rotation int64 [1],
                 tally=None, weights=None) -> (host_ids, device_ids, host_count, device_weights)

`split` holds (host_share, host_offset) on the device, read by the kernel when it runs, so
a captured graph follows a new split written between replays. Of the distinct experts the
routes name that are not resident (slot_of_layer[e] < 0), the host takes the first n =
max(0, floor(misses * host_share - host_offset + 0.5)) in expert order starting at expert
`rotation[0]`, and every route to one of them. `host_ids` is `topk_ids`
with -1 where the device computes the route, `device_ids` the reverse (same dtype and shape),
so each route is computed by exactly one channel and a resident expert always by the device;
a route outside [0, E) (-1: another rank's under --tensor-parallel-size) is counted nowhere and
stays -1 in both.
With `weights` (the routes' [T, K] floating weights), `device_weights` is them with zeros at
the host's routes, for the device's experts to run over every route (None without).
`host_count` (int64 [1]) is n's realised value (the distinct experts the host takes). Then
rotation[0] = (rotation[0] + 1) % E, so no expert is always the host's, and `tally[0] +=
host_count` when a tally (int64 [1], e.g. one layer's entry of a per-layer counter) is given.

The count is computed in float32 (misses * share, less the offset, plus one half, floored), so
every implementation rounds the same way save where a fused multiply-add lands an exact half
differently; either way every route still goes to one channel.
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation

__all__ = ["split_routes", "split_values"]


def split_values(host_share: float, host_offset: float = 0.0, device=None) -> torch.Tensor:
    """The `split` tensor of (host_share, host_offset)."""
    return torch.tensor([host_share, host_offset], dtype=torch.float32, device=device)


def split_routes(topk_ids: torch.Tensor, slot_of_layer: torch.Tensor, split: torch.Tensor, rotation: torch.Tensor,
                 tally: torch.Tensor | None = None, weights: torch.Tensor | None = None, *,
                 impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if topk_ids.dim() != 2 or slot_of_layer.dim() != 1:
        raise ValueError(f"split_routes takes topk_ids [T, K] and slot_of_layer [E], got "
                         f"{tuple(topk_ids.shape)} and {tuple(slot_of_layer.shape)}")
    if split.dtype != torch.float32 or split.shape != (2,):
        raise ValueError(f"split_routes takes split as float32 [2] (share, offset), got {split.dtype} "
                         f"{tuple(split.shape)}")
    if weights is not None and (weights.shape != topk_ids.shape or not weights.dtype.is_floating_point):
        raise ValueError(f"split_routes takes weights of topk_ids' shape {tuple(topk_ids.shape)}, floating, got "
                         f"{weights.dtype} {tuple(weights.shape)}")
    return implementation("route_split", topk_ids, impl).split_routes(topk_ids, slot_of_layer, split, rotation, tally,
                                                                      weights)
