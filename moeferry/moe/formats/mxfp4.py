"""MXFP4 (OCP microscaling, gpt-oss's experts, transformers' `quant_method: mxfp4`): FP4 E2M1 codes
two to a byte along each row (the low nibble first), `*_blocks`, with one E8M0 exponent byte
per row and 32 columns, `*_scales`: weight = E2M1 value * 2^(scale - 127)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.kernels.fused_moe import E2M1_VALUES, E8M0_BIAS, MXFP4_BLOCK
from moeferry.kernels.fused_moe.common import e8m0_to_float, unpack_mxfp4
from moeferry.moe.formats import ExpertFormat


@dataclass(frozen=True)
class Mxfp4(ExpertFormat):
    name: str = "mxfp4"
    weight_dtype: torch.dtype = torch.uint8
    block_shape: tuple[int, int] = (1, MXFP4_BLOCK)
    pack: int = 2
    scale_dtype: torch.dtype = torch.uint8

    suffixes = {"_blocks": "weight", "_scales": "scale"}
    quant_method = "mxfp4"

    def describe(self) -> str:
        return f"mxfp4 e2m1, e8m0 scales per {self.block_shape[1]}"

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_mxfp4(weight)

    def values(self, weight: torch.Tensor, cols: int) -> torch.Tensor:
        return unpack_mxfp4(weight, cols)

    def scale_values(self, scales: torch.Tensor) -> torch.Tensor:
        return e8m0_to_float(scales)

    @classmethod
    def from_quantization_config(cls, qc: dict) -> "Mxfp4":
        return cls()  # transformers' Mxfp4Config: no options that change the layout


E2M1_MAX_EXPONENT = 2  # E2M1's largest value, 6, is 1.5 x 2^2


@torch.no_grad()
def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 bytes [..., R, ceil(C / 2)], uint8 E8M0 scales [..., R, ceil(C / 32)]) of `weight`
    [..., R, C], as OCP's MX specification quantizes: per row and block of 32 values, the shared
    scale is 2^(floor(log2(amax)) - 2) (E2M1's largest exponent), clamped to E8M0's 2^-127 ..
    2^127 (2^0 for an all-zero block), and each value / scale rounds to the nearest E2M1 value
    (ties to the even code), saturating at 6. Computed in float32; a code of zero is +0."""
    *lead, rows, cols = weight.shape
    groups = -(-cols // MXFP4_BLOCK)
    padded = weight.new_zeros((*lead, rows, groups * MXFP4_BLOCK), dtype=torch.float32)
    padded[..., :cols] = weight.float()
    blocks = padded.view(*lead, rows, groups, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    exponent = torch.frexp(amax).exponent - 1 - E2M1_MAX_EXPONENT  # frexp: amax = m 2^e, m in [0.5, 1)
    scales = (torch.where(amax > 0, exponent, 0).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    scaled = (blocks / e8m0_to_float(scales)[..., None]).abs()  # exact: a power of two; in [0, 8)
    step = torch.where(scaled < 2, 0.5, torch.where(scaled < 4, 1.0, 2.0))  # E2M1's spacing there
    magnitude = (torch.round(scaled / step) * step).clamp(max=6.0)  # round half to even = to the even code
    grid = torch.tensor(E2M1_VALUES[:8], device=weight.device)
    codes = torch.searchsorted(grid, magnitude.contiguous()).to(torch.uint8)
    codes = torch.where((blocks < 0) & (codes > 0), codes | 8, codes).view(*lead, rows, -1)[..., :cols]
    return pack_mxfp4(codes), scales.contiguous()


def pack_mxfp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., R, ceil(C / 2)]: E2M1 `codes` [..., R, C] two to a byte, code 2j in the low
    nibble (transformers' and gpt-oss's order), a last odd code with a zero high nibble."""
    *lead, rows, cols = codes.shape
    padded = codes.new_zeros((*lead, rows, 2 * -(-cols // 2)), dtype=torch.uint8)
    padded[..., :cols] = codes
    return (padded[..., 0::2] | (padded[..., 1::2] << 4)).contiguous()
