"""Expert weight formats: how a routed expert's weights are stored in its banks.

`unquantized`: the banks hold the compute dtype (bf16 on a GPU). `fp8` (block FP8, the layout
of DeepSeek-V3 and Qwen3's FP8 releases): float8_e4m3fn weights and one float32 scale per
block of `block_shape` (rows, columns) of each weight matrix, the checkpoint's
`weight_scale_inv`: weight = fp8 value * scale. A checkpoint says its format in config.json's
`quantization_config`; `--quantization fp8` quantizes a bf16 checkpoint's experts at load
into the same layout. Only the routed experts keep the format: dense weights are
dequantized to the compute dtype at load (engine/loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.config import QUANTIZATIONS, ConfigError

__all__ = ["FP8_MAX", "QUANTIZATIONS", "ExpertFormat", "UNQUANTIZED", "checkpoint_format", "expert_format",
           "quantize_fp8_blocks", "scale_grid"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: the largest e4m3 magnitude
DEFAULT_FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class ExpertFormat:
    """A storage format of expert weights. Invariant: `weight_dtype` None means the compute
    dtype and no scales (`block_shape` None); otherwise every weight matrix [R, C] comes with
    float32 scales [ceil(R / block_shape[0]), ceil(C / block_shape[1])]."""

    name: str
    weight_dtype: torch.dtype | None = None
    block_shape: tuple[int, int] | None = None

    @property
    def quantized(self) -> bool:
        return self.block_shape is not None

    def describe(self) -> str:
        """The format for the start-up plan and /v1/stats, e.g. 'fp8 e4m3, 128x128 blocks'."""
        if not self.quantized:
            return self.name
        return f"{self.name} e4m3, {self.block_shape[0]}x{self.block_shape[1]} blocks"


UNQUANTIZED = ExpertFormat("unquantized")


def fp8_format(block_shape=DEFAULT_FP8_BLOCK) -> ExpertFormat:
    return ExpertFormat("fp8", torch.float8_e4m3fn, (int(block_shape[0]), int(block_shape[1])))


def scale_grid(rows: int, cols: int, block_shape: tuple[int, int]) -> tuple[int, int]:
    """The shape of the scales of a [rows, cols] matrix: one per block, the last ones partial."""
    return -(-rows // block_shape[0]), -(-cols // block_shape[1])


def checkpoint_format(hf_config) -> ExpertFormat | None:
    """The format config.json's `quantization_config` declares (None: not quantized).
    ConfigError naming the field for a method or layout this engine does not read."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"config.json: quantization_config.quant_method {method!r} is not supported; supported: fp8 "
                          f"(block-scaled e4m3)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"config.json: quantization_config.fmt {qc.get('fmt')!r}: only e4m3 FP8 is supported")
    block = qc.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"config.json: quantization_config.weight_block_size {block!r}: block FP8 needs two positive "
                          f"integers (per-tensor FP8 is not supported)")
    return fp8_format(block)


def expert_format(hf_config, quantization: str | None) -> ExpertFormat:
    """The format the expert banks hold: the checkpoint's, else `--quantization`'s, else the
    compute dtype. A quantized checkpoint with a different --quantization is refused."""
    declared = checkpoint_format(hf_config) if hf_config is not None else None
    if quantization is None:
        return declared or UNQUANTIZED
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization {quantization!r} is unknown; choose one of: {', '.join(QUANTIZATIONS)}")
    if declared is not None and declared.name != quantization:
        raise ConfigError(f"--quantization {quantization}: the checkpoint is already quantized as {declared.name}")
    return declared or fp8_format()


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
