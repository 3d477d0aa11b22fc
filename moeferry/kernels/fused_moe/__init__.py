"""The grouped MoE expert GEMM: out[T, H] = sum over k of topk_weights[:, k] * down(silu(gate(x)) *
up(x)) with the expert topk_ids[:, k], an index into dim 0 of the banks w13 [S, 2I, H] (gate rows
then up rows) and w2 [S, H, I].

The banks may be a layer's own experts, a slot pool shared by every layer, or pinned host memory
read in place (the Triton path over unified addressing). The tiles follow the routed layer's
expert count (`num_routed_experts`), not the bank's row count, so the same routes over a
layer's bank and over a slot pool holding the same rows give bit-identical output. Full
contract: kernels/fused_moe/triton.py; the oracle: kernels/fused_moe/reference.py.
"""
import torch

from moeferry.kernels import implementation

__all__ = ["BLOCK_ASSIGNMENTS", "check_options", "fused_moe"]

# How routes are assigned to GEMM blocks (the Triton kernel's choice; the reference always
# groups by expert, whatever it is told): "naive" gives each (token, expert) route its own
# block, "sorted" groups the routes of each expert so it is read once per call.
BLOCK_ASSIGNMENTS = ("auto", "sorted", "naive")


def check_options(block_assignment: str, out, sum_routes: bool) -> None:
    """The checks every implementation makes of fused_moe's keyword arguments."""
    if block_assignment not in BLOCK_ASSIGNMENTS:
        raise ValueError(f"block_assignment {block_assignment!r} not in {BLOCK_ASSIGNMENTS}")
    if not sum_routes and out is not None:
        raise ValueError("out is the summed [T, H] output: not with sum_routes=False")


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
    impl: str | None = None,
) -> torch.Tensor:
    """[T, H] (see the module). Triton runs when hidden is on CUDA (the weights may be pinned
    host memory). block_assignment applies to the Triton path. sum_routes=False: the weighted
    route outputs [T, K, H] instead of their sum (hidden's dtype on the Triton path, float32 on
    the reference's), for norm_rope.fused_add_rms_norm to sum with the residual add."""
    return implementation("fused_moe", hidden, impl).fused_moe(
        hidden, w13, w2, topk_weights, topk_ids, num_routed_experts=num_routed_experts,
        block_assignment=block_assignment, out=out, sum_routes=sum_routes)
