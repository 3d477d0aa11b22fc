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

How: program (value block, head block, request b, split) holds BLOCK_H query heads as the
rows of a tile; scores are q_lat . c + q_pe . k_pe (two dots, the rope part kept apart so the
latent tile is a power of two wide), an online softmax in fp32 (exp2, the scale folded with
log2 e), and the accumulator is P @ c[:, v0 : v0 + BLOCK_V]. With BLOCK_V below the rank the
output columns are split over programs: each computes the whole scores (all of the key) and
keeps only its columns, so the accumulator's registers shrink by rank / BLOCK_V at the price
of recomputing the scores that often. The programs that read the same latent rows (every
head and value block of one request and split) are adjacent in the grid, so they run side by
side and the rows come from HBM once, from L2 for the others. The splits, their token ranges
and the merge of their partials are the paged decode kernel's (kernels/attention/triton.py),
reused as they are: the merge works per (request, head) over the whole rank, and each value
block writes its own columns of a partial; the lse, equal for every value block of a split,
is written by the first.

Tiles and launch parameters are an ``MLAConfig``; ``select_config`` picks the default from
the shapes (never from seq_lens), so it is fixed for a captured graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeferry.kernels.attention.triton import (_LOG2E, _dot, _merge_kernel, _online_softmax_step, _split_range,
                                              _store_split, _workspace, num_splits_for)
from moeferry.kernels.triton_common import exact_dot, pdl_launch, wait_for_previous_kernel

__all__ = ["MLAConfig", "mla_decode_attention", "select_config"]


@dataclass(frozen=True)
class MLAConfig:
    """Tiles and launch parameters of one MLA decode call (powers of two)."""

    block_h: int  # query heads per program, the rows of every tile: 16, 32 or 64
    block_n: int  # context tokens per loop step, the K of P @ c: 16, 32 or 64
    block_v: int  # output columns per program (>= 16); below the rank, value blocks that each recompute scores
    num_warps: int
    num_stages: int  # token blocks in flight (the software pipeline's depth)

    def check(self) -> None:
        sizes = (self.block_h, self.block_n, self.block_v, self.num_warps)
        if any(v < 1 or v & (v - 1) for v in sizes) or min(self.block_h, self.block_n, self.block_v) < 16:
            raise ValueError(f"{self}: tiles are powers of two of at least 16, num_warps a power of two")
        if self.block_h > 64 or self.block_n > 64 or self.num_stages < 1:
            raise ValueError(f"{self}: block_h and block_n at most 64, num_stages at least 1")


