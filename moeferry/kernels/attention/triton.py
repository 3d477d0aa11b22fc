"""Paged decode attention in Triton: one query per request, GQA, split-K over the context.

``decode_attention(q, k_cache, v_cache, page_table, seq_lens, page_size, scale, window=None)``
has the signature and the results (to rounding) of ``kernels/attention/reference.py``.

Contract
- ``q``: [B, Hq, D] bf16|fp16|fp32, any strides with a unit last stride; read only.
- ``k_cache``, ``v_cache``: [slots, Hkv, D], dtype of q, unit last stride; read only. Token
  ``t`` of request ``b`` lives in slot ``page_table[b, t // page_size] * page_size + t % page_size``.
- ``page_table``: [B, P] int32 (or int64); ``seq_lens``: [B] int32 (or int64), the new token
  included, both on q's device. Invariant expected of the caller:
  ``1 <= seq_lens[b] <= P * page_size``; longer lengths are clamped to the table (nothing
  outside the table is read), a length of 0 gives a zero row (the reference gives NaN).
- ``Hq % Hkv == 0``; q head ``h`` reads kv head ``h // (Hq // Hkv)``.
- ``window``: None or 0 for full attention, else key ``t`` is seen iff ``seq_len - 1 - t < window``.
- ``sinks``: None, or [Hq] float32 on q's device: a logit per query head joined to the softmax
  denominator only (gpt-oss), added once where the row's sum is final: by the program with one
  split, else by the merge.
- Writes ``out`` [B, Hq, D] (dtype of q, allocated unless given; must not alias an input),
  every element. With more than one split it also writes a private fp32 workspace.
- Fixed launch: grids come from (B, Hkv, Hq) and a split count chosen from B, Hkv, P and the
  SM count, never from ``seq_lens`` (read on the device only), and nothing is read back to
  the host, so the call captures in a CUDA graph and replays with new lengths and tables.

How: program (b, kv head, split) takes the Hq/Hkv query heads that share one kv head as the
rows of a [BLOCK_H, D] tile, so each K/V row is read once for the whole group, and walks its
share of the live context ``[max(0, seq_len - window), seq_len)`` in blocks of BLOCK_N tokens
gathered through the page table (any page size), with an online softmax in fp32 (exp2, the
scale folded with log2 e). The live range is divided among the splits on the device, in
multiples of BLOCK_N, so short contexts leave the last splits empty (they load and store
nothing) and long ones spread over ``num_splits`` programs per head group. With one split the
program writes the normalised output; otherwise each non-empty split writes its normalised
partial and log-sum-exp, and a second kernel, program (b, q head), merges the non-empty
splits (it recomputes which ones from seq_lens, so it never reads an unwritten partial).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moeferry.kernels.triton_common import exact_dot, pdl_launch, wait_for_previous_kernel

__all__ = ["decode_attention", "num_splits_for"]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
_MIN_SPLIT_TOKENS = 256  # below this much table per split, splitting buys nothing


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in fp32 (common.dot without an accumulator); IEEE: see common.exact_dot."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _split_range(seq_len, max_tokens, window, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """This split's token range [start, end) and the number of non-empty splits of the row."""
    seq_len = tl.minimum(seq_len, max_tokens)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    total = tl.maximum(seq_len - lo, 0)
    chunk = tl.cdiv(tl.cdiv(total, NUM_SPLITS), BLOCK_N) * BLOCK_N
    chunk = tl.maximum(chunk, BLOCK_N)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    return start, end, tl.cdiv(total, chunk)


@triton.jit
def _online_softmax_step(s, valid, values, m_i, l_i, acc, IEEE: tl.constexpr):
    """One block of base-2 scores s [H, N] (invalid tokens masked here) folded into the running
    max m_i, sum l_i and output acc [H, D] over `values` [N, D]: flash attention's update, shared
    by the paged decode kernel and MLA's. Every block holds at least one valid token, so the
    max is finite from the first block on."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(values.dtype), values, IEEE)
    return m_new, l_i, acc


@triton.jit
def _store_split(acc, m_i, l_i, out_ptrs, part_o_ptrs, part_lse_ptrs, h_mask, col_mask, lse_mask, nonempty,
                 NUM_SPLITS: tl.constexpr):
    """A program's result: with one split, the normalised output at `out_ptrs`; with several,
    the normalised partial and its base-2 log-sum-exp for the merge (an empty split stores
    nothing; the merge skips it). An empty row (seq_len 0) stays 0. `lse_mask` (h_mask, or
    none of it) lets one of several programs that share a row's softmax write its lse."""
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_mask = h_mask[:, None] & col_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty), mask=out_mask)
    elif nonempty:
        tl.store(part_o_ptrs, o, mask=out_mask)
        tl.store(part_lse_ptrs, m_i + tl.log2(l_i), mask=lse_mask)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, window, max_tokens,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pb,
    stride_ob, stride_oh, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, sinks_ptr,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    SINKS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    start, end, _ = _split_range(seq_len, max_tokens, window, split, NUM_SPLITS, BLOCK_N)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < REP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * REP + offs_h
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        valid = tok < end
        page = tl.load(pt_ptr + b64 * stride_pb + tok // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + tok % PAGE_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), IEEE) * qk_scale
        m_i, l_i, acc = _online_softmax_step(s, valid, v, m_i, l_i, acc, IEEE)
    if SINKS and NUM_SPLITS == 1:  # base 2, as the scores: sink * log2(e)
        sink = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0) * 1.4426950408889634
        l_i += tl.exp2(sink - m_i)

    _store_split(acc, m_i, l_i, out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 part_o_ptr + b64 * stride_pob + heads[:, None] * stride_poh + split * stride_pos + offs_d[None, :],
                 part_lse_ptr + b64 * stride_plb + heads * stride_plh + split, h_mask, d_mask, h_mask, start < end,
                 NUM_SPLITS)


