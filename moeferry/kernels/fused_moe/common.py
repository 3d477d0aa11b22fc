"""What the fused MoE's oracle and the engine share: unpacking and dequantizing the expert
formats' storage (kernels/fused_moe/__init__.py says the layouts) and the fixed-order sum of
route outputs. Production code imports these from here, never from the oracle (reference.py)."""
import torch

from moeferry.kernels.fused_moe import E2M1_VALUES


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 values [..., R, cols] in [-8, 7] of int4 words [..., R, ceil(cols / 8)]: value i of a
    word at bits 4i..4i+3, stored + 8 (compressed-tensors' pack-quantized layout)."""
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device) * 4
    nibbles = (packed[..., None] >> shifts) & 0xF
    return (nibbles.flatten(-2)[..., :cols] - 8).to(torch.int32)


def unpack_mxfp4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 values [..., R, cols] of MXFP4 bytes [..., R, ceil(cols / 2)]: two E2M1 codes a
    byte, value 2j in the low nibble, 2j + 1 in the high one (E2M1_VALUES)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)[..., :cols]
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)[codes.long()]


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """float32 2^(s - E8M0_BIAS) of E8M0 bytes s, built from the bits (exact on any device): the
    bias is float32's, so s is the float's exponent field, and s = 0 the subnormal 2^-127 (255,
    E8M0's NaN, comes out infinite)."""
    exponent = scales.to(torch.int32)
    return torch.where(exponent == 0, 1 << 22, exponent << 23).view(torch.float32)


def dequantize_blocks(weight: torch.Tensor, scales: torch.Tensor, block_shape: tuple[int, int],
                      cols: int | None = None) -> torch.Tensor:
    """float32 weight [..., R, C] * its block's scale: scales [..., ceil(R / bn), ceil(C / bk)]
    hold one value per (bn, bk) block, the last row and column of blocks possibly partial.
    An int32 weight is packed int4 of `cols` columns (default: 8 per word), a uint8 weight MXFP4
    bytes (default: 2 values each) with uint8 E8M0 scales; both are unpacked first."""
    if weight.dtype == torch.int32:
        weight = unpack_int4(weight, cols if cols is not None else 8 * weight.shape[-1])
    elif weight.dtype == torch.uint8:
        weight = unpack_mxfp4(weight, cols if cols is not None else 2 * weight.shape[-1])
        scales = e8m0_to_float(scales)
    rows, cols = weight.shape[-2:]
    expanded = scales.float().repeat_interleave(block_shape[0], dim=-2).repeat_interleave(block_shape[1], dim=-1)
    return weight.float() * expanded[..., :rows, :cols]


def dequantize_w13(w13: torch.Tensor, scales: torch.Tensor, block_shape: tuple[int, int],
                   cols: int | None = None) -> torch.Tensor:
    """One expert's gate+up matrix [2I, H] in float32: gate and up blocked each on its own."""
    gate, up = w13.chunk(2, dim=-2)
    gate_scales, up_scales = scales.chunk(2, dim=-2)
    return torch.cat([dequantize_blocks(gate, gate_scales, block_shape, cols),
                      dequantize_blocks(up, up_scales, block_shape, cols)], dim=-2)


def sum_route_partials(partials: torch.Tensor) -> torch.Tensor:
    """[T, H] float32 sum over k = 0..K-1, in that order, of partials [T, K, H]."""
    total = partials[:, 0].to(torch.float32, copy=True)
    for k in range(1, partials.shape[1]):  # fixed order k = 0..K-1
        total += partials[:, k]
    return total
