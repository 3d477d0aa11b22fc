"""Grouped MoE expert GEMM (fused MoE) in Triton, after vLLM's fused_moe: two GEMMs over
blocks of routes that each belong to one expert, then a fixed-order sum over top-k.

Contract (the oracle is moeferry.kernels.fused_moe.reference):
    hidden        [T, H] bf16|fp16|fp32; read only.
    w13           [S, 2I, H] dtype of hidden, rows [0:I] gate, [I:2I] up; read only.
    w2            [S, H, I] dtype of hidden; read only.
                  Block FP8 (w13_scale, w2_scale, block_shape given; layout in
                  kernels/fused_moe/__init__.py): both banks float8_e4m3fn, their scales
                  float32. Int4 (the same, banks int32): w13 [S, 2I, H/8], w2 [S, H, I/8],
                  eight 4-bit values per word along K, each word read once and unpacked in
                  registers. Each K tile of BLOCK_K (a divisor of the scale block's columns)
                  is multiplied with the values converted exactly to hidden's dtype, and
                  the fp32 partial product is scaled per output column by its block's scale
                  before it joins the accumulator (W8A16 / W4A16; no weight is rounded).
                  MXFP4 (banks uint8, two E2M1 codes a byte, uint8 E8M0 scales per row and 32
                  values): decoded from the nibbles' bits. With split-field tiles (the
                  default) the bytes are read as int32 words, int4's layout (the codes are
                  contiguous along K, so nibble i of word w is value 8w + i), and each
                  weight carries its block's power of two into the dot (bf16: added to its
                  exponent bits) over K tiles of several blocks; where a launch cannot read
                  words (FusedMoEConfig.mxfp4_words) a split tile is one 32-value block of
                  bytes whose power of two scales the fp32 partial product like int4's
                  group scale; without split fields each weight is scaled before the dot
                  (exact every way in bf16 and fp32, which share fp32's exponent range).
                  4-bit K tiles run as one dot per field of the stored elements
                  (FusedMoEConfig.split_fields).
                  Either bank may be host-resident (pinned CPU memory while hidden is on
                  CUDA): the kernels read it in place over PCIe (UVA), never copying it.
    topk_weights  [T, K] float32; topk_ids [T, K] int32|int64, each in [0, S).
    out           [T, H] dtype of hidden, written whole; must not alias any input.
    num_routed_experts: the routed layer's expert count E (S may be a slot pool shared by
                  many layers, S >> E). The ids name at most E distinct rows (each of the
                  layer's experts one row): the sorted path's grid is sized by E, not S.

Kernels and the buffers they write (N = T * K routes, route r = t * K + k):
    1. moe_align_block_size (sorted path only): routes grouped into blocks of BLOCK_M rows,
       each block one expert's, so each routed expert's weights are read once per step.
    2. _moe_gemm_kernel, GATED: act[r] = silu(x w13[e, :I]^T) * (x w13[e, I:]^T),
       [N, I] dtype of hidden, fp32 accumulation (CLAMPED: gpt-oss's clamped SwiGLU instead;
       BIAS: w13_bias[e] joins the fp32 accumulators first).
    3. _moe_gemm_kernel, weighted: route_out[r] = topk_weights[r] * (act[r] w2[e]^T + w2_bias[e]),
       [N, H].
    4. _sum_topk_kernel: out[t] = sum over k = 0..K-1 of route_out[t * K + k], in fp32
       (skipped with sum_routes=False: the next residual add sums the partials itself).
No atomics anywhere in the arithmetic, so output is reproducible run to run.

Invariants:
    - Tiles (FusedMoEConfig) come from (T, K, H, I, num_routed_experts, dtype), never from
      S: the same routes give bit-identical output over a layer's bank [E, ...] and over a
      slot pool [S, ...] holding the same expert rows at other indices (each output row is
      computed by the same tile code with the same reduction order).
    - Grids come from shapes only and nothing is read back to the host: CUDA-graph
      capturable. No autotuning at run time.
    - block_assignment "naive" gives each route its own block (1 valid row of BLOCK_M): no
      alignment, but an expert shared by several tokens is read once per token. It is
      allowed only when T * K * 4 <= num_routed_experts.
"""
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from moeferry.kernels.fused_moe import SILU, check_options
from moeferry.kernels.fused_moe.gemv import launch_route_gemv, route_gemv_allowed
from moeferry.kernels.fused_moe.values import activate, e2m1_bits, e2m1_value, e8m0_value
from moeferry.kernels.moe_align.triton import moe_align_block_size
from moeferry.kernels.triton_common import dot, exact_dot, pdl_launch, rounded, wait_for_previous_kernel

__all__ = [
    "FusedMoEConfig",
    "choose_block_assignment",
    "fused_moe",
    "is_host_resident",
    "naive_allowed",
    "select_config",
]


