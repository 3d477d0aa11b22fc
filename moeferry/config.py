"""Configuration: the model's shape (read from config.json through transformers) and the
engine's options (built once from the CLI or from LLM keyword arguments, then frozen)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A user-facing configuration mistake; its message says what to change."""


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option; CLI flags and `LLM(**kwargs)` map one to one onto these fields.

    Invariant: built once and never mutated; derived values are properties. Validation that
    needs the model (for example a cache smaller than one layer's experts) happens in
    `resolve()` against a ModelConfig.
    """

    model: str | None = None
    load_format: str = "auto"  # auto | safetensors | dummy
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    # MoE
    moe_strategy: str = "gpu"
    moe_cache_slots: int | None = None
    moe_cache_gb: float | None = None
    moe_cache_policy: str = "layer_lru"  # layer_lru | lru | lrfu (moe/slot_cache.py, docs/offload.md)
    moe_lrfu_decay: float = 0.5
    moe_collect_stats: bool = False
    moe_prefill_demand_tokens: int | str = 0  # a token count, or "auto"
    # memory budget
    memory_ratio: float = 0.9
    vram_reserve_mb: int = 1024
    kv_reserve_tokens: int | None = None
    # KV cache and batching
    page_size: int = 16
    num_tokens: int | None = None  # KV capacity in tokens; None: from the planner
    max_running_requests: int = 8
    max_prefill_tokens: int = 2048
    max_model_len: int | None = None
    disable_cuda_graph: bool = False

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**kwargs)

    @cached_property
    def torch_device(self):
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda asked for, but torch sees no CUDA GPU")
        return torch.device(self.device)

    @cached_property
    def torch_dtype(self):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        except KeyError:
            raise ConfigError(f"--dtype {self.dtype!r}: choose auto, float32, bfloat16 or float16") from None

    @property
    def use_cuda_graph(self) -> bool:
        return self.torch_device.type == "cuda" and not self.disable_cuda_graph


DEFAULT_MAX_MODEL_LEN = 8192


def resolve_max_model_len(ec: EngineConfig, mc: "ModelConfig") -> int:
    """The context length served: --max-model-len, else the model's, capped at 8,192 tokens
    (the rotary tables, page tables and KV plan are sized by it)."""
    return ec.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


# Options that only mean something for a model with routed experts.
_MOE_OPTION_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name.startswith("moe_")}


def reset_moe_options_for_dense(config: EngineConfig) -> EngineConfig:
    """A dense model ignores every MoE flag: reset them to their defaults, with a warning."""
    changed = {k: v for k, v in _MOE_OPTION_DEFAULTS.items() if getattr(config, k) != v}
    if not changed:
        return config
    logger.warning("dense model: ignoring MoE option(s) %s", ", ".join(f"--{k.replace('_', '-')}" for k in changed))
    return config.replace(**changed)


def _hf_field(name: str) -> property:
    """A ModelConfig attribute read straight from the transformers config's field `name`."""
    return property(lambda self: getattr(self.hf, name), doc=f"config.json's {name}")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one checkpoint, read from its config.json by transformers.

    `hf` is the transformers PretrainedConfig (with --hf-overrides merged in); the fields
    here are the values the engine needs, normalised across families.
    """

    path: str
    hf: Any

    @classmethod
    def from_dir(cls, path: str, overrides: dict[str, Any] | None = None) -> "ModelConfig":
        if not os.path.isdir(path):
            raise ConfigError(f"model directory {path!r} does not exist")
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ConfigError(f"{path!r} has no config.json: not a Hugging Face checkpoint directory")
        with open(cfg_file) as f:
            raw = json.load(f)
        model_type = raw.get("model_type")
        from moeferry.models.registry import family_names

        if model_type not in family_names():
            raise ConfigError(
                f"{cfg_file}: model_type {model_type!r} is not supported; supported: {', '.join(family_names())}"
            )
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path, local_files_only=True)
        for key, value in (overrides or {}).items():
            setattr(hf, key, value)
        if "num_hidden_layers" in (overrides or {}) and getattr(hf, "layer_types", None):
            hf.layer_types = list(hf.layer_types)[: hf.num_hidden_layers]
        return cls(path=path, hf=hf)

    model_type = _hf_field("model_type")
    hidden_size = _hf_field("hidden_size")
    num_layers = _hf_field("num_hidden_layers")
    num_heads = _hf_field("num_attention_heads")

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf, "num_key_value_heads", None) or self.num_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.hf, "head_dim", None) or self.hidden_size // self.num_heads

    vocab_size = _hf_field("vocab_size")

    @property
    def num_experts(self) -> int:
        return getattr(self.hf, "num_experts", None) or getattr(self.hf, "num_local_experts", 0) or 0

    top_k = _hf_field("num_experts_per_tok")

    @property
    def moe_intermediate_size(self) -> int:
        return getattr(self.hf, "moe_intermediate_size", None) or self.hf.intermediate_size

    @property
    def max_position_embeddings(self) -> int:
        return getattr(self.hf, "max_position_embeddings", 4096)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = getattr(self.hf, "eos_token_id", None)
        if eos is None:
            return ()
        ids = eos if isinstance(eos, (list, tuple)) else [eos]
        return tuple(int(i) for i in ids if 0 <= int(i) < self.vocab_size)

    def is_moe_layer(self, layer_id: int) -> bool:
        if self.num_experts == 0:
            return False
        if layer_id in (getattr(self.hf, "mlp_only_layers", None) or []):
            return False
        step = getattr(self.hf, "decoder_sparse_step", 1) or 1
        return (layer_id + 1) % step == 0

    @cached_property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layer_ids)

    def sliding_window_of(self, layer_id: int) -> int | None:
        """The attention window of a layer in tokens, or None for full attention."""
        window = getattr(self.hf, "sliding_window", None)
        if not window:
            return None
        layer_types = getattr(self.hf, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[layer_id] == "sliding_attention" else None
        if getattr(self.hf, "use_sliding_window", True) is False:
            return None
        return window
