"""The decoder shared by every MoE family: embedding, N x (attention, MLP or MoE), norm, LM head.

Module names follow the HF checkpoints (model.layers.N.self_attn.q_proj, ...), so the loader
maps most tensors by name; only the stacked expert banks need a mapping (expert_tensor_target).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from moeferry.layers.batch import ForwardBatch
from moeferry.layers.attention import Attention
from moeferry.layers.moe import DenseMLP, MoEBlock
from moeferry.layers.norm import RMSNorm
from moeferry.layers.rotary import RotaryEmbedding
from moeferry.models.registry import FamilySpec, get_family
from moeferry.moe.formats import all_suffixes


class DecoderLayer(nn.Module):
    def __init__(self, mc, spec: FamilySpec, layer_id: int, strategy, rotary: RotaryEmbedding):
        super().__init__()
        eps = getattr(mc.hf, "rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(mc.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, eps)
        if spec.attention is None:
            self.self_attn = Attention(mc, layer_id, spec.qk_norm, spec.qkv_bias(mc.hf), rotary)
        else:
            self.self_attn = spec.attention(mc, layer_id, rotary)
        if mc.is_moe_layer(layer_id):
            mlp = MoEBlock(mc, layer_id, strategy, spec.renormalize(mc.hf), spec.shared_expert,
                           router=spec.router(mc) if spec.router else None,
                           shared_experts_size=spec.shared_experts_size(mc.hf), router_name=spec.router_name,
                           expert_bias=spec.expert_bias, activation=spec.activation(mc.hf))
        else:
            mlp = DenseMLP(mc.hidden_size, mc.hf.intermediate_size)
        self.is_moe = mc.is_moe_layer(layer_id)
        self.mlp_name = spec.moe_prefix if self.is_moe else "mlp"
        self.add_module(self.mlp_name, mlp)

    @property
    def mlp_module(self) -> nn.Module:
        return getattr(self, self.mlp_name)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                kv) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings at layer 0, with residual None;
        after a MoE block without shared expert its per-route outputs [T, K, H]); residual:
        the stream it adds to. Returns this layer's (MLP output, stream before it): each
        residual add, and a MoE block's sum over its routes, is fused into the norm that
        follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(h, batch, kv), residual)
        out = self.mlp_module(h, batch.is_decode, sum_routes=False) if self.is_moe else self.mlp_module(h)
        return out, residual


class DecoderBody(nn.Module):
    def __init__(self, mc, spec, strategy, max_positions: int):
        super().__init__()
        rotary = RotaryEmbedding(mc.hf, mc.head_dim, max_positions)
        self.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(mc, spec, i, strategy, rotary) for i in range(mc.num_layers))
        self.norm = RMSNorm(mc.hidden_size, getattr(mc.hf, "rms_norm_eps", 1e-6))
        self.rotary = rotary


# A stacked expert tensor of every expert -> (kind, part): gpt-oss's weights (the part follows
# the suffix: bf16 `gate_up_proj`, or MXFP4 `gate_up_proj_blocks` / `_scales`) and biases
_STACKED_LEAVES = {"gate_up_proj": ("gate_up", None), "down_proj": ("down", None),
                   "gate_up_proj_bias": ("gate_up", "bias"), "down_proj_bias": ("down", "bias")}

# A (quantized) linear's checkpoint tensors -> what they hold (engine/loader.py): the plain weight
# and every expert format's own suffixes (moe/formats)
_TENSOR_PARTS = {".weight": "weight", **all_suffixes()}
_DOT_SUFFIXES = "|".join(sorted((re.escape(k[1:]) for k in _TENSOR_PARTS if k.startswith(".")), key=len, reverse=True))
_UNDERSCORE_SUFFIXES = "|".join(re.escape(k[1:]) for k in _TENSOR_PARTS if k.startswith("_"))


class MoECausalLM(nn.Module):
    """A causal LM of one registered family. forward(batch, kv) -> logits [len(logits_rows), V] (float32)."""

    def __init__(self, mc, strategy, max_positions: int):
        super().__init__()
        self.spec = get_family(mc.model_type)
        self.config = mc
        self.model = DecoderBody(mc, self.spec, strategy, max_positions)
        self.tie_word_embeddings = bool(getattr(mc.hf, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(mc.hidden_size, mc.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._expert_pattern = re.compile(
            rf"model\.layers\.(\d+)\.{re.escape(self.spec.moe_prefix)}\.experts\.(?:(\d+)\.)?([A-Za-z0-9_]+?)"
            rf"(?:\.({_DOT_SUFFIXES})|_({_UNDERSCORE_SUFFIXES}))?$"
        )

    def forward(self, batch: ForwardBatch, kv) -> torch.Tensor:
        return self.logits(self.hidden(batch, kv))

    def hidden(self, batch: ForwardBatch, kv) -> torch.Tensor:
        """The final (normed) hidden states of the batch's `logits_rows` [len(logits_rows), H]."""
        x, residual = self.model.embed_tokens(batch.input_ids), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, batch, kv)
        rows = batch.logits_rows
        x, _ = self.model.norm.add_and_norm(x[rows], residual[rows])
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, V] of final hidden states."""
        return self.lm_head(hidden).float()

    def expert_tensor_target(self, name: str):
        """Map a checkpoint tensor name onto an expert bank: (layer_id, expert or None, kind, part)
        where kind is gate/up/down (one expert) or gate_up/down (all experts stacked) and part is
        "weight" (`weight`, int4's `weight_packed`, MXFP4's stacked `*_blocks`), "scale" (FP8's
        `weight_scale_inv`, int4's `weight_scale`, MXFP4's `*_scales`), "shape" (int4's
        `weight_shape`) or "bias" (gpt-oss's stacked biases); None if not an expert."""
        m = self._expert_pattern.match(name)
        if m is None:
            return None
        layer_id, expert, leaf = int(m.group(1)), m.group(2), m.group(3)
        suffix = "." + m.group(4) if m.group(4) else "_" + m.group(5) if m.group(5) else ".weight"
        part = _TENSOR_PARTS[suffix]
        gate, up, down = self.spec.expert_names
        if expert is not None:
            kind = {gate: "gate", up: "up", down: "down"}.get(leaf)
            return None if kind is None else (layer_id, int(expert), kind, part)
        kind, stacked_part = _STACKED_LEAVES.get(leaf, (None, None))  # a bias, or the suffix's part
        return None if kind is None else (layer_id, None, kind, stacked_part or part)

    def moe_block(self, layer_id: int) -> MoEBlock:
        return self.model.layers[layer_id].mlp_module
