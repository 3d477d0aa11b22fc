"""The host channel's route split in plain torch: the oracle of kernels/route_split/triton.py
(the contract: kernels/route_split/__init__.py). Device ops only, so it also runs in a graph."""
from __future__ import annotations

import torch


def split_routes(topk_ids, slot_of_layer, split, rotation, tally, weights):
    num_experts = slot_of_layer.shape[0]
    valid = (topk_ids >= 0) & (topk_ids < num_experts)  # others (-1: another rank's) go to neither channel
    ids = torch.where(valid, topk_ids, torch.zeros_like(topk_ids)).long()
    missing_route = ((slot_of_layer[ids] < 0) & valid).to(torch.int32).reshape(-1)
    missed = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    missed.index_add_(0, ids.reshape(-1), missing_route)
    missed = (missed > 0).to(torch.int32)
    order = (torch.arange(num_experts, device=ids.device) + rotation) % num_experts  # position -> expert
    rank_in_order = torch.cumsum(missed[order], 0)
    rank = torch.empty_like(rank_in_order).scatter_(0, order, rank_in_order)  # expert -> its rank among misses
    count = (missed.sum().to(torch.float32) * split[0] - split[1] + 0.5).floor().clamp(min=0).to(rank.dtype)
    host_expert = (missed > 0) & (rank <= count)
    rotation.add_(1).remainder_(num_experts)
    host_count = host_expert.sum(dtype=torch.int64).reshape(1)
    if tally is not None:
        tally += host_count
    host_route = host_expert[ids] & valid
    minus_one = torch.full_like(topk_ids, -1)
    device_weights = None if weights is None else weights.masked_fill(host_route, 0.0)
    return (torch.where(host_route, topk_ids, minus_one), torch.where(host_route, minus_one, topk_ids), host_count,
            device_weights)
