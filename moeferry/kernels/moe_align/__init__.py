"""moe_align_block_size: group a call's routes by expert into GEMM blocks.

Routes are the flat indices r = t * K + k of topk_ids[T, K]. They are grouped by expert id in
ascending order, each group padded to a multiple of block_size with the sentinel T * K, routes
ascending within a group; block b of the result belongs to block_expert[b] (-1 past the last
group). The result has a fixed length P that depends on (T * K, num_experts, block_size) only
(`padded_route_capacity`), so a kernel grid sized from it is the same every step (CUDA-graph
capturable). Full contract: kernels/moe_align/reference.py (the oracle).
"""
import torch

from moeferry.kernels import implementation

__all__ = ["moe_align_block_size", "padded_route_capacity"]


def padded_route_capacity(num_routes: int, num_experts: int, block_size: int, max_groups: int | None = None) -> int:
    """Upper bound P on the padded route count: every route, plus at most block_size - 1
    padding slots for each expert that can appear (at most min(num_experts, num_routes), and
    at most `max_groups` when the caller knows the ids name no more distinct experts: a
    routed layer's E experts mapped one to one onto the rows of a larger slot pool), rounded
    up to whole blocks."""
    groups = min(num_experts, num_routes, num_experts if max_groups is None else max_groups)
    bound = num_routes + groups * (block_size - 1)
    return -(-bound // block_size) * block_size


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, max_groups: int | None = None, *,
    impl: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_route_ids [P], block_expert [P // block_size], num_routes_post_padded [1]), all
    int32, on topk_ids' device. `max_groups`: the most distinct ids topk_ids may hold (it
    bounds P; None: num_experts). The reference refuses ids over that bound; the Triton kernel
    never writes past P, but its result is then wrong."""
    return implementation("moe_align", topk_ids, impl).moe_align_block_size(topk_ids, block_size, num_experts,
                                                                             max_groups)
