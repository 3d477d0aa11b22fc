"""The grouped MoE expert GEMM: out[T, H] = sum over k of topk_weights[:, k] * down(silu(gate(x)) *
up(x)) with the expert topk_ids[:, k], an index into dim 0 of the banks w13 [S, 2I, H] (gate rows
then up rows) and w2 [S, H, I].

The banks may be a layer's own experts, a slot pool shared by every layer, or pinned host memory
read in place (the Triton path over unified addressing). The tiles follow the routed layer's
expert count (`num_routed_experts`), not the bank's row count, so the same routes over a
layer's bank and over a slot pool holding the same rows give bit-identical output. A call's
ids name at most `num_routed_experts` distinct rows (one per expert of the layer), which
bounds the sorted path's grid however many rows the banks have. Full
contract: kernels/fused_moe/triton.py; the oracle: kernels/fused_moe/reference.py.

Block-quantized banks (FP8): w13 and w2 hold float8_e4m3fn values and come with float32
scales, one per `block_shape` (bn rows, bk columns) block of each expert matrix:
    w13_scale [S, 2 * ceil(I / bn), ceil(H / bk)]: the gate matrix's blocks, then the up
              matrix's (each half blocked on its own, as the checkpoint stores them),
    w2_scale  [S, ceil(H / bn), ceil(I / bk)],
and weight = fp8 value * scale (the checkpoints' `weight_scale_inv`). Int4 (W4A16) banks are
int32 words of eight 4-bit values along the input dimension (w13 [S, 2I, H/8], w2 [S, H, I/8];
value i of a word at bits 4i, stored + 8), block_shape (1, group): a scale per row and group.
MXFP4 banks (OCP microscaling, gpt-oss's expert format) are uint8 bytes of two FP4 E2M1 codes
along the input dimension, the low nibble first (w13 [S, 2I, H/2], w2 [S, H, I/2]; a code is a
sign bit, two exponent bits and one mantissa bit: `E2M1_VALUES`), block_shape (1, 32): a uint8
E8M0 scale per row and 32 values, weight = value * 2^(scale - 127).
The kernels dequantize as they read; the activations stay in hidden's dtype.

Expert biases (gpt-oss): w13_bias [S, 2I] (the gate rows' biases, then the up rows'), w2_bias
[S, H], added in float32 to each GEMM's accumulator before the activation and before the
route weight. `activation` says how a route's gate and up rows combine (`Activation`): silu(gate)
* up (every family but one), or gpt-oss's clamped SwiGLU.
"""
from dataclasses import dataclass

import torch

from moeferry.kernels import implementation

__all__ = ["BLOCK_ASSIGNMENTS", "E2M1_VALUES", "E8M0_BIAS", "MXFP4_BLOCK", "SILU", "Activation", "check_options",
           "clamped_swiglu", "fused_moe"]

# How routes are assigned to GEMM blocks (the Triton kernel's choice; the reference always
# groups by expert, whatever it is told): "naive" gives each (token, expert) route its own
# block, "sorted" groups the routes of each expert so it is read once per call.
BLOCK_ASSIGNMENTS = ("auto", "sorted", "naive")

# FP4 E2M1 code -> value (code bit 3 the sign), as transformers' FP4_VALUES; MXFP4's block of
# values sharing one E8M0 scale, and that scale's exponent bias.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32
E8M0_BIAS = 127


@dataclass(frozen=True)
class Activation:
    """How a route's gate and up rows combine into the down GEMM's input.

    "silu": silu(gate) * up. "clamped_swiglu" (gpt-oss): gate = min(gate, limit), up =
    clamp(up, -limit, limit), then (up + 1) * gate * sigmoid(alpha * gate)."""

    name: str = "silu"
    alpha: float = 1.0
    limit: float = 0.0

    def __post_init__(self):
        if self.name not in ("silu", "clamped_swiglu"):
            raise ValueError(f"activation {self.name!r} is not silu or clamped_swiglu")


SILU = Activation()


def clamped_swiglu(alpha: float, limit: float) -> Activation:
    return Activation("clamped_swiglu", float(alpha), float(limit))


def check_options(block_assignment: str, out, sum_routes: bool, scales=(None, None), block_shape=None,
                  biases=(None, None)) -> None:
    """The checks every implementation makes of fused_moe's keyword arguments."""
    if (biases[0] is None) != (biases[1] is None):
        raise ValueError("w13_bias and w2_bias come together or not at all")
    if (scales[0] is None) != (scales[1] is None) or (scales[0] is None) != (block_shape is None):
        raise ValueError("w13_scale, w2_scale and block_shape come together (block-quantized banks) or not at all")
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
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: Activation = SILU,
    impl: str | None = None,
) -> torch.Tensor:
    """[T, H] (see the module). Triton runs when hidden is on CUDA (the weights may be pinned
    host memory). block_assignment applies to the Triton path. sum_routes=False: the weighted
    route outputs [T, K, H] instead of their sum (hidden's dtype on the Triton path, float32 on
    the reference's), for norm_rope.fused_add_rms_norm to sum with the residual add.
    w13_scale, w2_scale, block_shape: the scales of block-quantized banks; w13_bias, w2_bias:
    per-expert biases; activation: how gate and up combine (see the module)."""
    return implementation("fused_moe", hidden, impl).fused_moe(
        hidden, w13, w2, topk_weights, topk_ids, num_routed_experts=num_routed_experts,
        block_assignment=block_assignment, out=out, sum_routes=sum_routes,
        w13_scale=w13_scale, w2_scale=w2_scale, block_shape=block_shape,
        w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)
