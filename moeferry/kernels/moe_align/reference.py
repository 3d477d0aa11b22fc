"""moe_align_block_size in plain torch: the oracle for the Triton kernel and the CPU path
(the contract: kernels/moe_align/__init__.py)."""
import torch

from moeferry.kernels.moe_align import padded_route_capacity

__all__ = ["moe_align_block_size"]


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, max_groups: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the routes of topk_ids[T, K] (int32|int64, each id in [0, num_experts)) by expert.

    Returns (sorted_route_ids int32 [P], block_expert int32 [P // block_size],
    num_routes_post_padded int32 [1]), on topk_ids' device. Entries of sorted_route_ids past
    num_routes_post_padded, and padding inside a group, hold the sentinel T * K.
    """
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    num_routes = flat_ids.numel()
    capacity = padded_route_capacity(num_routes, num_experts, block_size, max_groups)
    sorted_route_ids = torch.full((capacity,), num_routes, dtype=torch.int32, device=device)
    block_expert = torch.full((capacity // block_size,), -1, dtype=torch.int32, device=device)
    if num_routes == 0:
        return sorted_route_ids, block_expert, torch.zeros(1, dtype=torch.int32, device=device)

    # A stable sort keeps routes ascending within each expert's group.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat_ids, torch.ones_like(flat_ids))
    if max_groups is not None and int((counts > 0).sum()) > max_groups:
        raise ValueError(f"topk_ids name {int((counts > 0).sum())} distinct ids, more than max_groups={max_groups}")
    padded_counts = (counts + block_size - 1) // block_size * block_size
    padded_starts = torch.cumsum(padded_counts, 0) - padded_counts
    sorted_starts = torch.cumsum(counts, 0) - counts

    ids_in_order = flat_ids[order]
    rank_in_group = torch.arange(num_routes, device=device) - sorted_starts[ids_in_order]
    positions = padded_starts[ids_in_order] + rank_in_group
    sorted_route_ids[positions] = order.to(torch.int32)

    blocks_per_expert = padded_counts // block_size
    experts = torch.arange(num_experts, dtype=torch.int32, device=device)
    owners = torch.repeat_interleave(experts, blocks_per_expert)
    block_expert[: owners.numel()] = owners
    total = padded_counts.sum().to(torch.int32).reshape(1)
    return sorted_route_ids, block_expert, total
