"""Attention over the paged KV cache.

decode_attention: one query row per request against its pages (Triton kernel on CUDA, the
reference elsewhere: kernels/attention/triton.py, reference.py; `impl` names one).
prefill_attention: a chunk of queries against its request's prefix and itself: torch's
scaled_dot_product_attention on CUDA (flash / memory-efficient kernels), the reference
otherwise; ``use_sdpa`` forces either.

``sinks`` (gpt-oss): None, or a float32 logit per query head [Hq] that joins every row's softmax
denominator (kernels/attention/reference.py); both ops and every path take it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeferry.kernels import implementation
from moeferry.kernels.attention import reference

__all__ = ["decode_attention", "prefill_attention", "sdpa_prefill_attention"]

# enable_gqa arrived in torch 2.5 and only the flash kernel (fp16/bf16, no mask) honours it;
# anywhere else it falls back to the math kernel, slower than repeating the kv heads.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     seq_lens: torch.Tensor, page_size: int, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None, *, impl: str | None = None) -> torch.Tensor:
    """q [B, Hq, D]; caches [slots, Hkv, D]; page_table [B, P]; seq_lens [B] (new token included)
    -> [B, Hq, D]. Fixed shapes and no host sync on either path: CUDA-graph capturable."""
    return implementation("attention", q, impl).decode_attention(q, k_cache, v_cache, page_table, seq_lens,
                                                                 page_size, scale, window, sinks=sinks)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
                      window: int | None = None, sinks: torch.Tensor | None = None, *,
                      use_sdpa: bool | None = None) -> torch.Tensor:
    """q [Tq, Hq, D] at positions [q_start, q_start+Tq); k, v [Tk, Hkv, D] at [0, Tk). -> [Tq, Hq, D]."""
    if q.is_cuda if use_sdpa is None else use_sdpa:
        if sinks is not None:
            return _sdpa_with_sinks(q, k, v, q_start, scale, window, sinks)
        return sdpa_prefill_attention(q, k, v, q_start, scale, window)
    return reference.prefill_attention(q, k, v, q_start, scale, window, sinks)


def _sdpa_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
                     window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """Prefill with sinks through SDPA: each sink is a virtual key that every query sees, scored
    exactly the sink. Its head width grows by one column (padded to a multiple of 8 for the
    fused kernels): queries get 1 there, real keys 0, the virtual key sink / scale and zeros
    elsewhere, its value zero; so its score is (1 * sink / scale) * scale and it adds to the
    denominator only. Kv heads are repeated (a sink is per query head). sink / scale rounds to
    q's dtype; at gpt-oss's head width of 64 the scale is 1/8 and the product is exact."""
    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    width = (d + 1 + 7) // 8 * 8
    rep = hq // hkv
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    qq = q.new_zeros(tq, hq, width)
    qq[..., :d], qq[..., d] = q, 1.0
    kk = k.new_zeros(tk + 1, hq, width)
    kk[1:, :, :d], kk[0, :, d] = k, (sinks.float() / scale).to(k.dtype)
    vv = v.new_zeros(tk + 1, hq, width)
    vv[1:, :, :d] = v
    q_pos = torch.arange(q_start, q_start + tq, device=q.device)
    mask = torch.ones(tq, tk + 1, dtype=torch.bool, device=q.device)
    mask[:, 1:] = reference._window_mask(q_pos, torch.arange(tk, device=q.device), window)
    out = F.scaled_dot_product_attention(qq.transpose(0, 1)[None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale)  # 4-D: the fused kernels take no other
    return out[0].transpose(0, 1)[..., :d]


def sdpa_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
                           window: int | None = None) -> torch.Tensor:
    """The reference's prefill through F.scaled_dot_product_attention.

    A whole prompt (q_start 0, Tk == Tq, no window) is plain causal: is_causal lets SDPA pick
    the flash kernel, which takes grouped kv heads as they are (fp16/bf16). A chunk after a prefix, or a
    sliding window, needs an explicit [Tq, Tk] boolean mask (True = attend; every query sees
    at least itself, so no row is empty); the memory-efficient kernel that takes a mask does
    not group heads, so kv heads are repeated for it. The fused kernels take only 4-D inputs
    ([batch, heads, tokens, dim]; 3-D ones fall to the math kernel, which computes bf16 in
    float32), hence the batch of one.
    """
    tq, hq, _ = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    rep = hq // hkv
    qh = q.transpose(0, 1)[None]  # [1, Hq, Tq, D]
    causal = q_start == 0 and tk == tq and not window
    if causal and (rep == 1 or (_SDPA_GQA and q.dtype in _FLASH_DTYPES)):
        kwargs = {"enable_gqa": True} if rep > 1 else {}
        out = F.scaled_dot_product_attention(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                                             scale=scale, **kwargs)
        return out[0].transpose(0, 1)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = None
    if not causal:
        q_pos = torch.arange(q_start, q_start + tq, device=q.device)
        k_pos = torch.arange(tk, device=q.device)
        mask = reference._window_mask(q_pos, k_pos, window)
    out = F.scaled_dot_product_attention(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                                         is_causal=causal, scale=scale)
    return out[0].transpose(0, 1)
