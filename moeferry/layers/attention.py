"""Self-attention with grouped KV heads, RoPE, optional q/k norms, paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from moeferry.engine.batch import ForwardBatch
from moeferry.kernels import attention as attn_ops
from moeferry.layers.norm import RMSNorm
from moeferry.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """q/k/v/o projections and attention over this layer's slice of the paged KV cache.

    `qk_norm` is None, "head" (RMSNorm over each head, Qwen3) or "full" (RMSNorm over the whole
    projection before the head split, OLMoE). Names of the submodules follow the HF checkpoints.
    """

    def __init__(self, mc, layer_id: int, qk_norm: str | None, qkv_bias: bool, rotary: RotaryEmbedding):
        super().__init__()
        h, d = mc.hidden_size, mc.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = mc.num_heads, mc.num_kv_heads, d
        self.layer_id = layer_id
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        eps = getattr(mc.hf, "rms_norm_eps", 1e-6)
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        elif qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(self.num_heads * d, eps), RMSNorm(self.num_kv_heads * d, eps)
        self.clip_qkv = getattr(mc.hf, "clip_qkv", None)
        self.window = mc.sliding_window_of(layer_id)
        self.scale = d ** -0.5
        self.rotary = rotary

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        n = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv) -> torch.Tensor:
        q, k, v = self._project(x, batch.positions)
        k_cache, v_cache = kv.k[self.layer_id], kv.v[self.layer_id]
        k_cache.index_copy_(0, batch.out_slots, k)
        v_cache.index_copy_(0, batch.out_slots, v)
        if batch.is_decode:
            out = attn_ops.decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, kv.page_size,
                                       self.scale, self.window)
        else:
            out = torch.empty_like(q)
            for seq in batch.prefill_seqs:
                rows = slice(seq.row_start, seq.row_start + seq.length)
                out[rows] = attn_ops.prefill_attention(q[rows], k_cache[seq.kv_slots], v_cache[seq.kv_slots],
                                                  seq.pos_start, self.scale, self.window)
        return self.o_proj(out.reshape(x.shape[0], -1))