@dataclass(frozen=True)
class FusedMoEConfig:
    """Tile sizes and launch parameters for both GEMMs of one fused_moe call; the down GEMM
    pipelines ``down_num_stages`` K tiles when given, else ``num_stages`` like the first.
    ``split_fields`` (4-bit banks only, int4 and MXFP4): a K tile is PACK dots, one per field
    of the stored elements against the matching strided columns of a, instead of one dot over
    the fields rearranged into K order (no reshape of the weight tile). ``mxfp4_words`` (with
    split_fields, MXFP4 only): the bank's bytes are read as int32 words of eight codes, int4's
    layout, so a K tile is eight dots and spans BLOCK_K / 32 scale blocks, each power of two
    folded into its weights before the dot (`_mxfp4_words` says when a launch can); otherwise
    a split MXFP4 tile is one 32-value block of bytes whose scale multiplies the tile's fp32 sum.
    ``route_gemv``: naive calls run both GEMMs as the route GEMV on CUDA cores (gemv.py) where
    it can read the banks (its own tiles: gemv.select_gemv_config)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    down_num_stages: int | None = None
    split_fields: bool = False
    mxfp4_words: bool = False
    route_gemv: bool = False

    def stages(self, gated: bool) -> int:
        """Pipeline depth of the gate+up GEMM (gated) or of the down GEMM."""
        return self.num_stages if gated or self.down_num_stages is None else self.down_num_stages


def _pow2_at_most(limit: int, size: int, floor: int = 16) -> int:
    """The largest power of two <= limit that is not much wider than size (>= floor)."""
    return max(floor, min(limit, triton.next_power_of_2(size)))


def select_config(num_tokens: int, top_k: int, hidden_size: int, intermediate_size: int,
                  num_routed_experts: int, dtype: torch.dtype) -> FusedMoEConfig:
    """Heuristic tiles from the routed layer's shape; deliberately blind to the bank size S.

    BLOCK_M follows the tokens each expert gets (T * K / E): 16 for small-batch decode,
    where a block is mostly one or two rows, up to 64 for prefill. Pipeline depth at decode
    sizes, from benchmarks/sweep_fused_moe.py on an H200 at Qwen3-30B-A3B shapes (figures in
    docs/performance.md, fused MoE tiles): 3 stages for the down GEMM up to one token per expert,
    and for gate+up from 2 tokens; at 1 token gate+up keeps 4, which measured faster there.
    4-bit banks take split-field dots (FusedMoEConfig.split_fields): on the same sweep with
    int4 banks they cut the decode GEMMs' time by a fifth to a third. MXFP4 banks take them
    over int32 words (FusedMoEConfig.mxfp4_words) where the launch allows, int4's tile depth.
    One token's routes take the route GEMV (FusedMoEConfig.route_gemv): on the H100 sweep
    (benchmarks/sweep_route_gemv.py) it ran a layer's two GEMMs 2.0x (int4), 2.4x (MXFP4),
    1.3x (fp8) and 1.0x (bf16) as fast as the tiles above; at 4 tokens the tiles above won for
    the quantized formats."""
    tokens_per_expert = num_tokens * top_k / max(1, num_routed_experts)
    down_num_stages = None
    if tokens_per_expert <= 1:
        block_m, block_n, block_k, num_warps, down_num_stages = 16, 64, 128, 4, 3
        num_stages = 4 if num_tokens == 1 else 3
    elif tokens_per_expert <= 16:
        block_m, block_n, block_k, num_warps, num_stages = 16, 64, 128, 4, 4
    elif tokens_per_expert <= 64:
        block_m, block_n, block_k, num_warps, num_stages = 32, 64, 128, 4, 3
    else:
        block_m, block_n, block_k, num_warps, num_stages = 64, 128, 64, 8, 3
    if dtype == torch.float32:  # twice the bytes per element: halve the K tile
        block_k = 32
    narrowest = min(hidden_size, intermediate_size)
    return FusedMoEConfig(
        block_m=block_m,
        block_n=_pow2_at_most(block_n, narrowest),
        block_k=_pow2_at_most(block_k, narrowest),
        group_m=1 if block_m == 16 else 8,
        num_warps=num_warps,
        num_stages=num_stages,
        down_num_stages=down_num_stages,
        split_fields=True,
        mxfp4_words=True,
        route_gemv=num_tokens == 1,
    )


def is_host_resident(t: torch.Tensor) -> bool:
    """True when t lives in pinned host memory: with hidden states on CUDA the kernels
    then read it in place over PCIe (unified virtual addressing)."""
    return t.device.type == "cpu" and t.is_pinned()


def naive_allowed(num_tokens: int, top_k: int, num_routed_experts: int) -> bool:
    """The naive assignment pays off only while routes are sparse over the experts."""
    return num_tokens * top_k * 4 <= num_routed_experts


def choose_block_assignment(num_tokens: int, top_k: int, num_routed_experts: int,
                            w13: torch.Tensor, w2: torch.Tensor) -> str:
    """"naive" for small batches over device weights, else "sorted".

    Host-resident weights (either bank: a budget may leave one on each side) always take
    the sorted path, where each routed expert crosses PCIe once per step."""
    host_resident = is_host_resident(w13) or is_host_resident(w2)
    if not host_resident and naive_allowed(num_tokens, top_k, num_routed_experts):
        return "naive"
    return "sorted"


@triton.jit
def _block_rows(pid_m, sorted_route_ptr, block_expert_ptr, num_post_padded_ptr, ids_ptr,
                num_routes, NAIVE: tl.constexpr, BLOCK_M: tl.constexpr):
    """(routes [BLOCK_M], expert) of block pid_m; expert -1 means no work for it."""
    lanes = tl.arange(0, BLOCK_M)
    if NAIVE:
        routes = tl.where(lanes == 0, pid_m, num_routes)
        expert = tl.load(ids_ptr + pid_m).to(tl.int32)
    else:
        num_post_padded = tl.load(num_post_padded_ptr)
        routes = tl.load(sorted_route_ptr + pid_m * BLOCK_M + lanes)
        expert = tl.load(block_expert_ptr + pid_m)
        expert = tl.where(pid_m * BLOCK_M < num_post_padded, expert, -1)
    return routes, expert


@triton.jit
def _nibbles(b_ptrs, mask, PACK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] 4-bit fields (int32 0..15) of a tile stored PACK to an element
    along K ([BLOCK_K / PACK, BLOCK_N] elements, b_ptrs and mask over them): each element is
    read once and split in registers, field i at bits 4i being row PACK * element + i."""
    stored = tl.load(b_ptrs, mask=mask, other=0).to(tl.int32)
    fields = (stored[:, None, :] >> (tl.arange(0, PACK) * 4)[None, :, None]) & 0xF
    return tl.reshape(fields, (BLOCK_K, BLOCK_N))


