"""A trainable Qwen3-MoE in plain torch, written for small models: every expert runs on every
token (a batched matmul over the stacked experts) and the router's top-k weights, zero
elsewhere, mix their outputs. That is the sparse model's exact function and gradient at
the cost of E/k times its expert FLOPs, which at this size is cheaper than any sparse
dispatch, and it has no data-dependent shapes.

Invariant: ``hf_state_dict()``, saved with the Qwen3MoeConfig of the same architecture (tied
embeddings), loads into transformers' Qwen3MoeForCausalLM and computes the same logits
(tests/training/).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeferry.kernels.norm_rope.common import rms_norm, rotate_half


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [..., T, D] with cos, sin [T, D] of x's dtype."""
    return x * cos + rotate_half(x) * sin


class Block(nn.Module):
    """One decoder layer: attention (q/k RMSNorm, RoPE, GQA) and a top-k MoE, pre-norm residuals."""

    def __init__(self, c):
        super().__init__()
        h, d, e, i = c.hidden_size, c.head_dim, c.num_experts, c.moe_intermediate_size
        self.heads, self.kv_heads, self.head_dim, self.top_k = c.num_attention_heads, c.num_key_value_heads, d, c.num_experts_per_tok
        self.eps = c.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_norm = nn.Parameter(torch.ones(h))
        self.q = nn.Linear(h, self.heads * d, bias=False)
        self.k = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = nn.Parameter(torch.ones(d))
        self.k_norm = nn.Parameter(torch.ones(d))
        self.router = nn.Linear(h, e, bias=False)
        self.w_gate = nn.Parameter(torch.empty(e, i, h))
        self.w_up = nn.Parameter(torch.empty(e, i, h))
        self.w_down = nn.Parameter(torch.empty(e, h, i))

    def attention(self, x, cos, sin):
        b, t, _ = x.shape
        q = rms_norm(self.q(x).view(b, t, self.heads, self.head_dim), self.q_norm, self.eps).transpose(1, 2)
        k = rms_norm(self.k(x).view(b, t, self.kv_heads, self.head_dim), self.k_norm, self.eps).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))

    def moe(self, x):
        """(output, router probabilities [tokens, E], chosen mask [tokens, E])."""
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)  # norm_topk_prob
        mix = torch.zeros_like(probs).scatter(1, top_i, top_w).to(x.dtype)  # [N, E]
        gate = torch.einsum("nh,eih->eni", flat, self.w_gate)
        up = torch.einsum("nh,eih->eni", flat, self.w_up)
        down = torch.einsum("eni,ehi->enh", F.silu(gate) * up, self.w_down)
        out = torch.einsum("enh,ne->nh", down, mix)
        return out.view_as(x), probs, mix > 0

    def forward(self, x, cos, sin):
        x = x + self.attention(rms_norm(x, self.input_norm, self.eps), cos, sin)
        moe_out, probs, chosen = self.moe(rms_norm(x, self.post_norm, self.eps))
        return x + moe_out, probs, chosen


class TrainableQwen3Moe(nn.Module):
    """Qwen3-MoE with tied embeddings, every layer sparse. ``config`` is any object with the
    Qwen3MoeConfig attribute names (``moeferry.training.train.Architecture``), so training
    needs no transformers. ``forward(ids)`` returns (logits [B, T, V], load-balancing loss)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.final_norm = nn.Parameter(torch.ones(config.hidden_size))
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if "norm" not in name:
                nn.init.normal_(p, 0.0, std)
        for block in self.blocks:  # residual branches scaled by depth (GPT-2's rule)
            nn.init.normal_(block.o.weight, 0.0, std / (2 * len(self.blocks)) ** 0.5)
            nn.init.normal_(block.w_down, 0.0, std / (2 * len(self.blocks)) ** 0.5)

    def rope(self, t: int, dtype):
        freqs = torch.outer(torch.arange(t, device=self.inv_freq.device, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, ids: torch.Tensor):
        x = self.embed(ids)
        cos, sin = self.rope(ids.shape[1], x.dtype)
        balance = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, probs, chosen = block(x, cos, sin)
            balance = balance + load_balancing_loss(probs, chosen)
        logits = rms_norm(x, self.final_norm, self.config.rms_norm_eps) @ self.embed.weight.T
        return logits, balance / len(self.blocks)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under transformers' Qwen3-MoE checkpoint names (one tensor per expert
        projection, as the published checkpoints store them)."""
        out = {"model.embed_tokens.weight": self.embed.weight, "model.norm.weight": self.final_norm,
               "lm_head.weight": self.embed.weight}
        for n, b in enumerate(self.blocks):
            p = f"model.layers.{n}."
            out.update({p + "input_layernorm.weight": b.input_norm, p + "post_attention_layernorm.weight": b.post_norm,
                        p + "self_attn.q_proj.weight": b.q.weight, p + "self_attn.k_proj.weight": b.k.weight,
                        p + "self_attn.v_proj.weight": b.v.weight, p + "self_attn.o_proj.weight": b.o.weight,
                        p + "self_attn.q_norm.weight": b.q_norm, p + "self_attn.k_norm.weight": b.k_norm,
                        p + "mlp.gate.weight": b.router.weight})
            for e in range(b.w_gate.shape[0]):
                q = f"{p}mlp.experts.{e}."
                out.update({q + "gate_proj.weight": b.w_gate[e], q + "up_proj.weight": b.w_up[e],
                            q + "down_proj.weight": b.w_down[e]})
        return {k: v.detach() for k, v in out.items()}


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Switch-style auxiliary loss, E * sum_e (share of routes to e) * (mean probability of e):
    1 when routing is uniform, larger when a few experts take most tokens."""
    num_experts = probs.shape[-1]
    route_share = chosen.float().mean(0) / chosen.float().sum(-1).mean()
    return num_experts * (route_share * probs.mean(0)).sum()
