"""Rotary position embedding with cos/sin tables precomputed for every position.

Frequencies come from transformers' own rope initialisers (default, linear, dynamic, yarn,
llama3, ...), so every rope_scaling a config uses matches the reference implementation.
"""

import torch
from torch import nn


def rope_parameters(hf_config) -> dict:
    """The config's rope parameters (rope_type, rope_theta, factor, ...), old or new spelling."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    scaling.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return scaling


def inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2], attention_scaling) for the config's rope type."""
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of rotate-half RoPE, one row per position; attention applies them with
    kernels.norm_rope.qk_norm_rope_store.

    Invariant: the cos/sin tables cover positions [0, max_positions); they are buffers
    built once, so a captured graph reads the same storage at every replay.
    """

    def __init__(self, hf_config, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
