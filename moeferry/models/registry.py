"""Model families: each registers a FamilySpec saying only what differs from the shared
decoder (models/decoder.py). `family_names()` lists the supported HF model_types."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from moeferry.kernels.fused_moe import SILU, Activation

_FAMILY_MODULES = {
    "qwen3_moe": "moeferry.models.qwen3_moe",
    "mixtral": "moeferry.models.mixtral",
    "olmoe": "moeferry.models.olmoe",
    "qwen2_moe": "moeferry.models.qwen2_moe",
    "deepseek_v2": "moeferry.models.deepseek",
    "deepseek_v3": "moeferry.models.deepseek",
    "kimi_k2": "moeferry.models.deepseek",
    "gpt_oss": "moeferry.models.gpt_oss",
}

# model_types transformers has no config class for (their checkpoints ship remote code), read
# with the config class of the family they copy: Kimi-K2 is DeepSeek-V3's architecture.
CONFIG_ALIASES = {"kimi_k2": "deepseek_v3"}


@dataclass(frozen=True)
class FamilySpec:
    """What one family changes in the shared decoder.

    qk_norm: None | "head" | "full"; qkv_bias(hf) and renormalize(hf) read the config;
    moe_prefix: the checkpoint's name of the MoE block ("mlp", "block_sparse_moe");
    expert_names: checkpoint names of (gate, up, down) inside one expert;
    attention(mc, layer_id, rotary): the family's attention module, None for the shared
    grouped-query Attention (DeepSeek: layers/mla.py's MLAttention);
    router(mc): the family's router module, None for softmax top-k over a Linear gate (a Linear
    it returns takes that path too, with its bias); router_name: the router's checkpoint name;
    shared_experts_size(hf): intermediate rows of ungated shared experts (DeepSeek), 0 for none;
    expert_bias: the routed experts have biases on both GEMMs (bias banks, gpt-oss);
    activation(hf): how an expert's gate and up rows combine (kernels/fused_moe Activation);
    stacked_experts(kind, tensor): a stacked checkpoint tensor of every expert (kind gate_up,
    down, gate_up_bias, down_bias) as rows ([E, 2I, H], [E, H, I], [E, 2I], [E, H]), the gate
    and up rows still in the checkpoint's order; None when the checkpoint stores rows already.
    gate_up_interleaved: a stacked gate_up tensor's rows alternate gate, up (gpt-oss) instead of
    all gate rows, then all up rows (engine/loader.py: split_gate_up).
    """

    model_type: str
    qk_norm: str | None
    qkv_bias: Callable[[object], bool]
    renormalize: Callable[[object], bool]
    shared_expert: bool = False
    moe_prefix: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    attention: Callable[..., object] | None = None
    router: Callable[[object], object] | None = None
    shared_experts_size: Callable[[object], int] = lambda hf: 0
    router_name: str = "gate"
    expert_bias: bool = False
    activation: Callable[[object], Activation] = lambda hf: SILU
    stacked_experts: Callable[[str, object], object] | None = None
    gate_up_interleaved: bool = False


def family_names() -> list[str]:
    return list(_FAMILY_MODULES)


def get_family(model_type: str) -> FamilySpec:
    module = importlib.import_module(_FAMILY_MODULES[model_type])
    return getattr(module, "SPECS", {}).get(model_type) or module.SPEC
