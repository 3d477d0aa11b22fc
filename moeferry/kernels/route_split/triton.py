"""The host channel's route split as one single-program Triton kernel (the contract:
kernels/route_split/__init__.py). A decode layer's split is one launch instead of a dozen
small torch ops on the critical path before the host can start.

The program marks the routed experts in a scratch row of E flags (routes scattered into
it), reduces the misses over the experts in registers (a cumulative sum gives each missed
expert its rank from the rotation on), writes the host's experts back into the flags and
gathers them per route. The barriers order the writes and reads of the flags and of the
rotation within the program (one CTA: a thread may not see another's write without one)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.kernels.triton_common import pdl_launch, wait_for_previous_kernel

BLOCK_ROUTES = 256


@triton.jit
def _split_routes_kernel(ids_ptr, slot_ptr, host_ids_ptr, device_ids_ptr, count_ptr, rotation_ptr, tally_ptr,
                         flags_ptr, split_ptr, weights_ptr, device_weights_ptr, num_routes, num_experts,
                         BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, HAS_TALLY: tl.constexpr,
                         HAS_WEIGHTS: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    e = tl.arange(0, BLOCK_E)
    is_expert = e < num_experts
    tl.store(flags_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=is_expert)
    tl.debug_barrier()
    for start in range(0, num_routes, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        ids = tl.load(ids_ptr + r, mask=r < num_routes, other=-1)
        valid = (r < num_routes) & (ids >= 0) & (ids < num_experts)
        tl.store(flags_ptr + ids, tl.full([BLOCK_R], 1, tl.int32), mask=valid)
    tl.debug_barrier()
    routed = tl.load(flags_ptr + e, mask=is_expert, other=0)
    slot = tl.load(slot_ptr + e, mask=is_expert, other=0)
    missed = ((routed > 0) & (slot < 0)).to(tl.int32)
    rotation = tl.load(rotation_ptr)
    misses = tl.sum(missed, axis=0)
    before_rotation = tl.sum(tl.where(e < rotation, missed, 0), axis=0)
    cumulative = tl.cumsum(missed, axis=0)
    rank = tl.where(e >= rotation, cumulative - before_rotation, cumulative + misses - before_rotation)
    host_share, host_offset = tl.load(split_ptr), tl.load(split_ptr + 1)
    count = tl.maximum(tl.floor(misses.to(tl.float32) * host_share - host_offset + 0.5), 0.0).to(tl.int32)
    host_expert = (missed > 0) & (rank <= count)
    host_count = tl.sum(host_expert.to(tl.int64), axis=0)
    tl.debug_barrier()  # every thread has read the rotation and the flags before either is rewritten
    tl.store(count_ptr, host_count)
    tl.store(rotation_ptr, (rotation + 1) % num_experts)
    if HAS_TALLY:
        tl.store(tally_ptr, tl.load(tally_ptr) + host_count)
    tl.store(flags_ptr + e, host_expert.to(tl.int32), mask=is_expert)
    tl.debug_barrier()
    for start in range(0, num_routes, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        in_range = r < num_routes
        ids = tl.load(ids_ptr + r, mask=in_range, other=-1)
        valid = in_range & (ids >= 0) & (ids < num_experts)
        on_host = tl.load(flags_ptr + ids, mask=valid, other=0) > 0
        tl.store(host_ids_ptr + r, tl.where(on_host, ids, -1), mask=in_range)
        tl.store(device_ids_ptr + r, tl.where(on_host, -1, ids), mask=in_range)
        if HAS_WEIGHTS:
            weights = tl.load(weights_ptr + r, mask=in_range, other=0.0)
            tl.store(device_weights_ptr + r, tl.where(on_host, tl.zeros_like(weights), weights), mask=in_range)


def split_routes(topk_ids, slot_of_layer, split, rotation, tally, weights):
    ids = topk_ids.contiguous()
    weights = None if weights is None else weights.contiguous()
    device_weights = None if weights is None else torch.empty_like(weights)
    num_experts = slot_of_layer.shape[0]
    host_ids, device_ids = torch.empty_like(ids), torch.empty_like(ids)
    host_count = torch.empty(1, dtype=torch.int64, device=ids.device)
    flags = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    _split_routes_kernel[(1,)](ids, slot_of_layer.contiguous(), host_ids, device_ids, host_count, rotation,
                               host_count if tally is None else tally, flags, split,
                               split if weights is None else weights, split if weights is None else device_weights,
                               ids.numel(), num_experts, BLOCK_E=triton.next_power_of_2(num_experts),
                               BLOCK_R=BLOCK_ROUTES, HAS_TALLY=tally is not None, HAS_WEIGHTS=weights is not None,
                               num_warps=4, **pdl_launch(ids.device))
    return host_ids, device_ids, host_count, device_weights