@triton.jit
def _load_b(b_ptrs, mask, mx_scale_ptrs, mx_mask, PACKED: tl.constexpr, MXFP4: tl.constexpr, PACK: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] tile of weights; b_ptrs and mask are over the tile as stored
    ([BLOCK_K / PACK, BLOCK_N] elements). PACKED: int4 in int32 words (value i of a word at bits
    4i, stored + 8), back as the signed values in float32 (exact; an integer converts to bf16
    through it). MXFP4: E2M1 codes two to a byte (even k the low nibble) times the E8M0 scale
    of each value at `mx_scale_ptrs` ([BLOCK_K, BLOCK_N], masked by `mx_mask`), in float32
    (exact)."""
    if PACKED:
        return (_nibbles(b_ptrs, mask, PACK, BLOCK_K, BLOCK_N) - 8).to(tl.float32)
    elif MXFP4:
        codes = _nibbles(b_ptrs, mask, PACK, BLOCK_K, BLOCK_N)
        scales = tl.load(mx_scale_ptrs, mask=mx_mask, other=127).to(tl.int32)  # masked: 1, never 0 * inf
        return e2m1_value(codes) * e8m0_value(scales)
    else:  # an else, not a fall-through: compiled Triton types every return of a function
        return tl.load(b_ptrs, mask=mask, other=0.0)


@triton.jit
def _int4_weight(field, dtype: tl.constexpr):
    """The signed int4 values field - 8 (fields int32 0..15) in `dtype`, exact. bf16 from the
    bits: 0x4300 | field is the bf16 128 + field, which widens to float32 by a shift, less 136,
    narrowed back exactly (no int-to-float conversion); otherwise converted."""
    if dtype == tl.bfloat16:
        return ((field | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32) - 136.0).to(tl.bfloat16)
    else:
        return (field - 8).to(tl.float32).to(dtype)


@triton.jit
def _e2m1_weight(code, dtype: tl.constexpr):
    """E2M1 codes (int32 0..15) as `dtype` values, exact. bf16 from the bits, the high half of
    the float32 pattern (no float conversion); otherwise through float32 (e2m1_value)."""
    if dtype == tl.bfloat16:
        return (e2m1_bits(code) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return e2m1_value(code).to(dtype)


@triton.jit
def _e8m0_fold(scale, dtype: tl.constexpr):
    """E8M0 bytes s (int32) as `_e2m1_scaled_weight` folds them into the weights of their block,
    computed once per scale rather than per weight. bf16: (s - 1) << 7, the bits of 2^(s - 128),
    E2M1 code 1's value 0.5 scaled, with s clamped to 2..252, the scales for which every scaled
    non-zero E2M1 value is a normal bf16 number (2^-126 .. 6 x 2^125). Real checkpoints' scales
    sit far inside that range; one outside it is taken as the nearest end rather than let the
    exponent wrap into the sign bit. float32: the value 2^(s - 127) (e8m0_value)."""
    if dtype == tl.bfloat16:
        return (tl.minimum(tl.maximum(scale, 2), 252) - 1) << 7
    else:
        return e8m0_value(scale)


@triton.jit
def _e2m1_scaled_weight(code, fold, dtype: tl.constexpr):
    """E2M1 codes (int32 0..15) times their blocks' powers of two (`fold`: _e8m0_fold), in
    `dtype` (bf16 or float32), exact. bf16 from the bits, the scale added to the exponent: a
    magnitude m = code & 7 of 2 or more is (1 + m_0 / 2) 2^(m_21 - 1) (m_21 its exponent bits,
    m_0 its mantissa bit), whose scaled bf16 pattern is 2^(s - 128)'s plus m << 6 (exponent
    field + m_21, mantissa bit 6 = m_0); m = 1 (0.5) is 2^(s - 128) itself and m = 0 zero, so
    m * fold below 2; the sign is code's bit 3 at bf16's bit 15 (-0 stays -0). One select a
    weight, each side of it one integer multiply-add. float32: value times scale."""
    if dtype == tl.bfloat16:
        magnitude = code & 7
        bits = tl.where(magnitude < 2, magnitude * fold, fold + (magnitude << 6)) | ((code & 8) << 12)
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)  # the low 16 bits: the sign bit kept
    else:
        return e2m1_value(code) * fold


@triton.jit
def _word_scales(scale_rows_ptrs, stride_sk, k0, k_in, col_valid, dtype: tl.constexpr, PACK: tl.constexpr,
                 SCALE_BK: tl.constexpr, BLOCK_K: tl.constexpr):
    """The E8M0 scales of an MXFP4 K tile at k0 (a multiple of SCALE_BK) read as int32 words,
    [BLOCK_K / PACK, BLOCK_N] to match the words: the tile's BLOCK_K / SCALE_BK blocks are
    loaded once (scale_rows_ptrs [BLOCK_N]: the columns' rows of scales) and each repeated for
    the SCALE_BK / PACK words it covers (word j lies in block k0 / SCALE_BK + j // (SCALE_BK /
    PACK)), folded for `dtype` (_e8m0_fold). Blocks past k_in read as 2^0."""
    BLOCKS: tl.constexpr = BLOCK_K // SCALE_BK
    offs_s = tl.arange(0, BLOCKS)
    scale_ptrs = scale_rows_ptrs[None, :] + (k0 // SCALE_BK + offs_s)[:, None] * stride_sk
    scales = tl.load(scale_ptrs, mask=(k0 + offs_s * SCALE_BK < k_in)[:, None] & col_valid[None, :], other=127)
    fold = _e8m0_fold(scales.to(tl.int32), dtype)
    block_n: tl.constexpr = col_valid.shape[0]
    repeated = tl.broadcast_to(fold[:, None, :], (BLOCKS, SCALE_BK // PACK, block_n))
    return tl.reshape(repeated, (BLOCK_K // PACK, block_n))


@triton.jit
def _split_fields_dot(a_rows_ptrs, row_valid, k0, k_in, stride_ak, b_ptrs, b_mask, scale_rows_ptrs, stride_sk,
                      col_valid, acc, MXFP4: tl.constexpr, PACK: tl.constexpr, SCALE_BK: tl.constexpr,
                      BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b over the K tile at k0 of a 4-bit bank, the stored elements
    ([BLOCK_K / PACK, BLOCK_N] at b_ptrs) read once and never rearranged: field i of element j
    is column k0 + PACK * j + i, so the tile is PACK dots of field i (int4: the value; MXFP4:
    the E2M1 value) against a's columns k0 + i, k0 + PACK + i, ... (a_rows_ptrs [BLOCK_M]: a's
    rows). The scales (scale_rows_ptrs [BLOCK_N]: the columns' rows of scales):
    - int4 words, MXFP4 bytes (PACK 2): the tile lies inside one scale block (BLOCK_K <=
      SCALE_BK), so the fp32 sum of the dots is scaled per output column (at k0 // SCALE_BK):
      a float32 group scale, or MXFP4's E8M0 power of two (exact).
    - MXFP4 words (PACK 8: the bytes read as int32, int4's layout; `_mxfp4_words`): the tile
      spans BLOCK_K / SCALE_BK blocks, so each power of two is folded into its weights before
      the dots (_word_scales, _e2m1_scaled_weight: exact in bf16 and float32), which then
      accumulate into acc directly."""
    stored = tl.load(b_ptrs, mask=b_mask, other=0).to(tl.int32)
    offs_j = tl.arange(0, BLOCK_K // PACK)
    if MXFP4 and PACK == 8:
        tl.static_assert(BLOCK_K % SCALE_BK == 0 and SCALE_BK % PACK == 0)
        fold = _word_scales(scale_rows_ptrs, stride_sk, k0, k_in, col_valid, a_rows_ptrs.dtype.element_ty, PACK,
                            SCALE_BK, BLOCK_K)
        partial = acc
    else:
        tl.static_assert(BLOCK_K <= SCALE_BK)
        partial = tl.zeros(acc.shape, dtype=tl.float32)
    for i in tl.static_range(PACK):
        cols = k0 + offs_j * PACK + i
        a = tl.load(a_rows_ptrs[:, None] + cols[None, :] * stride_ak, mask=row_valid[:, None] & (cols < k_in)[None, :],
                    other=0.0)
        field = (stored >> (4 * i)) & 0xF
        if MXFP4 and PACK == 8:
            b = _e2m1_scaled_weight(field, fold, a.dtype)
        elif MXFP4:
            b = _e2m1_weight(field, a.dtype)
        else:
            b = _int4_weight(field, a.dtype)
        partial = dot(a, b, partial, IEEE)
    if MXFP4 and PACK == 8:
        return partial
    else:
        scale_ptrs = scale_rows_ptrs + k0 // SCALE_BK * stride_sk
        if MXFP4:
            scales = e8m0_value(tl.load(scale_ptrs, mask=col_valid, other=127).to(tl.int32))
        else:
            scales = tl.load(scale_ptrs, mask=col_valid, other=0.0)
        return acc + partial * scales[None, :]


@triton.jit
def _scaled_dot(a, b, acc, scale_ptrs, scale_offset, col_valid, QUANT: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b; QUANT: b holds quantized values (fp8, or int4 unpacked) whose scale is one
    per output column over this K tile (scale_ptrs + scale_offset), applied to the fp32
    partial product."""
    if QUANT:
        scales = tl.load(scale_ptrs + scale_offset, mask=col_valid, other=0.0)
        partial = dot(a, b.to(a.dtype), tl.zeros(acc.shape, dtype=tl.float32), IEEE)
        return acc + partial * scales[None, :]
    else:  # b in a's dtype, or MXFP4 values already scaled (exact in bf16 and fp32)
        return dot(a, b.to(a.dtype), acc, IEEE)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, route_weight_ptr,
    sorted_route_ptr, block_expert_ptr, num_post_padded_ptr, ids_ptr,
    num_routes, n_out, k_in, num_m_blocks,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    scale_ptr, stride_se, stride_sn, stride_sk, up_scale_row,
    QUANT: tl.constexpr,  # b is quantized with float32 scales per (SCALE_BN, SCALE_BK) block
    PACKED: tl.constexpr, PACK: tl.constexpr,  # b is int4, PACK = 8 values per int32 along k
    MXFP4: tl.constexpr,  # b is MXFP4 (PACK = 2 E2M1 codes a byte, or 8 an int32 word), E8M0 scales per (1, SCALE_BK)
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    A_ROWS_PER_ROUTE_DIV: tl.constexpr,  # a row = route // this (K for hidden, 1 for act)
    GATED: tl.constexpr,  # b rows [0:n_out] gate, [n_out:2 n_out] up; c = silu(gate) * up
    WEIGHTED: tl.constexpr,  # c *= route_weight[route]
    bias_ptr, stride_bias_e, alpha, limit,
    BIAS: tl.constexpr,  # bias [S, n_out] (gated: [S, 2 n_out], gate then up) added to the accumulators
    CLAMPED: tl.constexpr,  # gated: c = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
    NAIVE: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr,  # PACKED or MXFP4: a K tile is PACK dots, one per stored field (_split_fields_dot);
    # MXFP4 with PACK = 8: the bytes read as int32 words, K tiles of several scale blocks
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    """c[route, n] for one [BLOCK_M, BLOCK_N] tile of routes that all belong to one expert."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(n_out, BLOCK_N)
    blocks_per_group = GROUP_M * num_n_blocks
    first_m = (pid // blocks_per_group) * GROUP_M
    group_rows = min(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % blocks_per_group) % group_rows
    pid_n = (pid % blocks_per_group) // group_rows

    routes, expert = _block_rows(pid_m, sorted_route_ptr, block_expert_ptr, num_post_padded_ptr,
                                 ids_ptr, num_routes, NAIVE, BLOCK_M)
    if expert < 0:
        return
    row_valid = routes < num_routes
    a_rows = tl.where(row_valid, routes // A_ROWS_PER_ROUTE_DIV, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // PACK)  # the tile's rows of b as stored (int4: words)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn + offs_kb[:, None] * stride_bk
    scale_ptrs = scale_ptr + expert.to(tl.int64) * stride_se + (offs_n // SCALE_BN) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a_rows_ptrs = a_ptr + a_rows * stride_am  # read if SPLIT
    for k0 in range(0, k_in, BLOCK_K):
        k_valid = offs_k < k_in - k0
        b_mask = (offs_kb * PACK < k_in - k0)[:, None] & col_valid[None, :]
        if SPLIT:
            acc = _split_fields_dot(a_rows_ptrs, row_valid, k0, k_in, stride_ak, b_ptrs, b_mask, scale_ptrs,
                                    stride_sk, col_valid, acc, MXFP4, PACK, SCALE_BK, BLOCK_K, IEEE)
            if GATED:
                acc_up = _split_fields_dot(a_rows_ptrs, row_valid, k0, k_in, stride_ak, b_ptrs + n_out * stride_bn,
                                           b_mask, scale_ptrs + up_scale_row * stride_sn, stride_sk, col_valid,
                                           acc_up, MXFP4, PACK, SCALE_BK, BLOCK_K, IEEE)
        else:
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            mx_scale_ptrs = scale_ptrs[None, :] + ((k0 + offs_k) // SCALE_BK * stride_sk)[:, None]  # read if MXFP4
            mx_mask = k_valid[:, None] & col_valid[None, :]
            b = _load_b(b_ptrs, b_mask, mx_scale_ptrs, mx_mask, PACKED, MXFP4, PACK, BLOCK_K, BLOCK_N)
            acc = _scaled_dot(a, b, acc, scale_ptrs, k0 // SCALE_BK * stride_sk, col_valid, QUANT, IEEE)
            if GATED:
                b_up = _load_b(b_ptrs + n_out * stride_bn, b_mask, mx_scale_ptrs + up_scale_row * stride_sn,
                               mx_mask, PACKED, MXFP4, PACK, BLOCK_K, BLOCK_N)
                acc_up = _scaled_dot(a, b_up, acc_up, scale_ptrs + up_scale_row * stride_sn,
                                     k0 // SCALE_BK * stride_sk, col_valid, QUANT, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K // PACK * stride_bk
    if BIAS:
        bias_row = bias_ptr + expert.to(tl.int64) * stride_bias_e + offs_n
        acc += tl.load(bias_row, mask=col_valid, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + n_out, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = activate(acc, acc_up, alpha, limit, CLAMPED)
    if WEIGHTED:
        acc *= tl.load(route_weight_ptr + routes, mask=row_valid, other=0.0)[:, None]
    c_ptrs = c_ptr + routes.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _sum_topk_kernel(route_out_ptr, out_ptr, hidden_size, stride_rm, stride_om,
                     TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum over k = 0..TOP_K-1 of route_out[t * TOP_K + k], accumulated in fp32."""
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    valid = offs < hidden_size
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = route_out_ptr + (token * TOP_K + k) * stride_rm
        acc += tl.load(row + offs, mask=valid, other=0.0).to(tl.float32)
    acc = rounded(acc, out_ptr.dtype.element_ty)  # as the residual add's sum of partials rounds
    tl.store(out_ptr + token * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=valid)


def _route_blocks(topk_ids: torch.Tensor, num_weight_rows: int, num_routed_experts: int, assignment: str,
                  block_m: int):
    """(sorted_route_ids, block_expert, num_post_padded, num_m_blocks) for the GEMM grid.

    The naive path has no alignment: block b is route b; the kernel reads topk_ids. The
    sorted path's grid is sized by the routed layer's experts, not the bank's rows: a call's
    ids name at most `num_routed_experts` rows (one row per expert of the layer), so over a
    pool of S slots the grid has no blocks for the slots the layer cannot route to."""
    num_routes = topk_ids.numel()
    if assignment == "naive":
        return topk_ids, topk_ids, topk_ids, num_routes
    # Looked up as a module global at call time, so a test can observe the call.
    sorted_route_ids, block_expert, num_post_padded = moe_align_block_size(
        topk_ids, block_m, num_weight_rows, num_routed_experts)
    return sorted_route_ids, block_expert, num_post_padded, block_expert.numel()


def quantized_block_k(block_k: int, scale_block_k: int) -> int:
    """The K tile over block-scaled weights: the largest power of two that divides the scale
    block's columns and is at most `block_k`, so one K tile never straddles two scales."""
    return min(block_k, scale_block_k & -scale_block_k)


def _launch_gemm(a, b, c, route_weights, blocks, topk_ids, *, gated, weighted, a_div, naive,
                 config, scales=None, block_shape=None, bias=None, activation=SILU):
    sorted_route_ids, block_expert, num_post_padded, num_m_blocks = blocks
    n_out = c.shape[1]
    k_in = a.shape[1]
    quant = scales is not None
    mxfp4 = quant and b.dtype == torch.uint8
    packed = quant and b.dtype == torch.int32
    config, b = _k_tiles(config, a, b, quant, block_shape)
    if not quant:  # unread placeholders
        scales, block_shape = route_weights, (1, 1)
    scale_strides = scales.stride() if quant else (0, 0, 0)
    grid = (num_m_blocks * triton.cdiv(n_out, config.block_n),)
    _moe_gemm_kernel[grid](
        a, b, c, route_weights, sorted_route_ids, block_expert, num_post_padded, topk_ids,
        topk_ids.numel(), n_out, k_in, num_m_blocks,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        scales, *scale_strides, triton.cdiv(n_out, block_shape[0]),
        QUANT=quant and not mxfp4, PACKED=packed, PACK=_pack(b), MXFP4=mxfp4,
        SCALE_BN=block_shape[0], SCALE_BK=block_shape[1],
        A_ROWS_PER_ROUTE_DIV=a_div, GATED=gated, WEIGHTED=weighted,
        bias_ptr=route_weights if bias is None else bias, stride_bias_e=0 if bias is None else bias.stride(0),
        alpha=activation.alpha, limit=activation.limit, BIAS=bias is not None,
        CLAMPED=activation.name == "clamped_swiglu", NAIVE=naive,
        IEEE=exact_dot(a.dtype), SPLIT=_splits_fields(config, _pack(b)),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.stages(gated),
        **pdl_launch(a.device),
    )


def _k_tiles(config: FusedMoEConfig, a: torch.Tensor, b: torch.Tensor, quant: bool, block_shape):
    """(config, b) as a GEMM of a [M, K] and the bank b runs them: MXFP4 bytes read as int32
    words where `_mxfp4_words` allows (K tiles of whole scale blocks, each folded into its
    weights); otherwise K tiles inside one scale block wherever a tile's fp32 sum is scaled
    (fp8, int4, split MXFP4 bytes). Unsplit MXFP4 scales every weight before the dot: any tile."""
    mxfp4 = quant and b.dtype == torch.uint8
    if mxfp4 and _mxfp4_words(config, b, a.dtype, a.shape[1], block_shape[1]):
        return config, b.view(torch.int32)  # int4's word layout: nibble i of word w is value 8w + i
    if (quant and not mxfp4) or (mxfp4 and config.split_fields):
        return replace(config, block_k=quantized_block_k(config.block_k, block_shape[1])), b
    return config, b


def _splits_fields(config: FusedMoEConfig, pack: int) -> bool:
    """Whether a 4-bit bank's K tiles run as one dot per field: asked for, and each dot at
    least 16 deep (tl.dot's smallest K)."""
    return config.split_fields and pack > 1 and config.block_k // pack >= 16


def _mxfp4_words(config: FusedMoEConfig, bank: torch.Tensor, dtype: torch.dtype, k_in: int,
                 scale_block_k: int) -> bool:
    """Whether an MXFP4 bank's K tiles read its bytes as int32 words of eight codes
    (FusedMoEConfig.mxfp4_words; `_split_fields_dot`): asked for with split fields; a K tile of
    whole scale blocks and 16-deep dots (BLOCK_K >= 128); rows of whole scale blocks (K a
    multiple of 32) in 4-byte aligned words (the bank's base and strides: a layer's bank, a slot
    pool and a pinned host bank alike); bf16 or float32 activations, in which a folded scale is
    exact (`_e2m1_scaled_weight`). Otherwise the bank is read as bytes."""
    return (config.mxfp4_words and config.split_fields and config.block_k // 8 >= 16
            and config.block_k % scale_block_k == 0 and scale_block_k % 8 == 0 and k_in % scale_block_k == 0
            and dtype in (torch.bfloat16, torch.float32) and bank.stride(-1) == 1
            and bank.storage_offset() % 4 == 0 and bank.data_ptr() % 4 == 0
            and all(stride % 4 == 0 for stride in bank.stride()[:-1]))


def _pack(weight: torch.Tensor) -> int:
    """Values per stored element along K: 8 for int4 packed in int32 (or MXFP4 bytes read as
    int32 words), 2 for MXFP4 bytes, else 1."""
    return {torch.int32: 8, torch.uint8: 2}.get(weight.dtype, 1)


def _check_scales(w13, w2, w13_scale, w2_scale, block_shape):
    """Quantized banks: fp8 or packed int4 weights and float32 scales, or MXFP4 bytes and uint8
    E8M0 scales, of the layout in __init__.py."""
    if w13.dtype != w2.dtype or w13.dtype not in (torch.float8_e4m3fn, torch.int32, torch.uint8):
        raise ValueError(f"quantized weights must both be float8_e4m3fn, int32 (int4) or uint8 (mxfp4), got "
                         f"{w13.dtype}/{w2.dtype}")
    hidden_size, inter = w2.shape[1], w13.shape[1] // 2
    bn, bk = block_shape
    want13 = (w13.shape[0], 2 * triton.cdiv(inter, bn), triton.cdiv(hidden_size, bk))
    want2 = (w2.shape[0], triton.cdiv(hidden_size, bn), triton.cdiv(inter, bk))
    if tuple(w13_scale.shape) != want13 or tuple(w2_scale.shape) != want2:
        raise ValueError(f"scales {tuple(w13_scale.shape)}/{tuple(w2_scale.shape)} do not match {block_shape} blocks: "
                         f"want {want13}/{want2}")
    scale_dtype = torch.uint8 if w13.dtype == torch.uint8 else torch.float32
    if w13_scale.dtype != scale_dtype or w2_scale.dtype != scale_dtype:
        raise ValueError(f"the block scales of {w13.dtype} weights must be {scale_dtype}")
    if bk % 16:
        raise ValueError(f"block columns {bk}: the K tile (a divisor of them) must be a multiple of 16 for tl.dot")


def _check_biases(w13, w2, w13_bias, w2_bias):
    """Per-expert biases: w13_bias [S, 2I], w2_bias [S, H], each with a unit last stride."""
    if tuple(w13_bias.shape) != tuple(w13.shape[:2]) or tuple(w2_bias.shape) != tuple(w2.shape[:2]):
        raise ValueError(f"biases {tuple(w13_bias.shape)}/{tuple(w2_bias.shape)}: want {tuple(w13.shape[:2])}/"
                         f"{tuple(w2.shape[:2])}")
    if w13_bias.stride(-1) != 1 or w2_bias.stride(-1) != 1:
        raise ValueError("biases need a unit last stride")


def _check_shapes(hidden, w13, w2, topk_weights, topk_ids, quantized: bool = False):
    num_tokens, hidden_size = hidden.shape
    intermediate_size, pack = w13.shape[1] // 2, _pack(w13)
    if (w13.shape[1:] != (2 * intermediate_size, triton.cdiv(hidden_size, pack)) or w2.shape[1] != hidden_size
            or w2.shape[2] != triton.cdiv(intermediate_size, pack)):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match hidden "
                         f"{tuple(hidden.shape)}: want w13 [S, 2I, H], w2 [S, H, I]")
    if w13.shape[0] != w2.shape[0]:
        raise ValueError("w13 and w2 must have the same number of rows S")
    if not quantized and (w13.dtype != hidden.dtype or w2.dtype != hidden.dtype):
        raise ValueError(f"weights {w13.dtype}/{w2.dtype} must be in hidden's {hidden.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError("topk_ids and topk_weights must both be [T, K]")


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, *, num_routed_experts: int, block_assignment="auto",
              out=None, sum_routes=True, w13_scale=None, w2_scale=None, block_shape=None, w13_bias=None,
              w2_bias=None, activation=SILU) -> torch.Tensor:
    """Triton fused MoE; see the module docstring for the contract. sum_routes=False skips
    kernel 4 and returns route_out as [T, K, H] (hidden's dtype): the caller sums it, as
    the residual add + RMSNorm after a MoE layer does (kernels/norm_rope/triton.py)."""
    check_options(block_assignment, out, sum_routes, (w13_scale, w2_scale), block_shape, (w13_bias, w2_bias))
    if w13_bias is not None:
        _check_biases(w13, w2, w13_bias, w2_bias)
    _check_shapes(hidden, w13, w2, topk_weights, topk_ids, quantized=block_shape is not None)
    if block_shape is not None:
        _check_scales(w13, w2, w13_scale, w2_scale, block_shape)
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    intermediate_size = w13.shape[1] // 2
    if out is None and sum_routes:
        out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out if sum_routes else hidden.new_zeros(0, top_k, hidden_size)
    if block_assignment == "auto":
        block_assignment = choose_block_assignment(num_tokens, top_k, num_routed_experts, w13, w2)
    elif block_assignment == "naive" and not naive_allowed(num_tokens, top_k, num_routed_experts):
        raise ValueError(f"naive block assignment needs T*K*4 <= num_routed_experts, got "
                         f"{num_tokens}*{top_k}*4 > {num_routed_experts}")

    config = select_config(num_tokens, top_k, hidden_size, intermediate_size,
                           num_routed_experts, hidden.dtype)
    flat_ids = topk_ids.reshape(-1).contiguous()
    route_weights = topk_weights.reshape(-1).contiguous().float()
    naive = block_assignment == "naive"
    blocks = _route_blocks(flat_ids, w13.shape[0], num_routed_experts, block_assignment, config.block_m)
    act = torch.empty(flat_ids.numel(), intermediate_size, dtype=hidden.dtype, device=hidden.device)
    route_out = torch.empty(flat_ids.numel(), hidden_size, dtype=hidden.dtype,
                            device=hidden.device)
    if naive and config.route_gemv and all(route_gemv_allowed(a, bank, block_shape)
                                           for a, bank in ((hidden, w13), (act, w2))):
        launch_route_gemv(hidden, w13, act, route_weights, flat_ids, gated=True, weighted=False, a_div=top_k,
                          scales=w13_scale, block_shape=block_shape, bias=w13_bias, activation=activation)
        launch_route_gemv(act, w2, route_out, route_weights, flat_ids, gated=False, weighted=True, a_div=1,
                          scales=w2_scale, block_shape=block_shape, bias=w2_bias)
    else:
        _launch_gemm(hidden, w13, act, route_weights, blocks, flat_ids, gated=True, weighted=False,
                     a_div=top_k, naive=naive, config=config, scales=w13_scale, block_shape=block_shape,
                     bias=w13_bias, activation=activation)
        _launch_gemm(act, w2, route_out, route_weights, blocks, flat_ids, gated=False, weighted=True,
                     a_div=1, naive=naive, config=config, scales=w2_scale, block_shape=block_shape, bias=w2_bias)
    if not sum_routes:
        return route_out.view(num_tokens, top_k, hidden_size)
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        route_out, out, hidden_size, route_out.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_H=block_h, **pdl_launch(out.device))
    return out
