"""Expert weight formats: how a routed expert's weights are stored in its banks.

`unquantized`: the banks hold the compute dtype (bf16 on a GPU). `fp8` (block FP8, the layout
of DeepSeek-V3 and Qwen3's FP8 releases): float8_e4m3fn weights and one float32 scale per
block of `block_shape` (rows, columns) of each weight matrix, the checkpoint's
`weight_scale_inv`: weight = fp8 value * scale. `int4` (W4A16, compressed-tensors'
`pack-quantized`, the format of most 4-bit MoE checkpoints on the hub, written by llm-compressor):
symmetric signed 4-bit values in [-8, 7] stored + 8 as nibbles, eight to an int32 along each
row (value i of a word at bits 4i..4i+3), `weight_packed`, with one scale per row and group of
128 columns, `weight_scale`: weight = value * scale. `mxfp4` (OCP microscaling, gpt-oss's
experts, transformers' `quant_method: mxfp4`): FP4 E2M1 codes two to a byte along each row (the
low nibble first), `*_blocks`, with one E8M0 exponent byte per row and 32 columns, `*_scales`:
weight = E2M1 value * 2^(scale - 127). A checkpoint says its format in config.json's
`quantization_config`; `--quantization fp8|int4|mxfp4` quantizes a bf16 checkpoint's experts at
load into the same layout. Only the routed experts keep the format: dense weights are
dequantized to the compute dtype at load (engine/loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.errors import ConfigError
from moeferry.kernels.fused_moe import E2M1_VALUES, E8M0_BIAS, MXFP4_BLOCK
from moeferry.kernels.fused_moe.reference import e8m0_to_float

__all__ = ["FP8_MAX", "INT4_PACK", "QUANTIZATIONS", "ExpertFormat", "UNQUANTIZED", "checkpoint_format",
           "expert_format", "pack_mxfp4", "quantize", "quantize_fp8_blocks", "quantize_int4_groups",
           "quantize_mxfp4", "scale_grid"]

QUANTIZATIONS = ("fp8", "int4", "mxfp4")  # what --quantization may quantize a bf16 checkpoint's experts to
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: the largest e4m3 magnitude
DEFAULT_FP8_BLOCK = (128, 128)
DEFAULT_INT4_GROUP = 128
INT4_PACK = 8  # 4-bit values per int32


@dataclass(frozen=True)
class ExpertFormat:
    """A storage format of expert weights. Invariant: `weight_dtype` None means the compute
    dtype and no scales (`block_shape` None); otherwise every weight matrix [R, C] is stored as
    [R, ceil(C / pack)] elements of `weight_dtype` (`pack` values each) with scales of
    `scale_dtype` (float32; MXFP4's uint8 E8M0 exponents) [ceil(R / block_shape[0]),
    ceil(C / block_shape[1])]."""

    name: str
    weight_dtype: torch.dtype | None = None
    block_shape: tuple[int, int] | None = None
    pack: int = 1
    scale_dtype: torch.dtype = torch.float32

    @property
    def quantized(self) -> bool:
        return self.block_shape is not None

    def describe(self) -> str:
        """The format for the start-up plan and /v1/stats, e.g. 'fp8 e4m3, 128x128 blocks'."""
        if not self.quantized:
            return self.name
        if self.name == "mxfp4":
            return f"mxfp4 e2m1, e8m0 scales per {self.block_shape[1]}"
        if self.pack > 1:
            return f"{self.name} W4A16, groups of {self.block_shape[1]}"
        return f"{self.name} e4m3, {self.block_shape[0]}x{self.block_shape[1]} blocks"

    def stored_cols(self, cols: int) -> int:
        """Elements of `weight_dtype` holding a row of `cols` values."""
        return -(-cols // self.pack)


UNQUANTIZED = ExpertFormat("unquantized")


def fp8_format(block_shape=DEFAULT_FP8_BLOCK) -> ExpertFormat:
    return ExpertFormat("fp8", torch.float8_e4m3fn, (int(block_shape[0]), int(block_shape[1])))


def int4_format(group_size: int = DEFAULT_INT4_GROUP) -> ExpertFormat:
    return ExpertFormat("int4", torch.int32, (1, int(group_size)), pack=INT4_PACK)


def mxfp4_format() -> ExpertFormat:
    return ExpertFormat("mxfp4", torch.uint8, (1, MXFP4_BLOCK), pack=2, scale_dtype=torch.uint8)


_FORMATS = {"fp8": fp8_format, "int4": int4_format, "mxfp4": mxfp4_format}


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
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc)
    if method == "mxfp4":  # transformers' Mxfp4Config: no options that change the layout
        return mxfp4_format()
    if method != "fp8":
        raise ConfigError(f"config.json: quantization_config.quant_method {method!r} is not supported; supported: fp8 "
                          f"(block-scaled e4m3), compressed-tensors (pack-quantized int4 groups), mxfp4")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"config.json: quantization_config.fmt {qc.get('fmt')!r}: only e4m3 FP8 is supported")
    block = qc.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"config.json: quantization_config.weight_block_size {block!r}: block FP8 needs two positive "
                          f"integers (per-tensor FP8 is not supported)")
    return fp8_format(block)


def _compressed_tensors_format(qc: dict) -> ExpertFormat:
    """compressed-tensors' pack-quantized W4A16: one config group of symmetric 4-bit int weights
    in groups along the input dimension, activations unquantized."""
    where = "config.json: quantization_config"
    if qc.get("format") != "pack-quantized":
        raise ConfigError(f"{where}.format {qc.get('format')!r}: only compressed-tensors' pack-quantized is supported")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ConfigError(f"{where}.config_groups: exactly one group is supported, got {len(groups)}")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    got = {k: weights.get(k) for k in want}
    if got != want or acts is not None or not isinstance(weights.get("group_size"), int) or weights["group_size"] < 1:
        raise ConfigError(f"{where}: only W4A16 (weights {want} with a group_size, activations unquantized) is "
                          f"supported, got weights {got}, group_size {weights.get('group_size')!r}, "
                          f"input_activations {acts!r}")
    return int4_format(weights["group_size"])


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
    return declared or _FORMATS[quantization]()


def quantize(weight: torch.Tensor, fmt: ExpertFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored weight, scales) of `weight` [..., R, C] in the quantized format `fmt`."""
    if fmt.name == "mxfp4":
        return quantize_mxfp4(weight)
    if fmt.pack > 1:
        return quantize_int4_groups(weight, fmt.block_shape[1])
    return quantize_fp8_blocks(weight, fmt.block_shape)


