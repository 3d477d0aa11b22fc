"""Weight loading: walk the checkpoint's safetensors files once, copying each tensor into its
parameter (by name) or into its slice of a stacked expert bank (by the model's mapping).

Dummy loading fills every parameter and bank with random values at the config's real shapes,
generated on the compute device (fast at 30B shapes) and copied to wherever the bank lives.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re

import torch
from tqdm import tqdm

from moeferry.config import ConfigError, first_line
from moeferry.kernels.fused_moe.reference import dequantize_blocks
from moeferry.moe.formats import checkpoint_format, quantize_fp8_blocks, scale_grid

logger = logging.getLogger(__name__)


class LoadError(ConfigError):
    """The checkpoint on disk does not match the model: one line naming the file, the tensor
    and what was expected."""


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint, from its index when sharded."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LoadError(f"{index}: not a safetensors index (a JSON object with a \"weight_map\" of tensor "
                            f"name -> file name): {first_line(exc)}") from None
        for name in files:
            if not os.path.isfile(os.path.join(model_dir, name)):
                raise LoadError(f"shard {name!r} named in {index} is missing from {model_dir}")
        return [os.path.join(model_dir, n) for n in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not found:
        raise LoadError(f"{model_dir} has no *.safetensors weights (use --load-format dummy for random weights)")
    return [os.path.join(model_dir, n) for n in found]


@contextlib.contextmanager
def _open_checkpoint(file: str):
    """safe_open, with a file safetensors cannot read (empty, truncated, not safetensors)
    reported as a LoadError naming it."""
    from safetensors import safe_open

    try:
        handle = safe_open(file, framework="pt")
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, ... : all mean an unreadable file
        raise LoadError(f"{file}: not a readable safetensors file ({first_line(exc)})") from None
    with handle as f:
        yield f


def _read_tensor(f, name: str, file: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as exc:  # noqa: BLE001 - a tensor whose bytes are missing or damaged
        raise LoadError(f"{file}: tensor {name!r} cannot be read ({first_line(exc)})") from None


def _check_tensor(name: str, tensor: torch.Tensor, shape: tuple, file: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise LoadError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(shape)}")
    if not tensor.dtype.is_floating_point:
        raise LoadError(f"{file}: tensor {name!r} has dtype {tensor.dtype}, the model expects a floating-point tensor")


class _ExpertWriter:
    """Copies checkpoint expert tensors into a layer's banks: gate -> w13[e, :I], up -> w13[e, I:],
    down -> w2[e]; stacked gate_up [E, 2I, H] and down [E, H, I] land whole. In a block-FP8
    format an fp8 weight lands as is and its `weight_scale_inv` in the scale bank (gate blocks,
    then up blocks); an unquantized weight is quantized here (`--quantization fp8`, or a
    checkpoint that left some experts unquantized), on `device`.

    Invariant checked by `check_scales`: every fp8 weight copied as is got its scales."""

    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device
        self.raw_fp8 = 0  # fp8 weights copied as is
        self.scales = 0   # scale tensors copied

    def banks(self, layer_id: int, expert, name: str, file: str):
        banks = getattr(self.model.moe_block(layer_id), "banks", None)
        if banks is None:
            raise LoadError(f"{file}: tensor {name!r} is an expert of layer {layer_id}, which the model's config "
                            f"makes a dense layer")
        if expert is not None and not 0 <= expert < banks.num_experts:
            raise LoadError(f"{file}: tensor {name!r} is expert {expert}, but the model has {banks.num_experts} "
                            f"experts per layer")
        return banks

    @staticmethod
    def target(banks, expert, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight view, scale view or None) of one expert's (or, expert None, every expert's) `kind`."""
        pick = slice(None) if expert is None else expert
        inter = banks.w2.shape[2]
        gate_blocks = banks.w13_scale.shape[1] // 2 if banks.w13_scale is not None else 0
        if kind == "down":
            return banks.w2[pick], None if banks.w2_scale is None else banks.w2_scale[pick]
        rows, blocks = (slice(None, inter), slice(None, gate_blocks)) if kind == "gate" else \
            (slice(inter, None), slice(gate_blocks, None))
        scale = None if banks.w13_scale is None else banks.w13_scale[pick][..., blocks, :]
        return banks.w13[pick][..., rows, :], scale

    def write(self, layer_id: int, expert, kind: str, is_scale: bool, src_of, name: str, file: str) -> int:
        """Copy the tensor `src_of()` reads; returns the expert weights it held (0 for scales)."""
        banks = self.banks(layer_id, expert, name, file)
        if kind == "gate_up":  # stacked: gate and up are blocked (quantized) each on its own
            src = None if is_scale else src_of()
            if src is None or src.dtype == torch.float8_e4m3fn:
                raise LoadError(f"{file}: tensor {name!r}: stacked FP8 gate_up experts are not supported")
            _check_tensor(name, src, banks.w13.shape, file)
            inter = banks.w2.shape[2]
            self._write_weight(banks, expert, "gate", src[:, :inter], name, file)
            self._write_weight(banks, expert, "up", src[:, inter:], name, file)
            return 2 * banks.num_experts
        if is_scale:
            _, scale_dst = self.target(banks, expert, kind)
            if scale_dst is None:
                raise LoadError(f"{file}: tensor {name!r} is a block scale, but the experts are not block-quantized "
                                f"(config.json has no FP8 quantization_config)")
            src = src_of()
            _check_tensor(name, src, scale_dst.shape, file)
            scale_dst.copy_(src)
            self.scales += 1
            return 0
        self._write_weight(banks, expert, kind, src_of(), name, file)
        return 1 if expert is not None else banks.num_experts

    def _write_weight(self, banks, expert, kind: str, src: torch.Tensor, name: str, file: str) -> None:
        dst, scale_dst = self.target(banks, expert, kind)
        _check_tensor(name, src, dst.shape, file)
        fmt = banks.format
        if src.dtype == torch.float8_e4m3fn:
            if not fmt.quantized:
                raise LoadError(f"{file}: tensor {name!r} is float8, but config.json declares no FP8 "
                                f"quantization_config")
            dst.copy_(src)
            self.raw_fp8 += 1 if expert is not None else banks.num_experts
        elif fmt.quantized:
            quantized, scales = quantize_fp8_blocks(src.to(self.device), fmt.block_shape)
            dst.copy_(quantized)
            scale_dst.copy_(scales)
        else:
            dst.copy_(src)

    def check_scales(self, model_dir: str) -> None:
        if self.raw_fp8 != self.scales:
            raise LoadError(f"checkpoint in {model_dir}: {self.raw_fp8} FP8 expert weights but {self.scales} "
                            f"weight_scale_inv tensors: each FP8 weight needs its block scales")


