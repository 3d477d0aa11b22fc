"""MLA decode attention in Triton over the paged latent cache, split-K over the context.

``mla_decode_attention(q, cache, page_table, seq_lens, page_size, scale, rank)`` has the
signature and the results (to rounding) of ``kernels/mla/reference.py``.

Contract
- ``q``: [B, H, rank + rope] bf16|fp16|fp32, unit last stride; read only. Its first ``rank``
  elements per head are the absorbed query (W_UK^T q_nope), the rest the rotated q_pe.
- ``cache``: [slots, 1, rank + rope], dtype of q, unit last stride; read only. Token ``t`` of
  request ``b`` lives in slot ``page_table[b, t // page_size] * page_size + t % page_size``;
  the key is the whole row, the value its first ``rank`` elements (the latent).
- ``page_table``: [B, P] int32 (or int64); ``seq_lens``: [B], the new token included, with
  ``1 <= seq_lens[b] <= P * page_size`` (longer is clamped to the table; 0 gives a zero row).
- Writes ``out`` [B, H, rank] (dtype of q, allocated unless given; must not alias an input),
  every element; with more than one split also a private fp32 workspace.
- Fixed launch: grid and split count come from shapes only, never from ``seq_lens``; nothing
  is read back to the host: the call captures in a CUDA graph.

How: program (b, head block, split) holds BLOCK_H query heads as the rows of a tile, so each
latent row is read once per head block (at DeepSeek-V3's 128 heads, 128 / BLOCK_H times per
step, from L2 after the first); scores are q_lat . c + q_pe . k_pe (two dots, the rope part
kept apart so the latent tile is a power of two wide), an online softmax in fp32 (exp2, the
scale folded with log2 e), and the accumulator is P @ c. The splits, their token ranges and
the merge of their partials are the paged decode kernel's (kernels/attention/triton.py),
reused as they are: the merge works per (request, head) over any width.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.kernels.attention.triton import (_LOG2E, _dot, _merge_kernel, _online_softmax_step, _split_range,
                                              _store_split, _workspace, num_splits_for)
from moeferry.kernels.triton_common import exact_dot, pdl_launch, wait_for_previous_kernel

__all__ = ["mla_decode_attention"]


@triton.jit
def _mla_decode_kernel(
    q_ptr, c_ptr, pt_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, max_tokens,
    stride_qb, stride_qh, stride_cs, stride_pb, stride_ob, stride_oh,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    start, end, _ = _split_range(seq_len, max_tokens, 0, split, NUM_SPLITS, BLOCK_N)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = heads < NUM_HEADS
    r_mask = offs_r < RANK
    p_mask = offs_p < ROPE
    b64 = b.to(tl.int64)
    q_row = q_ptr + b64 * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_row + RANK + offs_p[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        valid = tok < end
        page = tl.load(pt_ptr + b64 * stride_pb + tok // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        row = c_ptr + (page * PAGE_SIZE + tok % PAGE_SIZE)[:, None] * stride_cs
        c = tl.load(row + offs_r[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0)
        k_pe = tl.load(row + RANK + offs_p[None, :], mask=valid[:, None] & p_mask[None, :], other=0.0)
        s = (_dot(q_lat, tl.trans(c), IEEE) + _dot(q_pe, tl.trans(k_pe), IEEE)) * qk_scale
        m_i, l_i, acc = _online_softmax_step(s, valid, c, m_i, l_i, acc, IEEE)

    _store_split(acc, m_i, l_i, out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_r[None, :],
                 part_o_ptr + b64 * stride_pob + heads[:, None] * stride_poh + split * stride_pos + offs_r[None, :],
                 part_lse_ptr + b64 * stride_plb + heads * stride_plh + split, h_mask, r_mask, start < end, NUM_SPLITS)


def _block_h(num_heads: int) -> int:
    return min(max(16, triton.next_power_of_2(num_heads)), 32)


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                         page_size: int, scale: float, rank: int, *, num_splits: int | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, rank + rope]; cache [slots, 1, rank + rope] -> out [B, H, rank] (see the module).
    ``num_splits`` (a power of two) overrides the split count; ``out`` receives the result."""
    b, h, width = q.shape
    rope = width - rank
    if cache.shape[-1] != width or cache.dtype != q.dtype:
        raise ValueError(f"cache {tuple(cache.shape)} {cache.dtype} does not match q {tuple(q.shape)} {q.dtype}")
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("q and the cache need a unit last stride")
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    block_h = _block_h(h)
    head_blocks = -(-h // block_h)
    max_tokens = page_table.shape[1] * page_size
    if num_splits is None:
        num_splits = num_splits_for(b, head_blocks, max_tokens, q.device)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if out is None:
        out = torch.empty(b, h, rank, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    part_o, part_lse = _workspace(b, h, num_splits, rank, q.device) if num_splits > 1 else (out, out)
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = 32 if block_r <= 256 else 16
    _mla_decode_kernel[(b, head_blocks, num_splits)](
        q, cache, page_table, seq_lens, out, part_o, part_lse,
        scale * _LOG2E, max_tokens,
        q.stride(0), q.stride(1), cache.stride(0), page_table.stride(0), out.stride(0), out.stride(1),
        *(part_o.stride()[:3] if num_splits > 1 else (0, 0, 0)),
        *(part_lse.stride()[:2] if num_splits > 1 else (0, 0)),
        NUM_HEADS=h, RANK=rank, ROPE=rope, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(rope)),
        IEEE=exact_dot(q.dtype), num_warps=4 if block_r <= 256 else 8, num_stages=2, **pdl_launch(q.device),
    )
    if num_splits > 1:
        _merge_kernel[(b, h)](
            part_o, part_lse, seq_lens, out, 0, max_tokens,
            *part_o.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1), out,
            HEAD_DIM=rank, NUM_SPLITS=num_splits, BLOCK_N=block_n, BLOCK_D=block_r, SINKS=False,
            num_warps=4, **pdl_launch(q.device),
        )
    return out