INT4_MAX = 7


@torch.no_grad()
def quantize_int4_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int32 [..., R, ceil(C / 8)], float32 scales [..., R, ceil(C / group_size)]) of
    `weight` [..., R, C], symmetric: per row and group, scale = amax / 7 (1 for an all-zero
    group) and value = round(weight / scale) in [-7, 7], stored + 8 as nibbles, value i of a
    word at bits 4i (compressed-tensors' pack_to_int32 layout). Computed in float32."""
    *lead, rows, cols = weight.shape
    groups = -(-cols // group_size)
    padded = weight.new_zeros((*lead, rows, groups * group_size), dtype=torch.float32)
    padded[..., :cols] = weight.float()
    blocks = padded.view(*lead, rows, groups, group_size)
    amax = blocks.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax))
    values = torch.round(blocks / scales[..., None]).clamp(-INT4_MAX, INT4_MAX).view(*lead, rows, -1)[..., :cols]
    return pack_int4(values.to(torch.int32)), scales.contiguous()


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int32 [..., R, ceil(C / 8)]: signed 4-bit `values` [..., R, C] + 8, eight nibbles a word."""
    *lead, rows, cols = values.shape
    words = -(-cols // INT4_PACK)
    nibbles = values.new_zeros((*lead, rows, words * INT4_PACK), dtype=torch.int64)
    nibbles[..., :cols] = values.to(torch.int64) + 8
    shifts = torch.arange(INT4_PACK, dtype=torch.int64, device=values.device) * 4
    packed = (nibbles.view(*lead, rows, words, INT4_PACK) << shifts).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).contiguous()


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