class _DenseFp8:
    """Dense (non-expert) FP8 weights of a block-FP8 checkpoint, dequantized to their parameter's
    dtype once both the weight and its `weight_scale_inv` were read (they may sit in different
    shards). Invariant: a parameter is written only from a complete pair."""

    SCALE = "_scale_inv"

    def __init__(self, params: dict, block_shape):
        self.params, self.block_shape = params, block_shape
        self.weights: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}

    def owns(self, name: str) -> bool:
        """A dense weight's scale tensor (the weights themselves are recognised by their dtype)."""
        return (self.block_shape is not None and name.endswith(".weight" + self.SCALE)
                and name.removesuffix(self.SCALE) in self.params)

    def add(self, name: str, tensor: torch.Tensor) -> str | None:
        """Keep a weight or scale; returns the parameter's name when its pair is complete and written."""
        if name.endswith(self.SCALE):
            name = name.removesuffix(self.SCALE)
            self.scales[name] = tensor
        else:
            self.weights[name] = tensor
        if name not in self.weights or name not in self.scales:
            return None
        weight, scales = self.weights.pop(name), self.scales.pop(name)
        param = self.params[name]
        if tuple(scales.shape) != scale_grid(*weight.shape, self.block_shape):
            raise LoadError(f"{name}{self.SCALE}: shape {tuple(scales.shape)} is not the {self.block_shape} block "
                            f"grid of its weight {tuple(weight.shape)}")
        with torch.no_grad():
            param.copy_(dequantize_blocks(weight, scales, self.block_shape))
        return name

    def check_complete(self, model_dir: str) -> None:
        unpaired = sorted(set(self.weights) | set(self.scales))
        if unpaired:
            raise LoadError(f"checkpoint in {model_dir}: FP8 weight without its weight_scale_inv (or the reverse): "
                            f"{unpaired[:5]}")


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def _beyond_cut(name: str, num_layers: int) -> bool:
    """A tensor of a layer past --hf-overrides' num_hidden_layers: the cut model skips it."""
    m = _LAYER_INDEX.match(name)
    return m is not None and int(m.group(1)) >= num_layers


