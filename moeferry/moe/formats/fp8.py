"""Block FP8 (the layout of DeepSeek-V3 and Qwen3's FP8 releases): float8_e4m3fn weights and one
float32 scale per block of `block_shape` (rows, columns) of each weight matrix, the
checkpoint's `weight_scale_inv`: weight = fp8 value * scale."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.errors import ConfigError
from moeferry.moe.formats import ExpertFormat, scale_grid

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: the largest e4m3 magnitude
DEFAULT_FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class BlockFp8(ExpertFormat):
    name: str = "fp8"
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    block_shape: tuple[int, int] = DEFAULT_FP8_BLOCK

    suffixes = {".weight_scale_inv": "scale"}
    quant_method = "fp8"

    def describe(self) -> str:
        return f"fp8 e4m3, {self.block_shape[0]}x{self.block_shape[1]} blocks"

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_blocks(weight, self.block_shape)

    @classmethod
    def from_quantization_config(cls, qc: dict) -> "BlockFp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"config.json: quantization_config.fmt {qc.get('fmt')!r}: only e4m3 FP8 is supported")
        block = qc.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ConfigError(f"config.json: quantization_config.weight_block_size {block!r}: block FP8 needs two positive "
                              f"integers (per-tensor FP8 is not supported)")
        return cls(block_shape=(int(block[0]), int(block[1])))


@torch.no_grad()
def quantize_fp8_blocks(weight: torch.Tensor, block_shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scales) of `weight` [..., R, C], as FP8 checkpoints store them:
    per block, scale = amax / 448 (1 for an all-zero block) and fp8 = round(weight / scale),
    so the block's largest magnitude maps onto e4m3's largest value. Computed in float32."""
    *lead, rows, cols = weight.shape
    br, bc = block_shape
    grid_r, grid_c = scale_grid(rows, cols, block_shape)
    padded = weight.new_zeros((*lead, grid_r * br, grid_c * bc), dtype=torch.float32)
    padded[..., :rows, :cols] = weight.float()
    blocks = padded.view(*lead, grid_r, br, grid_c, bc)
    amax = blocks.abs().amax(dim=(-3, -1))
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (blocks / scales[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    quantized = quantized.view(*lead, grid_r * br, grid_c * bc)[..., :rows, :cols].contiguous()
    return quantized, scales.contiguous()
