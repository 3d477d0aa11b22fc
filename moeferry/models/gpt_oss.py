"""gpt-oss: grouped-query attention with biases on q/k/v/o and a learned sink logit per query
head (kernels/attention), sliding-window and full layers alternating (`layer_types`,
ModelConfig.sliding_window_of), YaRN rope (layers/rotary.py), no q/k norm; a router with a bias
that takes the top-k logits and softmaxes over them (the renormalised softmax top-k, which is
the same weights), named `router`; experts with biases on both GEMMs and the clamped SwiGLU
(kernels/fused_moe: clamped_swiglu(swiglu_alpha, swiglu_limit)).

The checkpoint stacks every expert of a layer, transposed, with gate and up interleaved along
the last dimension: gate_up_proj [E, H, 2I] (gate = [..., ::2], up = [..., 1::2]),
gate_up_proj_bias [E, 2I] alike, down_proj [E, I, H], down_proj_bias [E, H]; `_stacked`
transposes the weights to rows once, at load. The released checkpoints' MXFP4 experts
(`*_blocks` [E, rows, K/32, 16] bytes, `*_scales` [E, rows, K/32]) are rows already. In every
format the interleaved gate and up rows (and biases) are split by `gate_up_interleaved`
(engine/loader.py: split_gate_up).
"""

import torch

from moeferry.kernels.fused_moe import clamped_swiglu
from moeferry.layers.attention import Attention
from moeferry.layers.linear import Linear
from moeferry.models.registry import FamilySpec

# The clamped SwiGLU's alpha and limit of every released gpt-oss. The released config.json
# files leave alpha out; transformers versions whose config has no such fields hard-code both.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def _model_wide(hf, name: str, default: float) -> float:
    """A config value every layer shares. Some transformers versions treat the SwiGLU values of
    a config with `layer_types` as per-layer and refuse the model-wide read; the first layer's
    config then has it. Without either, `default`."""
    for config in (hf, *(getattr(hf, "per_layer_config", None) or ())[:1]):
        try:
            return getattr(config, name)
        except AttributeError:
            pass
    return default


def _activation(hf):
    return clamped_swiglu(_model_wide(hf, "swiglu_alpha", SWIGLU_ALPHA), _model_wide(hf, "swiglu_limit", SWIGLU_LIMIT))


def _stacked(kind: str, t: torch.Tensor) -> torch.Tensor:
    """The bf16 checkpoint's stacked experts ([E, K, out]) as rows ([E, out, K]); the gate and up
    rows stay interleaved, as in every format (gate_up_interleaved splits them at load)."""
    return t.transpose(1, 2) if kind in ("gate_up", "down") else t


SPEC = FamilySpec(
    model_type="gpt_oss",
    qk_norm=None,
    qkv_bias=lambda hf: bool(getattr(hf, "attention_bias", True)),
    renormalize=lambda hf: True,
    attention=lambda mc, layer_id, rotary: Attention(mc, layer_id, None, bool(getattr(mc.hf, "attention_bias", True)),
                                                     rotary, o_bias=bool(getattr(mc.hf, "attention_bias", True)),
                                                     sinks=True),
    router=lambda mc: Linear(mc.hidden_size, mc.num_experts, bias=True),
    router_name="router",
    expert_bias=True,
    activation=_activation,
    stacked_experts=_stacked,
    gate_up_interleaved=True,
)
