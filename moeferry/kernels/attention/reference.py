"""Plain-torch attention over the paged KV cache (the oracle, and the CPU path).

prefill_attention: one request's chunk of queries against its cached keys (prefix + chunk).
decode_attention: one query per request against its pages; fixed shapes (the whole page
table is gathered and masked by length), so it captures in a CUDA graph.

`sinks` (gpt-oss): None, or a learned logit per query head [Hq] that joins each row's softmax
denominator as one more key with no value: weights exp(s_j) / (exp(sink) + sum_j exp(s_j)).
"""

from __future__ import annotations

import torch


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < window
    return allowed


def _softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension of float32 scores [..., L]; `sink`, when given (shaped to
    broadcast against scores[..., :1]), is one more column, dropped after the softmax."""
    if sink is None:
        return torch.softmax(scores, dim=-1)
    sink = sink.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
                      window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Tq, Hq, D] at positions [q_start, q_start+Tq); k, v [Tk, Hkv, D] at [0, Tk). -> [Tq, Hq, D]."""
    tq, hq, _ = q.shape
    hkv = k.shape[1]
    q_pos = torch.arange(q_start, q_start + tq, device=q.device)
    k_pos = torch.arange(k.shape[0], device=q.device)
    mask = _window_mask(q_pos, k_pos, window)
    rep = hq // hkv
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), kk.transpose(1, 2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = _softmax(scores, None if sinks is None else sinks.view(hq, 1, 1)).to(q.dtype)
    return torch.matmul(probs, vv).transpose(0, 1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     seq_lens: torch.Tensor, page_size: int, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; caches [slots, Hkv, D]; page_table [B, P]; seq_lens [B] (new token included)."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    max_pages = page_table.shape[1]
    offs = torch.arange(page_size, device=q.device)
    slots = (page_table.long()[:, :, None] * page_size + offs).reshape(b, max_pages * page_size)
    k = k_cache[slots]  # [B, L, Hkv, D]
    v = v_cache[slots]
    rep = hq // hkv
    qg = q.view(b, hkv, rep, d)
    scores = torch.einsum("bhrd,blhd->bhrl", qg, k).float() * scale
    pos = torch.arange(max_pages * page_size, device=q.device)
    last = (seq_lens.long() - 1)[:, None]
    valid = pos[None, :] <= last
    if window:
        valid &= (last - pos[None, :]) < window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = _softmax(scores, None if sinks is None else sinks.view(1, hkv, rep, 1)).to(q.dtype)
    out = torch.einsum("bhrl,blhd->bhrd", probs, v)
    return out.reshape(b, hq, d)
