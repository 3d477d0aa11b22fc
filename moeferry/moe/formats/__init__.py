"""Expert weight formats: how a routed expert's weights are stored in its banks, one object per
format (bit-level layouts: docs/formats.md).

An `ExpertFormat` owns everything about its format: reading the checkpoint's
`quantization_config` (`from_quantization_config`) and its tensor names (`suffixes`), the
banks' layout and bytes (`weight_dtype`, `pack`, `block_shape`, `scale_dtype`), quantizing a
float weight into it and dequantizing it back, and the arguments the expert kernels take for it
(`kernel_args`). The kernels themselves recognise a quantized format by its storage dtype (fp8
values, int4's int32 words, MXFP4's bytes); a new format stored like another (NVFP4's bytes
beside MXFP4's) would have them take its name.

    unquantized  the compute dtype (bf16 on a GPU)
    fp8          block FP8 e4m3, a float32 scale per block (DeepSeek-V3, Qwen3 FP8)   formats/fp8.py
    int4         W4A16, compressed-tensors' pack-quantized groups                     formats/int4.py
    mxfp4        OCP microscaling FP4 E2M1, an E8M0 scale per 32 (gpt-oss)            formats/mxfp4.py

A checkpoint says its format in config.json's `quantization_config`; `--quantization NAME`
quantizes a bf16 checkpoint's experts at load into the same layout. Only the routed experts
keep the format: dense weights are dequantized to the compute dtype at load (engine/loader.py).
A new format is one module here (a subclass, named in `_FORMATS`) plus its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moeferry.errors import ConfigError


def scale_grid(rows: int, cols: int, block_shape: tuple[int, int]) -> tuple[int, int]:
    """The shape of the scales of a [rows, cols] matrix: one per block, the last ones partial."""
    return -(-rows // block_shape[0]), -(-cols // block_shape[1])


@dataclass(frozen=True)
class ExpertFormat:
    """A storage format of expert weights. Invariant: `weight_dtype` None means the compute
    dtype and no scales (`block_shape` None); otherwise every weight matrix [R, C] is stored as
    [R, ceil(C / pack)] elements of `weight_dtype` (`pack` values each) with scales of
    `scale_dtype` [ceil(R / block_shape[0]), ceil(C / block_shape[1])]."""

    name: str = "unquantized"
    weight_dtype: torch.dtype | None = None
    block_shape: tuple[int, int] | None = None
    pack: int = 1
    scale_dtype: torch.dtype = torch.float32

    # checkpoint tensor-name suffixes of a quantized linear -> the part they hold (weight, scale,
    # shape); the leading "." or "_" is the separator the checkpoints use
    suffixes: ClassVar[dict[str, str]] = {}
    quant_method: ClassVar[str | None] = None  # config.json's quantization_config.quant_method

    @property
    def quantized(self) -> bool:
        return self.block_shape is not None

    def kernel_args(self, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None) -> dict:
        """The expert kernels' (fused_moe, the host kernel) keyword arguments for banks of this
        format: their scales and block shape (none for the compute dtype)."""
        if not self.quantized:
            return {}
        return {"w13_scale": w13_scale, "w2_scale": w2_scale, "block_shape": self.block_shape}

    def describe(self) -> str:
        """The format for the start-up plan and /v1/stats, e.g. 'fp8 e4m3, 128x128 blocks'."""
        return self.name

    def stored_cols(self, cols: int) -> int:
        """Elements of `weight_dtype` holding a row of `cols` values."""
        return -(-cols // self.pack)

    def stores(self, tensor: torch.Tensor) -> bool:
        """Whether a checkpoint tensor is already in this format's storage (copied as is)."""
        return self.quantized and tensor.dtype == self.weight_dtype

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stored weight, scales) of `weight` [..., R, C]."""
        raise ValueError(f"{self.name} experts are not quantized")

    def values(self, weight: torch.Tensor, cols: int) -> torch.Tensor:
        """The stored weight's values [..., R, cols] before their scales."""
        return weight

    def scale_values(self, scales: torch.Tensor) -> torch.Tensor:
        """The scales as float32 multipliers."""
        return scales.float()

    def dequantize(self, weight: torch.Tensor, scales: torch.Tensor, cols: int | None = None) -> torch.Tensor:
        """float32 weight [..., R, C]: the values times their block's scale (`cols`: the columns
        before packing, default all the stored ones hold)."""
        values = self.values(weight, cols if cols is not None else self.pack * weight.shape[-1])
        rows, cols = values.shape[-2:]
        bn, bk = self.block_shape
        expanded = self.scale_values(scales).repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
        return values.float() * expanded[..., :rows, :cols]

    @classmethod
    def from_quantization_config(cls, qc: dict) -> "ExpertFormat":
        """The format a checkpoint's `quantization_config` of this `quant_method` declares;
        ConfigError naming the field for a layout this engine does not read."""
        raise NotImplementedError


UNQUANTIZED = ExpertFormat()

# Each format in its own module; they import the base above, so they come after it.
from moeferry.moe.formats.fp8 import DEFAULT_FP8_BLOCK, FP8_MAX, BlockFp8, quantize_fp8_blocks  # noqa: E402
from moeferry.moe.formats.int4 import (DEFAULT_INT4_GROUP, INT4_PACK, Int4Groups, pack_int4,  # noqa: E402
                                       quantize_int4_groups)
from moeferry.moe.formats.mxfp4 import Mxfp4, pack_mxfp4, quantize_mxfp4  # noqa: E402

_FORMATS = {cls.name: cls for cls in (BlockFp8, Int4Groups, Mxfp4)}  # --quantization's names
QUANTIZATIONS = tuple(_FORMATS)  # what --quantization may quantize a bf16 checkpoint's experts to


def is_stored_quantized(tensor: torch.Tensor) -> bool:
    """Whether a checkpoint tensor is in some quantized format's storage (fp8 values, int4
    words, MXFP4 bytes) rather than a float weight to quantize or copy."""
    return any(cls.weight_dtype == tensor.dtype for cls in _FORMATS.values())


def all_suffixes() -> dict[str, str]:
    """Every quantized format's checkpoint tensor suffixes -> part (the model's name mapping)."""
    out: dict[str, str] = {}
    for cls in _FORMATS.values():
        out.update(cls.suffixes)
    return out


def checkpoint_format(hf_config) -> ExpertFormat | None:
    """The format config.json's `quantization_config` declares (None: not quantized).
    ConfigError naming the field for a method or layout this engine does not read."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    for cls in _FORMATS.values():
        if cls.quant_method == method:
            return cls.from_quantization_config(qc)
    raise ConfigError(f"config.json: quantization_config.quant_method {method!r} is not supported; supported: fp8 "
                      f"(block-scaled e4m3), compressed-tensors (pack-quantized int4 groups), mxfp4")


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
    return fmt.quantize(weight)


def fp8_format(block_shape=DEFAULT_FP8_BLOCK) -> ExpertFormat:
    return BlockFp8(block_shape=(int(block_shape[0]), int(block_shape[1])))


def int4_format(group_size: int = DEFAULT_INT4_GROUP) -> ExpertFormat:
    return Int4Groups(block_shape=(1, int(group_size)))


def mxfp4_format() -> ExpertFormat:
    return Mxfp4()