def load_safetensors(model, model_dir: str, device: torch.device | str = "cpu") -> None:
    """Fill the model's parameters and expert banks from the checkpoint in `model_dir`; experts
    that need quantizing into the banks' format are quantized on `device`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if model.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    expected = set(params)
    writer = _ExpertWriter(model, torch.device(device))
    fmt = checkpoint_format(model.config.hf)
    dense_fp8 = _DenseFp8(params, fmt.block_shape if fmt is not None else None)
    expert_counts: dict[int, int] = {}
    files = checkpoint_files(model_dir)
    for file in tqdm(files, desc="loading shards", unit="file", disable=len(files) < 2):
        with _open_checkpoint(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if _beyond_cut(name, model.config.num_layers):
                    continue
                target = model.expert_tensor_target(name)
                if target is not None:
                    layer_id, expert, kind, is_scale = target
                    with torch.no_grad():
                        held = writer.write(layer_id, expert, kind, is_scale, lambda: _read_tensor(f, name, file),
                                            name, file)
                    expert_counts[layer_id] = expert_counts.get(layer_id, 0) + held
                    continue
                if dense_fp8.owns(name):
                    dense_fp8.add(name, _read_tensor(f, name, file))
                    continue
                if name not in params:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name == "lm_head.weight" and model.tie_word_embeddings:
                        continue
                    raise LoadError(f"{file}: tensor {name!r} does not belong to a {model.config.model_type} model")
                src = _read_tensor(f, name, file)
                _check_tensor(name, src, params[name].shape, file)
                if src.dtype == torch.float8_e4m3fn and dense_fp8.block_shape is not None:
                    dense_fp8.add(name, src)
                else:
                    with torch.no_grad():
                        params[name].copy_(src)
                expected.discard(name)
    dense_fp8.check_complete(model_dir)
    writer.check_scales(model_dir)
    if expected:
        missing = sorted(expected)
        raise LoadError(f"checkpoint in {model_dir} lacks {len(missing)} tensor(s), first: {missing[:5]}")
    mc = model.config
    for layer_id in mc.moe_layer_ids:
        want = 3 * mc.num_experts
        if expert_counts.get(layer_id, 0) != want:
            raise LoadError(f"checkpoint in {model_dir}: layer {layer_id} has {expert_counts.get(layer_id, 0)} of "
                            f"{want} expert tensors (gate, up, down per expert)")


def _random_fill(dst: torch.Tensor, device: torch.device, generator_seed: int, std: float = 0.02) -> None:
    gen = torch.Generator(device=device).manual_seed(generator_seed)
    for i in range(dst.shape[0]):  # per expert: bounded temporary memory at 30B shapes
        src = torch.empty(dst.shape[1:], dtype=dst.dtype, device=device).normal_(0.0, std, generator=gen)
        dst[i].copy_(src, non_blocking=False)


def _random_fill_quantized(banks, device: torch.device, dtype: torch.dtype, seed: int, std: float = 0.02) -> None:
    """Random experts in `dtype`, quantized into the banks' block format as a checkpoint's would be."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for expert in range(banks.num_experts):
        for kind in ("gate", "up", "down"):
            dst, scale_dst = _ExpertWriter.target(banks, expert, kind)
            src = torch.empty(dst.shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
            quantized, scales = quantize_fp8_blocks(src, banks.format.block_shape)
            dst.copy_(quantized)
            scale_dst.copy_(scales)


def load_dummy(model, seed: int, device: torch.device) -> None:
    """Random weights at the config's real shapes: linears ~ N(0, 0.02), norms at 1; experts of
    a quantized format drawn in the compute dtype, then quantized."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        layer_ids = model.config.moe_layer_ids
        for layer_id in tqdm(layer_ids, desc="dummy experts", unit="layer", disable=len(layer_ids) < 4):
            banks = model.moe_block(layer_id).banks
            if banks.format.quantized:
                _random_fill_quantized(banks, device, model.lm_head.weight.dtype, seed * 1000 + 2 * layer_id)
                continue
            _random_fill(banks.w13, device, seed * 1000 + 2 * layer_id)
            _random_fill(banks.w2, device, seed * 1000 + 2 * layer_id + 1)
