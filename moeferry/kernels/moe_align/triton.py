"""moe_align_block_size in Triton: routes grouped by expert, each group padded to whole blocks.

Contract (same as moeferry.kernels.moe_align.reference, which is the oracle):
    topk_ids          [T, K] int32|int64, each id in [0, num_experts); read only.
    sorted_route_ids  [P] int32 (written): route r = t * K + k, grouped by ascending expert,
                      ascending r within a group, each group padded to a multiple of
                      block_size with the sentinel T * K; the tail past the last group too.
    block_expert      [P // block_size] int32 (written): expert of block b, -1 past the end.
    num_routes_post_padded [1] int32 (written): sum of the padded group sizes.
    P = padded_route_capacity(T * K, num_experts, block_size).

No limit on num_experts (ids may be slot ids of a cache of 32,768 slots or more): nothing is
counted in one block of threads. Every grid and buffer size follows from (T, K, num_experts,
block_size) alone and nothing is read back to the host, so a call is CUDA-graph capturable.
The result is deterministic: counts use integer atomics (order-free), positions do not.

How, for N = T * K routes cut into chunks of ROUTE_CHUNK routes (C chunks):
    0. _init_kernel           (all)     the sentinel, -1 and zero fills of the outputs and
                                        chunk_counts, in one launch
    1. _count_chunk_kernel    (routes)  chunk_counts[c, e] = routes of expert e in chunk c
    2. _chunk_prefix_kernel   (experts) chunk_counts[c, e] -> routes of e in chunks < c;
                                        expert_counts[e] = routes of e; padded total of
                                        each BLOCK_E experts
    3. _expert_start_kernel   (experts) expert_start[e] = padded sizes of experts < e
                                        (earlier blocks' totals + a scan in the block)
    4. _place_routes_kernel   (routes)  position of r = expert_start[e] + chunk prefix
                                        + routes of e earlier in r's chunk (pairwise within
                                        the chunk, so O(N * ROUTE_CHUNK) comparisons)
Scratch is C * num_experts int32 (8 MiB at 65,536 routes over 32,768 slots); the O(E)
passes run over many programs, BLOCK_E experts each.
"""
import torch
import triton
import triton.language as tl

from moeferry.kernels.moe_align import padded_route_capacity
from moeferry.kernels.triton_common import pdl_launch, wait_for_previous_kernel

__all__ = ["moe_align_block_size"]

ROUTE_BLOCK = 64  # routes per program; _place_routes_kernel compares [64, 64] tiles
ROUTE_CHUNK = 1024  # a multiple of ROUTE_BLOCK: one route block never spans two chunks
EXPERT_BLOCK = 1024
INIT_BLOCK = 1024


