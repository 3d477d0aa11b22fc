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
from moeferry.moe.formats import all_suffixes, checkpoint_format, is_stored_quantized, quantize, scale_grid

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


def _check_tensor(name: str, tensor: torch.Tensor, shape: tuple, file: str, packed: bool = False) -> None:
    """`packed`: integer storage is expected (int4's int32 words, MXFP4's bytes and E8M0 scales)."""
    if tuple(tensor.shape) != tuple(shape):
        raise LoadError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(shape)}")
    if not (tensor.dtype.is_floating_point or packed and tensor.dtype in (torch.int32, torch.uint8)):
        raise LoadError(f"{file}: tensor {name!r} has dtype {tensor.dtype}, the model expects a floating-point tensor")


def split_gate_up(stacked: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate rows, up rows) of a stacked gate_up tensor [E, 2I, ...] (weights, or their scales
    per row): the first I rows, then the last I; or, `interleaved` (gpt-oss), the even rows,
    then the odd ones. Views: a row keeps its bytes, so quantized rows split exactly."""
    if interleaved:
        return stacked[:, 0::2], stacked[:, 1::2]
    half = stacked.shape[1] // 2
    return stacked[:, :half], stacked[:, half:]


def mxfp4_rows(blocks: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MXFP4 `*_blocks` [E, rows, K/32, 16] (16 bytes, 32 values, per scale) as the
    banks' rows [E, rows, K/2]: the same bytes in the same order."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 4:
        raise ValueError(f"MXFP4 blocks are uint8 [E, rows, K/32, 16], got {blocks.dtype} {list(blocks.shape)}")
    return blocks.flatten(-2)


class _ExpertWriter:
    """Copies checkpoint expert tensors into a layer's banks: gate -> w13[e, :I], up -> w13[e, I:],
    down -> w2[e]; stacked gate_up [E, 2I, H] (its halves, or its even and odd rows where the
    family interleaves them: `FamilySpec.gate_up_interleaved`) and down [E, H, I] land whole. In
    a quantized format a stored weight (fp8, int4 words, MXFP4 bytes: gpt-oss's `*_blocks`) lands
    as is and its scales in the scale bank (gate blocks, then up blocks); an unquantized weight
    is quantized here (`--quantization`, or a checkpoint that left some experts unquantized), on
    `device`.

    Invariant checked by `check_scales`: every stored weight copied as is got its scales."""

    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device
        self.interleaved = model.spec.gate_up_interleaved
        self.stored = 0  # quantized weights copied as is
        self.scales = 0  # scale tensors copied
        self.biases: dict[int, int] = {}  # layer -> expert biases written (gate_up's and down's)

    def banks(self, layer_id: int, expert, name: str, file: str):
        banks = getattr(self.model.moe_block(layer_id), "banks", None)
        if banks is None:
            raise LoadError(f"{file}: tensor {name!r} is an expert of layer {layer_id}, which the model's config "
                            f"makes a dense layer")
        experts = self.model.config.num_experts
        if expert is not None and not 0 <= expert < experts:
            raise LoadError(f"{file}: tensor {name!r} is expert {expert}, but the model has {experts} "
                            f"experts per layer")
        return banks

    @staticmethod
    def target(banks, expert, kind: str) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """(weight view, scale view or None, the weight's columns before packing) of one expert's
        (or, expert None, every expert's) `kind`."""
        pick = slice(None) if expert is None else expert
        hidden, inter = banks.w2.shape[1], banks.w13.shape[1] // 2
        gate_blocks = banks.w13_scale.shape[1] // 2 if banks.w13_scale is not None else 0
        if kind == "down":
            return banks.w2[pick], None if banks.w2_scale is None else banks.w2_scale[pick], inter
        rows, blocks = (slice(None, inter), slice(None, gate_blocks)) if kind == "gate" else \
            (slice(inter, None), slice(gate_blocks, None))
        scale = None if banks.w13_scale is None else banks.w13_scale[pick][..., blocks, :]
        return banks.w13[pick][..., rows, :], scale, hidden

    def _stacked(self, kind: str, src: torch.Tensor, want: tuple, name: str, file: str) -> torch.Tensor:
        """A stacked tensor of every expert in the banks' layout `want` (FamilySpec.stacked_experts),
        its shape checked in the checkpoint's layout first: the conversions (transposes,
        de-interleaving) give the checkpoint's shape when applied to the banks'."""
        convert = self.model.spec.stacked_experts
        if convert is None:
            return src
        _check_tensor(name, src, convert(kind, torch.empty(want, device="meta")).shape, file)
        return convert(kind, src)

    def _write_bias(self, banks, layer_id: int, kind: str, src: torch.Tensor, name: str, file: str) -> int:
        dst = banks.w13_bias if kind == "gate_up" else banks.w2_bias
        if dst is None:
            raise LoadError(f"{file}: tensor {name!r} is an expert bias, but the model's experts have none")
        src = self._stacked(kind + "_bias", src, tuple(dst.shape), name, file)
        _check_tensor(name, src, dst.shape, file)
        if kind == "gate_up":  # gate's biases, then up's, as the w13 rows they join
            src = torch.cat(split_gate_up(src, self.interleaved), dim=1)
        dst.copy_(src)
        self.biases[layer_id] = self.biases.get(layer_id, 0) + 1
        return 0

    def write(self, layer_id: int, expert, kind: str, part: str, src_of, name: str, file: str) -> int:
        """Copy the tensor `src_of()` reads; returns the expert weights it held (0 for scales and biases).
        Split across ranks, only the rank's own experts land (at their rows in its banks)."""
        banks = self.banks(layer_id, expert, name, file)
        held = self.model.moe_block(layer_id).strategy.owned_experts(self.model.config.num_experts)
        if expert is not None:
            if expert not in held:
                return 0  # another rank's
            expert -= held.start
        elif part != "shape" and len(held) != self.model.config.num_experts:
            read = src_of
            src_of = lambda: read()[held.start:held.stop]  # noqa: E731 - a stacked tensor's dim 0 is the expert
        if part == "bias":
            return self._write_bias(banks, layer_id, kind, src_of(), name, file)
        if expert is None and part != "shape":
            return self._write_stacked(banks, kind, part, src_of(), name, file)
        if part == "shape":  # int4's logical [rows, cols]: must be the bank's
            dst, _, cols = self.target(banks, expert, kind)
            if src_of().tolist() != [*dst.shape[-2:-1], cols]:
                raise LoadError(f"{file}: tensor {name!r} says {src_of().tolist()}, the model expects "
                                f"{[*dst.shape[-2:-1], cols]}")
            return 0
        if part == "scale":
            self._write_scales(banks, expert, kind, src_of(), name, file)
            return 0
        self._write_weight(banks, expert, kind, src_of(), name, file)
        return 1

    def _write_stacked(self, banks, kind: str, part: str, src: torch.Tensor, name: str, file: str) -> int:
        """Every expert's gate_up or down weights (or scales) at once; gate and up are blocked
        (quantized) each on its own, so a stacked gate_up splits by rows before anything else."""
        if part == "weight" and src.dtype == torch.uint8 and src.dim() == 4:
            src = mxfp4_rows(src)
        elif part == "weight" and not is_stored_quantized(src) and self.model.spec.stacked_experts is not None:
            # the family's own layout (gpt-oss's bf16: transposed) into the banks' [E, rows, cols]
            dst, _, cols = self.target(banks, None, "gate" if kind == "gate_up" else "down")
            want = (dst.shape[0], 2 * dst.shape[1], cols) if kind == "gate_up" else (*dst.shape[:-1], cols)
            src = self._stacked(kind, src, want, name, file)
        dst, scale_dst, cols = self.target(banks, None, "gate" if kind == "gate_up" else "down")
        if part == "scale":
            want = tuple(scale_dst.shape) if scale_dst is not None else None
        else:
            want = (*dst.shape[:-1], dst.shape[-1] if is_stored_quantized(src) else cols)
        if want is not None:
            want = (want[0], 2 * want[1], *want[2:]) if kind == "gate_up" else want
            _check_tensor(name, src, want, file, packed=True)
        halves = zip(("gate", "up"), split_gate_up(src, self.interleaved)) if kind == "gate_up" else [(kind, src)]
        for half_kind, half in halves:
            if part == "scale":
                self._write_scales(banks, None, half_kind, half, name, file)
            else:
                self._write_weight(banks, None, half_kind, half, name, file)
        return 0 if part == "scale" else (2 if kind == "gate_up" else 1) * banks.num_experts

    def _write_scales(self, banks, expert, kind: str, src: torch.Tensor, name: str, file: str) -> None:
        _, scale_dst, _ = self.target(banks, expert, kind)
        if scale_dst is None:
            raise LoadError(f"{file}: tensor {name!r} is a block scale, but the experts are not quantized "
                            f"(config.json has no quantization_config)")
        if (src.dtype == torch.uint8) != (scale_dst.dtype == torch.uint8):
            raise LoadError(f"{file}: tensor {name!r} is {src.dtype}, but the {banks.format.name} experts' scales are "
                            f"{scale_dst.dtype}")
        _check_tensor(name, src, scale_dst.shape, file, packed=scale_dst.dtype == torch.uint8)
        scale_dst.copy_(src)
        self.scales += 1 if expert is not None else banks.num_experts

    def _write_weight(self, banks, expert, kind: str, src: torch.Tensor, name: str, file: str) -> None:
        dst, scale_dst, cols = self.target(banks, expert, kind)
        fmt = banks.format
        if is_stored_quantized(src):
            if src.dtype != dst.dtype:
                raise LoadError(f"{file}: tensor {name!r} is {src.dtype}, but config.json's quantization_config "
                                f"makes the experts {fmt.name if fmt.quantized else 'unquantized'}")
            _check_tensor(name, src, dst.shape, file, packed=True)
            dst.copy_(src)
            self.stored += 1 if expert is not None else banks.num_experts
            return
        _check_tensor(name, src, (*dst.shape[:-1], cols), file)
        if fmt.quantized:
            quantized, scales = quantize(src.to(self.device), fmt)
            dst.copy_(quantized)
            scale_dst.copy_(scales)
        else:
            dst.copy_(src)

    def check_scales(self, model_dir: str) -> None:
        if self.stored != self.scales:
            raise LoadError(f"checkpoint in {model_dir}: {self.stored} quantized expert weights but {self.scales} "
                            f"scale tensors (weight_scale_inv, weight_scale, *_scales): each needs its scales")


class _DenseQuantized:
    """Dense (non-expert) weights of a quantized checkpoint (FP8 `weight` + `weight_scale_inv`;
    int4 `weight_packed` + `weight_scale` + `weight_shape`), dequantized to their parameter's
    dtype once the weight and its scales were both read (they may sit in different shards).
    Invariant: a parameter is written only from a complete pair."""

    PARTS = {suffix: part for suffix, part in all_suffixes().items() if suffix.startswith(".")}

    def __init__(self, params: dict, fmt):
        self.params, self.fmt = params, fmt
        self.weights: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}

    def _split(self, name: str) -> tuple[str, str] | None:
        """(parameter name, part) of a quantized linear's tensor name, None if not one."""
        for suffix, part in self.PARTS.items():
            if name.endswith(suffix) and name.removesuffix(suffix) + ".weight" in self.params:
                return name.removesuffix(suffix) + ".weight", part
        return None

    def owns(self, name: str) -> bool:
        """A dense weight's scale, packed words or shape (FP8 weights are recognised by dtype)."""
        return self.fmt is not None and self._split(name) is not None

    def add(self, name: str, tensor: torch.Tensor) -> str | None:
        """Keep a weight or scale; returns the parameter's name when its pair is complete and written."""
        name, part = self._split(name) or (name, "weight")
        param = self.params[name]
        if part == "shape":
            if tensor.tolist() != list(param.shape):
                raise LoadError(f"{name}_shape says {tensor.tolist()}, the model expects {list(param.shape)}")
            return None
        (self.scales if part == "scale" else self.weights)[name] = tensor
        if name not in self.weights or name not in self.scales:
            return None
        weight, scales = self.weights.pop(name), self.scales.pop(name)
        if tuple(scales.shape) != scale_grid(*param.shape, self.fmt.block_shape):
            raise LoadError(f"{name}: scales of shape {tuple(scales.shape)} are not the {self.fmt.block_shape} block "
                            f"grid of its weight {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(self.fmt.dequantize(weight, scales, param.shape[-1]))
        return name

    def check_complete(self, model_dir: str) -> None:
        unpaired = sorted(set(self.weights) | set(self.scales))
        if unpaired:
            raise LoadError(f"checkpoint in {model_dir}: a quantized weight without its scales (weight_scale_inv, "
                            f"weight_scale), or the reverse: {unpaired[:5]}")


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
    dense_quantized = _DenseQuantized(params, checkpoint_format(model.config.hf))
    expert_counts: dict[int, int] = {}
    files = checkpoint_files(model_dir)
    for file in tqdm(files, desc="loading shards", unit="file", disable=len(files) < 2):
        with _open_checkpoint(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if _beyond_cut(name, model.config.num_layers):
                    continue
                target = model.expert_tensor_target(name)
                if target is not None:
                    layer_id, expert, kind, part = target
                    with torch.no_grad():
                        held = writer.write(layer_id, expert, kind, part, lambda: _read_tensor(f, name, file),
                                            name, file)
                    expert_counts[layer_id] = expert_counts.get(layer_id, 0) + held
                    continue
                if dense_quantized.owns(name):
                    expected.discard(dense_quantized.add(name, _read_tensor(f, name, file)))
                    continue
                if name not in params:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name == "lm_head.weight" and model.tie_word_embeddings:
                        continue
                    raise LoadError(f"{file}: tensor {name!r} does not belong to a {model.config.model_type} model")
                src = _read_tensor(f, name, file)
                _check_tensor(name, src, params[name].shape, file)
                if src.dtype == torch.float8_e4m3fn and dense_quantized.fmt is not None:
                    dense_quantized.add(name, src)
                else:
                    with torch.no_grad():
                        params[name].copy_(src)
                expected.discard(name)
    dense_quantized.check_complete(model_dir)
    writer.check_scales(model_dir)
    if expected:
        missing = sorted(expected)
        raise LoadError(f"checkpoint in {model_dir} lacks {len(missing)} tensor(s), first: {missing[:5]}")
    mc = model.config
    for layer_id in mc.moe_layer_ids:
        want = 3 * model.moe_block(layer_id).banks.num_experts  # (a rank's share of them, split across ranks)
        if expert_counts.get(layer_id, 0) != want:
            raise LoadError(f"checkpoint in {model_dir}: layer {layer_id} has {expert_counts.get(layer_id, 0)} of "
                            f"{want} expert tensors (gate, up, down per expert)")
        if model.moe_block(layer_id).banks.w13_bias is not None and writer.biases.get(layer_id, 0) != 2:
            raise LoadError(f"checkpoint in {model_dir}: layer {layer_id} lacks its expert biases (gate_up_proj_bias "
                            f"and down_proj_bias)")


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
            dst, scale_dst, cols = _ExpertWriter.target(banks, expert, kind)
            src = torch.empty((*dst.shape[:-1], cols), dtype=dtype, device=device).normal_(0.0, std, generator=gen)
            quantized, scales = quantize(src, banks.format)
            dst.copy_(quantized)
            scale_dst.copy_(scales)


def load_dummy(model, seed: int, device: torch.device) -> None:
    """Random weights at the config's real shapes: linears ~ N(0, 0.02), norms at 1, expert
    biases too; experts of a quantized format drawn in the compute dtype, then quantized."""
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
            for i, bias in enumerate((banks.w13_bias, banks.w2_bias)):
                if bias is not None:
                    _random_fill(bias, device, seed * 1000 + 2 * layer_id + 500_000 + i)
            if banks.format.quantized:
                _random_fill_quantized(banks, device, model.lm_head.weight.dtype, seed * 1000 + 2 * layer_id)
                continue
            _random_fill(banks.w13, device, seed * 1000 + 2 * layer_id)
            _random_fill(banks.w2, device, seed * 1000 + 2 * layer_id + 1)
