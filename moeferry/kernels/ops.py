"""Dispatchers for the kernels: the Triton kernel for CUDA tensors, the plain-torch
reference otherwise. use_triton=True forces Triton (on CPU tensors that needs
TRITON_INTERPRET=1, set before triton is imported); use_triton=False forces the reference.
Triton modules are imported lazily so CPU-only callers never pay for them."""
import torch

from moeferry.kernels import implementation

__all__ = ["fused_moe", "moe_align_block_size"]


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, *, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group routes by expert into blocks: (sorted_route_ids [P], block_expert [P // block_size],
    num_routes_post_padded [1]), all int32. See moeferry.kernels.triton.moe_align."""
    return implementation("moe_align", use_triton, topk_ids).moe_align_block_size(topk_ids, block_size, num_experts)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_routed_experts: int,
    block_assignment: str = "auto",
    out: torch.Tensor | None = None,
    sum_routes: bool = True,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """out[T, H] = sum over k of topk_weights[:, k] * down(silu(gate(x)) * up(x)) with the
    expert topk_ids[:, k], an index into dim 0 of w13 [S, 2I, H] and w2 [S, H, I].

    Triton runs when hidden is on CUDA (the weights may be pinned host memory, read in
    place). block_assignment applies to the Triton path; the reference always groups.
    sum_routes=False: the weighted route outputs [T, K, H] instead of their sum (hidden's
    dtype on the Triton path, float32 on the reference's), for norm_rope.fused_add_rms_norm
    to sum with the residual add. See moeferry.kernels.triton.fused_moe for the full contract."""
    return implementation("fused_moe", use_triton, hidden).fused_moe(
        hidden, w13, w2, topk_weights, topk_ids, num_routed_experts=num_routed_experts,
        block_assignment=block_assignment, out=out, sum_routes=sum_routes)