# The default tiles (select_config), one place to change them, from benchmarks/sweep_mla.py on
# the H200 at DeepSeek-V3's shapes (docs/mla.md, the decode kernel's tiles). From two requests up: 64
# heads a program (FlashMLA's row count, the 64 rows of a Hopper warpgroup MMA), all 512 value
# columns (a split value dimension recomputes the scores per block, which costs more than the
# accumulator's few spilled registers), 32 tokens a step, two stages. One request has too few
# programs for 64-head tiles to fill the SMs: 32 heads, half the columns, 4 warps.
DEFAULT_TILES = dict(block_h=64, block_n=32, block_v=512, num_warps=8, num_stages=2)
ONE_REQUEST_TILES = dict(block_h=32, block_n=32, block_v=256, num_warps=4, num_stages=2)


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def select_config(batch: int, heads: int, rank: int, max_tokens: int,
                  dtype: torch.dtype = torch.bfloat16) -> MLAConfig:
    """Tiles from the shapes only (a captured graph's launch fits every later step): DEFAULT_TILES
    (ONE_REQUEST_TILES for a batch of one), narrowed where the call is smaller than a tile (fewer
    heads than block_h, a page table shorter than block_n, a rank below block_v), and halved in
    heads and tokens for 4-byte elements, whose tiles take twice the shared memory."""
    tiles = dict(ONE_REQUEST_TILES if batch == 1 else DEFAULT_TILES)
    if dtype.itemsize > 2:
        tiles.update(block_h=tiles["block_h"] // 2, block_n=max(16, tiles["block_n"] // 2))
    tiles["block_h"] = min(tiles["block_h"], max(16, triton.next_power_of_2(heads)))
    tiles["block_n"] = min(tiles["block_n"], max(16, triton.next_power_of_2(max_tokens)))
    tiles["block_v"] = min(tiles["block_v"], _block_r(rank))
    return MLAConfig(**tiles)


@triton.jit
def _mla_decode_kernel(
    q_ptr, c_ptr, pt_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, max_tokens,
    stride_qb, stride_qh, stride_cs, stride_pb, stride_ob, stride_oh,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, V_BLOCKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    hb = tl.program_id(0) // V_BLOCKS
    v0 = (tl.program_id(0) % V_BLOCKS) * BLOCK_V
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    start, end, _ = _split_range(seq_len, max_tokens, 0, split, NUM_SPLITS, BLOCK_N)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_v = v0 + tl.arange(0, BLOCK_V)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = heads < NUM_HEADS
    r_mask = offs_r < RANK
    v_mask = offs_v < RANK
    p_mask = offs_p < ROPE
    b64 = b.to(tl.int64)
    q_row = q_ptr + b64 * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_row + RANK + offs_p[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        valid = tok < end
        page = tl.load(pt_ptr + b64 * stride_pb + tok // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        row = c_ptr + (page * PAGE_SIZE + tok % PAGE_SIZE)[:, None] * stride_cs
        c = tl.load(row + offs_r[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0)
        k_pe = tl.load(row + RANK + offs_p[None, :], mask=valid[:, None] & p_mask[None, :], other=0.0)
        s = (_dot(q_lat, tl.trans(c), IEEE) + _dot(q_pe, tl.trans(k_pe), IEEE)) * qk_scale
        if V_BLOCKS == 1:
            v = c
        else:  # this program's columns of the rows just read: a second load, from the L2 the first filled
            v = tl.load(row + offs_v[None, :], mask=valid[:, None] & v_mask[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax_step(s, valid, v, m_i, l_i, acc, IEEE)

    first_v = heads * 0 + v0 == 0  # the value block that writes the lse (a tensor: the interpreter takes no scalar)
    _store_split(acc, m_i, l_i, out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_v[None, :],
                 part_o_ptr + b64 * stride_pob + heads[:, None] * stride_poh + split * stride_pos + offs_v[None, :],
                 part_lse_ptr + b64 * stride_plb + heads * stride_plh + split, h_mask, v_mask, h_mask & first_v,
                 start < end, NUM_SPLITS)


def launch_shape(batch: int, heads: int, rank: int, max_tokens: int, config: MLAConfig,
                 device: torch.device) -> tuple[int, int]:
    """(programs per request and split: head blocks x value blocks, the default split count) of
    a call, whose grid is (programs, B, splits); the splits spread the programs to about two
    per SM (num_splits_for), from shapes only."""
    programs = -(-heads // config.block_h) * _value_tiles(config, rank)[1]
    return programs, num_splits_for(batch, programs, max_tokens, device)


def _value_tiles(config: MLAConfig, rank: int) -> tuple[int, int]:
    """(BLOCK_V, the value blocks over the rank): config.block_v, at most the rank's tile."""
    block_v = min(config.block_v, _block_r(rank))
    return block_v, -(-rank // block_v)


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                         page_size: int, scale: float, rank: int, *, num_splits: int | None = None,
                         out: torch.Tensor | None = None, config: MLAConfig | None = None) -> torch.Tensor:
    """q [B, H, rank + rope]; cache [slots, 1, rank + rope] -> out [B, H, rank] (see the module).
    ``num_splits`` (a power of two) overrides the split count; ``out`` receives the result;
    ``config`` overrides the tiles (default: select_config of the shapes)."""
    b, h, width = q.shape
    rope = width - rank
    if cache.shape[-1] != width or cache.dtype != q.dtype:
        raise ValueError(f"cache {tuple(cache.shape)} {cache.dtype} does not match q {tuple(q.shape)} {q.dtype}")
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("q and the cache need a unit last stride")
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    max_tokens = page_table.shape[1] * page_size
    if config is None:
        config = select_config(b, h, rank, max_tokens, q.dtype)
    config.check()
    block_r = _block_r(rank)
    block_v, v_blocks = _value_tiles(config, rank)
    programs, default_splits = launch_shape(b, h, rank, max_tokens, config, q.device)
    num_splits = default_splits if num_splits is None else num_splits
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if out is None:
        out = torch.empty(b, h, rank, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    part_o, part_lse = _workspace(b, h, num_splits, rank, q.device) if num_splits > 1 else (out, out)
    _mla_decode_kernel[(programs, b, num_splits)](
        q, cache, page_table, seq_lens, out, part_o, part_lse,
        scale * _LOG2E, max_tokens,
        q.stride(0), q.stride(1), cache.stride(0), page_table.stride(0), out.stride(0), out.stride(1),
        *(part_o.stride()[:3] if num_splits > 1 else (0, 0, 0)),
        *(part_lse.stride()[:2] if num_splits > 1 else (0, 0)),
        NUM_HEADS=h, RANK=rank, ROPE=rope, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        V_BLOCKS=v_blocks, BLOCK_H=config.block_h, BLOCK_N=config.block_n, BLOCK_R=block_r,
        BLOCK_V=block_v, BLOCK_P=max(16, triton.next_power_of_2(rope)), IEEE=exact_dot(q.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(q.device),
    )
    if num_splits > 1:
        _merge_kernel[(b, h)](
            part_o, part_lse, seq_lens, out, 0, max_tokens,
            *part_o.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1), out,
            HEAD_DIM=rank, NUM_SPLITS=num_splits, BLOCK_N=config.block_n, BLOCK_D=block_r, SINKS=False,
            num_warps=4, **pdl_launch(q.device),
        )
    return out
