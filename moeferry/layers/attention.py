"""Self-attention with grouped KV heads, RoPE, optional q/k norms, paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from moeferry.layers.batch import ForwardBatch
from moeferry.kernels import attention as attn_ops
from moeferry.kernels import norm_rope
from moeferry.kernels.linear import linear
from moeferry.layers.linear import Linear
from moeferry.layers.norm import RMSNorm
from moeferry.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """q/k/v/o projections and attention over this layer's slice of the paged KV cache.

    `qk_norm` is None, "head" (RMSNorm over each head, Qwen3) or "full" (RMSNorm over the whole
    projection before the head split, OLMoE). Names of the submodules follow the HF checkpoints.

    After loading, `fuse_qkv` stacks the q/k/v weights (and biases) into one [q; k; v] matrix
    and makes the three projections' parameters views of it: one GEMM per forward, no extra
    memory, and the state dict unchanged. It also keeps `sinks` (gpt-oss) as float32 for the
    kernels, once: a captured graph reads that storage. Projections go through kernels/linear.py (Linear, and
    the fused call), so decode-sized batches on CUDA take the skinny Triton kernel.
    """

    def __init__(self, mc, layer_id: int, qk_norm: str | None, qkv_bias: bool, rotary: RotaryEmbedding, *,
                 o_bias: bool = False, sinks: bool = False):
        super().__init__()
        h, d = mc.hidden_size, mc.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = mc.num_heads, mc.num_kv_heads, d
        self.layer_id = layer_id
        self.q_proj = Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=o_bias)
        # gpt-oss: a learned logit per query head in every softmax denominator (kernels/attention)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if sinks else None
        self.sink_logits: torch.Tensor | None = None
        eps = self.norm_eps = getattr(mc.hf, "rms_norm_eps", 1e-6)
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        elif qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(self.num_heads * d, eps), RMSNorm(self.num_kv_heads * d, eps)
        self.clip_qkv = getattr(mc.hf, "clip_qkv", None)
        self.window = mc.sliding_window_of(layer_id)
        self.scale = d ** -0.5
        self.rotary = rotary
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    @torch.no_grad()
    def fuse_qkv(self) -> None:
        """Stack q/k/v into one projection (call once the weights are loaded)."""
        if self.sinks is not None:
            self.sink_logits = self.sinks.detach().float().contiguous()
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = torch.cat([p.weight for p in projections])
        if self.q_proj.bias is not None:
            self.qkv_bias = torch.cat([p.bias for p in projections])
        for p, rows in zip(projections, self.qkv_weight.split(self._qkv_sizes())):
            p.weight.data = rows
        if self.qkv_bias is not None:
            for p, part in zip(projections, self.qkv_bias.split(self._qkv_sizes())):
                p.bias.data = part

    def _qkv_sizes(self) -> list[int]:
        d = self.head_dim
        return [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]

    def _project(self, x: torch.Tensor):
        """q [N, Hq, D], k, v [N, Hkv, D] before the per-head norm and rotary (views of one
        fused projection once `fuse_qkv` ran)."""
        n = x.shape[0]
        if self.qkv_weight is not None:
            q, k, v = linear(x, self.qkv_weight, self.qkv_bias).split(self._qkv_sizes(), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return (q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim),
                v.view(n, self.num_kv_heads, self.head_dim))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv) -> torch.Tensor:
        q, k, v = self._project(x)
        k_cache, v_cache = kv.k[self.layer_id], kv.v[self.layer_id]
        head_norm = self.qk_norm == "head"
        # per-head q/k norm, rotary, and the K/V store at the tokens' slots: one launch on CUDA
        q, _ = norm_rope.qk_norm_rope_store(
            q, k, v, batch.positions, self.rotary.cos, self.rotary.sin, k_cache, v_cache, batch.out_slots,
            q_norm_weight=self.q_norm.weight if head_norm else None,
            k_norm_weight=self.k_norm.weight if head_norm else None,
            eps=self.norm_eps)
        sinks = self.sink_logits if self.sinks is None or self.sink_logits is not None else self.sinks.float()
        if batch.is_decode:
            out = attn_ops.decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, kv.page_size,
                                       self.scale, self.window, sinks)
        else:
            out = torch.empty_like(q)
            for seq in batch.prefill_seqs:
                rows = slice(seq.row_start, seq.row_start + seq.length)
                out[rows] = attn_ops.prefill_attention(q[rows], k_cache[seq.kv_slots], v_cache[seq.kv_slots],
                                                  seq.pos_start, self.scale, self.window, sinks)
        return self.o_proj(out.reshape(x.shape[0], -1))
