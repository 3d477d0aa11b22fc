"""Grouped MoE expert GEMM in plain torch: the oracle for the Triton kernel and the CPU path.

    hidden        [T, H] float dtype; read only.
    w13           [S, 2I, H] rows [0:I] gate, [I:2I] up (a fused gate+up bank); read only.
    w2            [S, H, I]; read only.
    topk_weights  [T, K] float32; topk_ids [T, K] int, each in [0, S).
    out           [T, H] dtype of hidden (written whole; may be given, must not alias inputs).

out[t] = sum over k = 0..K-1 of topk_weights[t, k] * down(silu(gate(x)) * up(x)) with
x = hidden[t] and the expert topk_ids[t, k]. Routes are grouped by id: each distinct id's
rows are computed with one matmul per bank, in float32, then the K route results of a
token are summed in order k = 0..K-1 and cast once. A group's rows and their order depend
on the routes only, not on which index an expert sits at, so the same routes over a
layer's bank and over a slot pool holding the same rows give bit-identical output. A route of
weight 0 joins no group (its output is 0): the routes a strategy masks for another channel
(weight 0, id clamped) never change the rows of a group, so each expert's rows, and their
float32 bits, are those of the unsplit call (a matmul's rows may round differently with the
number of rows).

Block-quantized banks (w13_scale, w2_scale, block_shape: kernels/fused_moe/__init__.py): each
group's expert matrices are first dequantized to float32 (`dequantize_blocks`; int4 words
unpacked by `unpack_int4`, MXFP4 bytes by `unpack_mxfp4` with their E8M0 scales as powers of two,
`e8m0_to_float`: exact, as transformers' convert_moe_packed_tensors), then the same arithmetic runs.

Biases (w13_bias [S, 2I], w2_bias [S, H]) join each GEMM in float32; `activation` is silu(gate)
* up or gpt-oss's clamped SwiGLU (kernels/fused_moe/__init__.py: Activation).

`int8_expert_routes` is the oracle of the host kernel's int8 path (int4 and MXFP4 banks against
activations quantized to int8 per group, kernels/fused_moe/host_experts.cpp): the same integer
group sums and the same float32 operations in the same order, so equal to the kernel's route
outputs up to the activation function's last bit.
"""
import torch
import torch.nn.functional as F

from moeferry.kernels.fused_moe import SILU, Activation, check_options
from moeferry.kernels.fused_moe.common import (dequantize_blocks, dequantize_w13, e8m0_to_float,  # noqa: F401
                                               sum_route_partials, unpack_int4, unpack_mxfp4)

__all__ = ["fused_moe", "int8_expert_routes", "quantize_int8_groups"]


