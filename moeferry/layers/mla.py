"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged cache of the latent.

Per token the cache holds one row [kv_lora_rank + qk_rope_head_dim]: the normalised latent c
(kv_a_layernorm of the first kv_lora_rank outputs of kv_a_proj_with_mqa) and the rotated rope
key k_pe, shared by every head. Full K/V are never cached:
  k_nope[h] = W_UK[h] c,  v[h] = W_UV[h] c   (kv_b_proj.weight viewed [H, nope + v, rank])
Prefill decompresses its request's latents and runs ordinary attention (compute-bound, fewest
FLOPs); decode absorbs W_UK into the query and W_UV into the output, so attention reads only the
latent rows (kernels/mla): q_lat[h] = W_UK[h]^T q_nope[h] and out[h] = W_UV[h] (softmax(.) c),
with the same scores q_nope.k_nope + q_pe.k_pe as the decompressed form.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeferry.layers.batch import ForwardBatch
from moeferry.kernels import attention as attn_ops
from moeferry.kernels import mla as mla_ops
from moeferry.kernels.norm_rope.common import apply_rotary
from moeferry.layers.linear import Linear
from moeferry.layers.norm import RMSNorm
from moeferry.layers.rotary import RotaryEmbedding, rope_parameters

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: the HF modules' default, not rms_norm_eps


def mla_cache_width(hf) -> int:
    """Elements per token per layer of the latent cache: kv_lora_rank + qk_rope_head_dim."""
    return hf.kv_lora_rank + hf.qk_rope_head_dim


def softmax_scale(hf) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when the rope is scaled."""
    scale = (hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    factor = params.get("factor", 1.0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


def deinterleave_permutation(dim: int) -> torch.Tensor:
    """Indices taking interleaved rope pairs (x0, x1), (x2, x3), ... to the rotate-half layout
    (x0, x2, ..., x1, x3, ...): rotating pairs equals rotate-half RoPE on the permuted vector."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])


class MLAttention(nn.Module):
    """MLA projections and attention over this layer's latent cache `kv.k[layer_id]`
    [slots, 1, kv_lora_rank + qk_rope_head_dim] (there is no value cache).

    Submodule names follow the HF checkpoints: q_proj (no q_lora_rank, V2-Lite) or q_a_proj,
    q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj.

    Invariants: after `after_load`, the rope rows of the q and kv_a projections are in the
    rotate-half layout (DeepSeek's interleaved pairs permuted once, exactly: scores unchanged),
    so one rotary table and `apply_rotary` serve every family; a cached row is written once, at
    the token's slot, before any query reads it.
    """

    def __init__(self, mc, layer_id: int, rotary: RotaryEmbedding, interleaved_rope: bool):
        super().__init__()
        hf, h = mc.hf, mc.hidden_size
        self.layer_id, self.num_heads = layer_id, mc.num_heads
        self.rank, self.nope, self.rope, self.v_dim = (hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim,
                                                       hf.v_head_dim)
        qk, bias = self.nope + self.rope, bool(getattr(hf, "attention_bias", False))
        self.q_lora_rank = getattr(hf, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = Linear(h, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=bias)
        self.interleaved_rope = interleaved_rope
        self.scale = softmax_scale(hf)
        self.rotary = rotary

    @torch.no_grad()
    def after_load(self) -> None:
        """Permute the rope rows of the q and kv_a projections from interleaved pairs to the
        rotate-half layout (once, after loading; no-op for a non-interleaved checkpoint)."""
        if not self.interleaved_rope:
            return
        perm = deinterleave_permutation(self.rope)
        q = self.q_proj if self.q_lora_rank is None else self.q_b_proj
        w = q.weight.view(self.num_heads, self.nope + self.rope, -1)
        w[:, self.nope:] = w[:, self.nope:][:, perm.to(w.device)]
        for p in (self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias):
            if p is not None:
                p[self.rank:] = p[self.rank:][perm.to(p.device)]

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H, nope + rope] before the rotary."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.nope + self.rope)

    def _weights_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, v, rank]: views of kv_b_proj.weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv) -> torch.Tensor:
        n, cache = x.shape[0], kv.k[self.layer_id]
        q_nope, q_pe = self._query(x).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        q_pe, k_pe = apply_rotary(q_pe, k_pe.unsqueeze(1), batch.positions, self.rotary.cos, self.rotary.sin)
        row = torch.cat([self.kv_a_layernorm(latent).unsqueeze(1), k_pe], dim=-1)
        cache.index_copy_(0, batch.out_slots, row.to(cache.dtype))
        if batch.is_decode:
            out = self._decode(q_nope, q_pe, cache, batch, kv.page_size)
        else:
            out = torch.empty(n, self.num_heads, self.v_dim, dtype=x.dtype, device=x.device)
            for seq in batch.prefill_seqs:
                rows = slice(seq.row_start, seq.row_start + seq.length)
                out[rows] = self._prefill(q_nope[rows], q_pe[rows], cache[seq.kv_slots], seq.pos_start)
        return self.o_proj(out.reshape(n, -1))

    def _prefill(self, q_nope, q_pe, rows: torch.Tensor, pos_start: int) -> torch.Tensor:
        """One request's chunk against its latents [Tk, 1, rank + rope], decompressed."""
        tk = rows.shape[0]
        latent, k_pe = rows[:, 0].split([self.rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(latent).view(tk, self.num_heads, -1).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(tk, self.num_heads, self.rope)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return attn_ops.prefill_attention(q, k, v, pos_start, self.scale)

    def _decode(self, q_nope, q_pe, cache, batch: ForwardBatch, page_size: int) -> torch.Tensor:
        """Absorbed form: [B, H, nope] through W_UK into the latent space, attention over the
        latent rows, the result through W_UV. -> [B, H, v]."""
        w_uk, w_uv = self._weights_uk_uv()
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        q = torch.cat([q_lat, q_pe], dim=-1)
        out_lat = mla_ops.mla_decode_attention(q, cache, batch.page_table, batch.seq_lens, page_size,
                                               self.scale, self.rank)
        return torch.einsum("bhr,hvr->bhv", out_lat, w_uv)