@triton.jit
def _merge_kernel(
    part_o_ptr, part_lse_ptr, lens_ptr, out_ptr, window, max_tokens,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh, sinks_ptr,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SINKS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    _, _, used = _split_range(seq_len, max_tokens, window, 0, NUM_SPLITS, BLOCK_N)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < used
    d_mask = offs_d < HEAD_DIM
    b64 = b.to(tl.int64)
    lse = tl.load(part_lse_ptr + b64 * stride_plb + h * stride_plh + offs_s, mask=s_mask, other=float("-inf"))
    o = tl.load(part_o_ptr + b64 * stride_pob + h * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no live split: weights all 0
    w = tl.exp2(lse - lse_max)
    denom = tl.sum(w, 0)
    if SINKS:
        denom += tl.exp2(tl.load(sinks_ptr + h) * 1.4426950408889634 - lse_max)
    merged = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b64 * stride_ob + h * stride_oh + offs_d, merged.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few splits, so tests exercise the merge


def num_splits_for(batch: int, kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Splits per (request, kv head): about two programs per SM, at most one split per
    _MIN_SPLIT_TOKENS of page table, rounded down to a power of two. Depends on shapes only,
    never on seq_lens, so a captured graph's launch fits every later step."""
    want = -(-2 * _sm_count(torch.device(device)) // max(batch * kv_heads, 1))
    cap = max(1, max_tokens // _MIN_SPLIT_TOKENS)
    n = min(want, cap, _MAX_SPLITS)
    return 1 << (max(n, 1).bit_length() - 1)  # round down: stays within the cap


def _workspace(batch: int, q_heads: int, splits: int, head_dim: int, device: torch.device):
    """Partial outputs [B, Hq, S, D] and log2-sum-exps [B, Hq, S], fp32, uninitialised."""
    return (torch.empty(batch, q_heads, splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch, q_heads, splits, dtype=torch.float32, device=device))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     seq_lens: torch.Tensor, page_size: int, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None, *, num_splits: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; caches [slots, Hkv, D]; page_table [B, P]; seq_lens [B] -> out [B, Hq, D].

    See the module docstring for the full contract. ``num_splits`` (a power of two) overrides
    the split count; ``out`` receives the result when given."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} kv heads")
    if not (k_cache.dtype == v_cache.dtype == q.dtype):
        raise TypeError(f"q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}: one dtype expected")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a unit stride over head_dim")
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    if sinks is not None and (sinks.shape != (hq,) or sinks.dtype != torch.float32 or sinks.device != q.device):
        raise ValueError(f"sinks must be float32 [{hq}] on q's device, got {sinks.dtype} {list(sinks.shape)}")
    rep = hq // hkv
    max_tokens = page_table.shape[1] * page_size
    if num_splits is None:
        num_splits = num_splits_for(b, hkv, max_tokens, q.device)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if out is None:
        out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    part_o, part_lse = _workspace(b, hq, num_splits, d, q.device) if num_splits > 1 else (out, out)

    block_d = max(16, triton.next_power_of_2(d))
    block_n = 64 if block_d <= 128 else 32
    block_h = max(16, triton.next_power_of_2(rep))
    window = int(window or 0)
    _decode_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, out, part_o, part_lse,
        scale * _LOG2E, window, max_tokens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), out.stride(0), out.stride(1),
        *(part_o.stride()[:3] if num_splits > 1 else (0, 0, 0)),
        *(part_lse.stride()[:2] if num_splits > 1 else (0, 0)), q if sinks is None else sinks,
        REP=rep, HEAD_DIM=d, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, IEEE=exact_dot(q.dtype), SINKS=sinks is not None,
        num_warps=4, num_stages=2, **pdl_launch(q.device),
    )
    if num_splits > 1:
        _merge_kernel[(b, hq)](
            part_o, part_lse, seq_lens, out, window, max_tokens,
            *part_o.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1),
            q if sinks is None else sinks,
            HEAD_DIM=d, NUM_SPLITS=num_splits, BLOCK_N=block_n, BLOCK_D=block_d, SINKS=sinks is not None,
            num_warps=4, **pdl_launch(q.device),
        )
    return out