def _route_groups(flat_ids: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """The `live` routes sorted by id (stable: ascending within a group), the distinct ids, and
    the group sizes. Reads the group sizes back to the host: this is the CPU path."""
    routes = torch.nonzero(live).squeeze(1)
    order = routes[torch.argsort(flat_ids[routes], stable=True)]
    distinct, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    return order, distinct.tolist(), counts.tolist()


def activate(gate: torch.Tensor, up: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The down GEMM's input from a route's gate and up rows (float32)."""
    if activation.name == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(-activation.limit, activation.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))


def _expert_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13=None, b2=None,
                 activation: Activation = SILU) -> torch.Tensor:
    """down(act(gate(x), up(x))) for rows x [n, H] float32 of one expert, in float32."""
    gate_up = F.linear(x, w13.float(), None if b13 is None else b13.float())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(activate(gate, up, activation), w2.float(), None if b2 is None else b2.float())


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, *, num_routed_experts=None, block_assignment="auto",
              out=None, sum_routes=True, w13_scale=None, w2_scale=None, block_shape=None, w13_bias=None,
              w2_bias=None, activation: Activation = SILU) -> torch.Tensor:
    """Reference fused MoE, the same signature as the Triton kernel's; num_routed_experts and
    block_assignment (validated) do not change its arithmetic: it has no tiles to size.
    sum_routes=False returns the weighted route outputs [T, K, H] in float32 instead, which
    ``sum_route_partials`` and a rounding to hidden's dtype turn into the [T, H] result."""
    check_options(block_assignment, out, sum_routes, (w13_scale, w2_scale), block_shape, (w13_bias, w2_bias))
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    if out is None and sum_routes:
        out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out if sum_routes else hidden.new_zeros(0, top_k, hidden_size, dtype=torch.float32)
    flat_ids = topk_ids.reshape(-1)
    route_weights = topk_weights.reshape(-1, 1).float()
    route_out = torch.zeros(num_tokens * top_k, hidden_size, dtype=torch.float32,
                            device=hidden.device)
    order, distinct, counts = _route_groups(flat_ids, route_weights.reshape(-1) != 0)
    start = 0
    for expert, count in zip(distinct, counts):
        routes = order[start:start + count]
        start += count
        x = hidden[routes // top_k].float()
        gate_up, down = w13[expert], w2[expert]
        if block_shape is not None:
            gate_up = dequantize_w13(gate_up, w13_scale[expert], block_shape, hidden_size)
            down = dequantize_blocks(down, w2_scale[expert], block_shape, w13.shape[1] // 2)
        biases = (None, None) if w13_bias is None else (w13_bias[expert], w2_bias[expert])
        route_out[routes] = _expert_rows(x, gate_up, down, *biases, activation) * route_weights[routes]
    per_token = route_out.view(num_tokens, top_k, hidden_size)
    if not sum_routes:
        return per_token
    out.copy_(sum_route_partials(per_token))
    return out


def quantize_int8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values q [N, C] (as int32) and float32 scales d [N, ceil(C / group)] of rows x [N, C],
    per group of `group` values: d = max |x| / 127, q = x / d rounded half to even (0 where d = 0)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    blocks = F.pad(x.float(), (0, groups * group - cols)).view(rows, groups, group)
    scale = blocks.abs().amax(-1) / 127
    q = torch.where(scale[..., None] > 0, torch.round(blocks / scale[..., None]), 0.0).clamp(-127, 127)
    return q.view(rows, -1)[:, :cols].to(torch.int32), scale


def int8_weights(weight: torch.Tensor, scales: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix's integer values v [R, cols] (int32) and float32 group scales s [R, groups] of the
    int8 path, weight = v * s: int4 v = the stored value, s its scale; MXFP4 v = 2 * E2M1 value (an
    integer in [-12, 12]), s = half the E8M0 scale (exact)."""
    if weight.dtype == torch.int32:
        return unpack_int4(weight, cols), scales.float()
    if weight.dtype == torch.uint8:
        return (unpack_mxfp4(weight, cols) * 2).to(torch.int32), e8m0_to_float(scales) * 0.5
    raise ValueError(f"the int8 path reads int4 (int32) and mxfp4 (uint8) banks, not {weight.dtype}")


def int8_dots(q: torch.Tensor, q_scale: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
              group: int) -> torch.Tensor:
    """float32 [N, R]: rows q [N, C] (int8 values, scales [N, G]) against weight rows values
    [R, C] (scales [R, G]): each group's integer sum s_g = sum of v q (exact), then in group order
    acc = acc + float(s_g) * (weight scale * q scale), float32 operations rounded one by one."""
    (rows, cols), groups = q.shape, q_scale.shape[1]
    pad = groups * group - cols
    # float64 products and sums of integers below 2^53: exact, whatever order the matmul takes.
    sums = torch.einsum("ngk,rgk->nrg", F.pad(q, (0, pad)).double().view(rows, groups, group),
                        F.pad(values, (0, pad)).double().view(-1, groups, group)).float()
    terms = sums * (scales[None] * q_scale[:, None])
    acc = torch.zeros(rows, values.shape[0], dtype=torch.float32, device=q.device)
    for g in range(groups):
        acc = acc + terms[:, :, g]
    return acc


def int8_expert_routes(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape, w13_bias=None,
                       w2_bias=None, activation: Activation = SILU) -> torch.Tensor:
    """The weighted route outputs [T, K, H] bf16 of the host kernel's int8 path over int4 or
    MXFP4 banks (block_shape (1, group)); routes with a negative id are zero. Per route: the
    token's bf16 row quantized per group (`quantize_int8_groups`), gate and up from `int8_dots`
    plus their biases, the activation rounded to bf16, that row quantized per group, the down
    dot plus its bias, times the route weight, rounded to bf16."""
    group = block_shape[1]
    num_tokens, top_k = topk_ids.shape
    hidden_size, inter = hidden.shape[1], w13.shape[1] // 2
    q, q_scale = quantize_int8_groups(hidden, group)
    flat_ids = topk_ids.reshape(-1).long()
    out = torch.zeros(num_tokens * top_k, hidden_size, dtype=torch.bfloat16)
    for expert in torch.unique(flat_ids[flat_ids >= 0]).tolist():
        routes = torch.nonzero(flat_ids == expert).squeeze(1)
        tokens = routes // top_k
        gate_up = int8_dots(q[tokens], q_scale[tokens], *int8_weights(w13[expert], w13_scale[expert], hidden_size),
                            group)
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert].float()
        act = activate(gate_up[:, :inter], gate_up[:, inter:], activation).bfloat16()
        down = int8_dots(*quantize_int8_groups(act, group), *int8_weights(w2[expert], w2_scale[expert], inter), group)
        if w2_bias is not None:
            down = down + w2_bias[expert].float()
        out[routes] = (topk_weights.reshape(-1)[routes, None].float() * down).bfloat16()
    return out.view(num_tokens, top_k, hidden_size)
