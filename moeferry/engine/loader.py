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
    down -> w2[e]; stacked gate_up [E, 2I, H] and down [E, H, I] land whole."""

    def __init__(self, model):
        self.model = model

    def target(self, layer_id: int, expert, kind: str, name: str, file: str):
        banks = getattr(self.model.moe_block(layer_id), "banks", None)
        if banks is None:
            raise LoadError(f"{file}: tensor {name!r} is an expert of layer {layer_id}, which the model's config "
                            f"makes a dense layer")
        if expert is not None and not 0 <= expert < banks.num_experts:
            raise LoadError(f"{file}: tensor {name!r} is expert {expert}, but the model has {banks.num_experts} "
                            f"experts per layer")
        inter = banks.w2.shape[2]
        if expert is None:
            return banks.w13 if kind == "gate_up" else banks.w2
        if kind == "gate":
            return banks.w13[expert, :inter]
        if kind == "up":
            return banks.w13[expert, inter:]
        return banks.w2[expert]


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def _beyond_cut(name: str, num_layers: int) -> bool:
    """A tensor of a layer past --hf-overrides' num_hidden_layers: the cut model skips it."""
    m = _LAYER_INDEX.match(name)
    return m is not None and int(m.group(1)) >= num_layers


def load_safetensors(model, model_dir: str) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    if model.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    expected = set(params)
    writer = _ExpertWriter(model)
    expert_counts: dict[int, int] = {}
    files = checkpoint_files(model_dir)
    for file in tqdm(files, desc="loading shards", unit="file", disable=len(files) < 2):
        with _open_checkpoint(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if _beyond_cut(name, model.config.num_layers):
                    continue
                target = model.expert_tensor_target(name)
                if target is not None:
                    layer_id, expert, kind = target
                    dst = writer.target(layer_id, expert, kind, name, file)
                    src = _read_tensor(f, name, file)
                    _check_tensor(name, src, dst.shape, file)
                    dst.copy_(src)
                    expert_counts[layer_id] = expert_counts.get(layer_id, 0) + (1 if expert is not None else 3 * dst.shape[0])
                    continue
                if name not in params:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name == "lm_head.weight" and model.tie_word_embeddings:
                        continue
                    raise LoadError(f"{file}: tensor {name!r} does not belong to a {model.config.model_type} model")
                src = _read_tensor(f, name, file)
                _check_tensor(name, src, params[name].shape, file)
                with torch.no_grad():
                    params[name].copy_(src)
                expected.discard(name)
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


def load_dummy(model, seed: int, device: torch.device) -> None:
    """Random weights at the config's real shapes: linears ~ N(0, 0.02), norms at 1."""
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
            _random_fill(banks.w13, device, seed * 1000 + 2 * layer_id)
            _random_fill(banks.w2, device, seed * 1000 + 2 * layer_id + 1)
