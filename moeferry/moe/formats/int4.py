"""int4 W4A16 (compressed-tensors' `pack-quantized`, the format of most 4-bit MoE checkpoints on the
hub, written by llm-compressor): symmetric signed 4-bit values in [-8, 7] stored + 8 as
nibbles, eight to an int32 along each row (value i of a word at bits 4i..4i+3),
`weight_packed`, with one scale per row and group of 128 columns, `weight_scale`: weight =
value * scale."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.errors import ConfigError
from moeferry.kernels.fused_moe.common import unpack_int4
from moeferry.moe.formats import ExpertFormat

DEFAULT_INT4_GROUP = 128
INT4_PACK = 8  # 4-bit values per int32


@dataclass(frozen=True)
class Int4Groups(ExpertFormat):
    name: str = "int4"
    weight_dtype: torch.dtype = torch.int32
    block_shape: tuple[int, int] = (1, DEFAULT_INT4_GROUP)
    pack: int = INT4_PACK

    suffixes = {".weight_packed": "weight", ".weight_scale": "scale", ".weight_shape": "shape"}
    quant_method = "compressed-tensors"

    def describe(self) -> str:
        return f"int4 W4A16, groups of {self.block_shape[1]}"

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int4_groups(weight, self.block_shape[1])

    def values(self, weight: torch.Tensor, cols: int) -> torch.Tensor:
        return unpack_int4(weight, cols)

    @classmethod
    def from_quantization_config(cls, qc: dict) -> "Int4Groups":
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
        return cls(block_shape=(1, weights["group_size"]))


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