@triton.jit
def _init_kernel(sorted_route_ptr, block_expert_ptr, chunk_counts_ptr, capacity, num_blocks,
                 num_counts, sentinel, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """sorted_route_ids[:] = sentinel, block_expert[:] = -1, chunk_counts[:] = 0 (one launch)."""
    wait_for_previous_kernel(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(sorted_route_ptr + offs, tl.full([BLOCK], 0, tl.int32) + sentinel, mask=offs < capacity)
    tl.store(block_expert_ptr + offs, tl.full([BLOCK], -1, tl.int32), mask=offs < num_blocks)
    tl.store(chunk_counts_ptr + offs, tl.zeros([BLOCK], tl.int32), mask=offs < num_counts)


@triton.jit
def _count_chunk_kernel(ids_ptr, chunk_counts_ptr, num_routes, num_experts,
                        ROUTE_CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    first = tl.program_id(0) * BLOCK_R
    routes = first + tl.arange(0, BLOCK_R)
    valid = routes < num_routes
    experts = tl.load(ids_ptr + routes, mask=valid, other=0).to(tl.int64)
    chunk = first // ROUTE_CHUNK
    tl.atomic_add(chunk_counts_ptr + chunk * num_experts + experts, 1, mask=valid)


@triton.jit
def _padded(counts, block_size):
    return (counts + block_size - 1) // block_size * block_size


@triton.jit
def _chunk_prefix_kernel(chunk_counts_ptr, expert_counts_ptr, block_padded_ptr, num_experts,
                         num_chunks, block_size, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    running = tl.zeros([BLOCK_E], dtype=tl.int32)
    for chunk in range(num_chunks):
        ptrs = chunk_counts_ptr + chunk * num_experts + experts
        count = tl.load(ptrs, mask=valid, other=0)
        tl.store(ptrs, running, mask=valid)
        running += count
    tl.store(expert_counts_ptr + experts, running, mask=valid)
    tl.store(block_padded_ptr + tl.program_id(0), tl.sum(_padded(running, block_size), axis=0))


@triton.jit
def _expert_start_kernel(expert_counts_ptr, block_padded_ptr, expert_start_ptr,
                         num_post_padded_ptr, num_experts, block_size,
                         BLOCK_E: tl.constexpr, MAX_EXPERT_BLOCKS: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    blocks = tl.arange(0, MAX_EXPERT_BLOCKS)
    earlier = tl.load(block_padded_ptr + blocks, mask=blocks < pid, other=0)
    base = tl.sum(earlier, axis=0)
    experts = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    padded = _padded(tl.load(expert_counts_ptr + experts, mask=valid, other=0), block_size)
    inclusive = tl.cumsum(padded, axis=0)
    tl.store(expert_start_ptr + experts, base + inclusive - padded, mask=valid)
    if pid == tl.num_programs(0) - 1:
        tl.store(num_post_padded_ptr, base + tl.sum(padded, axis=0))


@triton.jit
def _place_routes_kernel(ids_ptr, chunk_counts_ptr, expert_start_ptr, sorted_route_ptr,
                         block_expert_ptr, num_routes, num_experts, block_size, capacity,
                         ROUTE_CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    first = tl.program_id(0) * BLOCK_R
    routes = first + tl.arange(0, BLOCK_R)
    valid = routes < num_routes
    experts = tl.load(ids_ptr + routes, mask=valid, other=-1).to(tl.int32)
    chunk = first // ROUTE_CHUNK
    rank = tl.zeros([BLOCK_R], dtype=tl.int32)
    for other_first in range(chunk * ROUTE_CHUNK, first + BLOCK_R, BLOCK_R):
        others = other_first + tl.arange(0, BLOCK_R)
        other_experts = tl.load(ids_ptr + others, mask=others < num_routes, other=-1)
        same = (experts[:, None] == other_experts.to(tl.int32)[None, :]) & \
            (others[None, :] < routes[:, None])
        rank += tl.sum(same.to(tl.int32), axis=1)
    safe_experts = tl.where(valid, experts, 0).to(tl.int64)
    earlier_chunks = tl.load(chunk_counts_ptr + chunk * num_experts + safe_experts,
                             mask=valid, other=0)
    start = tl.load(expert_start_ptr + safe_experts, mask=valid, other=0)
    position = start + earlier_chunks + rank
    inside = valid & (position < capacity)  # only ids past the caller's max_groups reach beyond
    tl.store(sorted_route_ptr + position, routes.to(tl.int32), mask=inside)
    # Every block of a group holds at least one route (padding < block_size sits at the
    # end), so the routes alone name every block's expert; equal writes to one block agree.
    tl.store(block_expert_ptr + position // block_size, experts, mask=inside)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, max_groups: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton moe_align_block_size; see the module docstring for the contract."""
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1)
    if not flat_ids.is_contiguous():
        flat_ids = flat_ids.contiguous()
    num_routes = flat_ids.numel()
    capacity = padded_route_capacity(num_routes, num_experts, block_size, max_groups)
    if num_routes == 0:
        return (torch.full((capacity,), num_routes, dtype=torch.int32, device=device),
                torch.full((capacity // block_size,), -1, dtype=torch.int32, device=device),
                torch.zeros(1, dtype=torch.int32, device=device))
    sorted_route_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_size, dtype=torch.int32, device=device)
    num_post_padded = torch.empty(1, dtype=torch.int32, device=device)  # written by _expert_start
    num_chunks = triton.cdiv(num_routes, ROUTE_CHUNK)
    chunk_counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=device)
    expert_blocks = triton.cdiv(num_experts, EXPERT_BLOCK)
    expert_counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    block_padded = torch.empty(expert_blocks, dtype=torch.int32, device=device)
    expert_start = torch.empty(num_experts, dtype=torch.int32, device=device)

    init_size = max(capacity, chunk_counts.numel())
    pdl = pdl_launch(device)
    _init_kernel[(triton.cdiv(init_size, INIT_BLOCK),)](
        sorted_route_ids, block_expert, chunk_counts, capacity, block_expert.numel(),
        chunk_counts.numel(), num_routes, BLOCK=INIT_BLOCK, **pdl)
    route_grid = (triton.cdiv(num_routes, ROUTE_BLOCK),)
    _count_chunk_kernel[route_grid](flat_ids, chunk_counts, num_routes, num_experts,
                                    ROUTE_CHUNK=ROUTE_CHUNK, BLOCK_R=ROUTE_BLOCK, **pdl)
    _chunk_prefix_kernel[(expert_blocks,)](chunk_counts, expert_counts, block_padded,
                                           num_experts, num_chunks, block_size,
                                           BLOCK_E=EXPERT_BLOCK, **pdl)
    _expert_start_kernel[(expert_blocks,)](expert_counts, block_padded, expert_start,
                                           num_post_padded, num_experts, block_size,
                                           BLOCK_E=EXPERT_BLOCK,
                                           MAX_EXPERT_BLOCKS=max(2, triton.next_power_of_2(
                                               expert_blocks)),
                                           **pdl)
    _place_routes_kernel[route_grid](flat_ids, chunk_counts, expert_start, sorted_route_ids,
                                     block_expert, num_routes, num_experts, block_size, capacity,
                                     ROUTE_CHUNK=ROUTE_CHUNK, BLOCK_R=ROUTE_BLOCK, **pdl)
    return sorted_route_ids, block_expert, num_post_padded
