"""The decode route GEMV: fused MoE's two GEMMs for one token's routes, on CUDA cores.

At one token each route is a vector against one expert's matrices (the naive block assignment),
so each GEMM is a matrix-vector product per route. A tensor-core tile pads that vector to 16 rows,
decodes every weight into the dot's operand layout and, at decode sizes, leaves too few warps in
flight to hide a K loop of dependent loads. Here each program owns BLOCK_N rows of one route's
matrix (gated: BLOCK_N gate rows and their up rows, loaded together) and walks K in a few long
steps of STEP stored elements, multiplying the weights, unpacked in registers, with the
activations in fp32. At 4 bits a weight the HBM floor leaves a few instructions a weight, so each
format is decoded the cheapest exact way:
    plain (bf16, fp16, fp32) and fp8: converted to fp32; fp8's block scale multiplies each
        stored element's product.
    int4 (eight values a word along K, stored + 8): a value n enters fp32 as 1 + n / 16, its four
        bits put at the top of a mantissa whose exponent is 1.0's (a shift and one logic op, no
        int-to-float conversion). With fp32 activations 1.5 comes off each value ((n - 8) / 16,
        exact); otherwise a word's eight products are summed first and 1.5 times its eight
        activations come off the sum (an instruction saved a weight, about two of fp32's 24
        bits lost to the cancellation, far below a bf16 output's 8). The sums are multiplied
        by 16 at the end (exact).
    MXFP4 (E2M1 codes, read as int32 words of eight): the code's magnitude bits at float32's
        bits 24-22 and its sign at bit 31 are exactly value * 2^-126 (a subnormal for 0.5,
        which FFMA keeps); the activations are multiplied by 2^64 to keep the products normal
        and the sums by 2^62 and the block's E8M0 power of two at the end (all exact).
With int8 activations (`launch_route_gemv(int8=True)`, int4 banks), the numerics of the host
kernel's int8 path (host_experts.cpp; reference.int8_expert_routes is the oracle): each group of
a row of activations quantized to int8 (d = max |x| / 127, q = x / d rounded half to even, both
divisions IEEE), each group's sum of (n - 8) q exact in int32 from byte dot products (dp4a: the
nibbles of a word split into two words of four bytes, against the activations packed to match,
eight products in two instructions), and acc = acc + float(sum) * (scale * d) in group order with
no fused multiply-add. Every program quantizes the activations it reads again (no launch of its
own), which costs it a share of its instructions that grows with fewer rows a program.
Per route and output column the sums run in a fixed order (K steps in turn, a stored element's
fields in order, the tile's partial sums by tl.sum), no atomics: bit-identical run to run, over a
layer's bank and over a slot pool holding the same rows. The tensor-core kernel sums in another
order, so the two agree to rounding, not in bits; a call takes one or the other by its shapes
alone (FusedMoEConfig.route_gemv).

Contract (as kernels/fused_moe/triton.py's, for the calls `route_gemv_allowed` accepts):
    a       [T or N, K] activations (hidden, or the gated GEMM's output), unit last stride.
    bank    [S, rows, K / PACK] stored elements, unit last stride: rows = 2 n_out gated (gate
            rows, then up rows), n_out otherwise; int4 as int32 words, MXFP4 bytes viewed as
            int32 words (4-byte aligned), fp8 or plain values as stored.
    scales  the format's block scales (layout in kernels/fused_moe/__init__.py), or None.
    out     [N routes, n_out], written whole: gated silu(gate) * up (or gpt-oss's clamped
            SwiGLU), else route_weight * (a @ bank^T + bias).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeferry.kernels.fused_moe import SILU
from moeferry.kernels.fused_moe.values import activate, e2m1_value, e8m0_value
from moeferry.kernels.triton_common import INTERPRETED, pdl_launch, rounded, wait_for_previous_kernel

__all__ = ["GemvConfig", "launch_route_gemv", "route_gemv_allowed", "select_gemv_config", "stored_row"]

# Formats as the kernel sees them (its FORMAT; constexpr globals, which a kernel may read).
PLAIN, FP8, INT4, MXFP4 = (tl.constexpr(code) for code in range(4))
_INTERPRETED = tl.constexpr(INTERPRETED)


# A down GEMM's MXFP4 rows at least this many words long take the gated GEMM's tiles
LONG_MXFP4_ROW_WORDS = 256


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of one route-GEMV launch: BLOCK_N rows of the expert matrix a program, STEP stored
    elements of each row a loop step (powers of two), num_warps."""

    block_n: int
    step: int
    num_warps: int


def select_gemv_config(gated: bool, stored: torch.dtype, row_elements: int) -> GemvConfig:
    """Tiles for one GEMM of a bank of `stored` elements, `row_elements` of them a row (words for
    int4 and MXFP4), from benchmarks/sweep_route_gemv.py at one token on an H100 (docs/
    performance.md, the route GEMV): the gated GEMM reads each row's whole K in one to three steps
    (int4 and MXFP4: 128 words; both matrices' loads in flight together); a down GEMM's short rows
    (Qwen3-30B-A3B's 96 words of 4-bit values) in 32-row tiles, MXFP4's long ones (gpt-oss-20b's
    360) as the gated GEMM's, 8 rows of 128 words."""
    if stored == torch.int32:  # int4 words
        return GemvConfig(block_n=16, step=128, num_warps=4) if gated else GemvConfig(32, 32, 4)
    if stored == torch.uint8:  # MXFP4 bytes, read as words
        long_rows = row_elements >= LONG_MXFP4_ROW_WORDS
        return GemvConfig(block_n=8, step=128, num_warps=4) if gated or long_rows else GemvConfig(32, 32, 4)
    if stored == torch.float8_e4m3fn:
        return GemvConfig(block_n=16, step=256, num_warps=4)
    return GemvConfig(block_n=8, step=256, num_warps=4)


def stored_row(bank: torch.Tensor) -> int:
    """Stored elements of a bank's row as the kernel reads them (MXFP4 bytes as int32 words)."""
    return bank.shape[-1] // 4 if bank.dtype == torch.uint8 else bank.shape[-1]


def _format(bank: torch.Tensor, quantized: bool) -> tuple[int, int]:
    """(FORMAT, PACK) of a bank as stored: PACK values a stored element as the kernel reads it
    (MXFP4 bytes as int32 words of eight codes)."""
    if not quantized:
        return PLAIN.value, 1
    fmt, pack = {torch.float8_e4m3fn: (FP8, 1), torch.int32: (INT4, 8), torch.uint8: (MXFP4, 8)}[bank.dtype]
    return fmt.value, pack


def route_gemv_allowed(a: torch.Tensor, bank: torch.Tensor, block_shape) -> bool:
    """Whether the route GEMV can read this bank: unit last strides; MXFP4 bytes in 4-byte aligned
    rows of whole words and scale blocks of whole words; a scale group of whole stored elements."""
    if a.stride(-1) != 1 or bank.stride(-1) != 1:
        return False
    if block_shape is None:
        return True
    elements = block_shape[1] // (1 if bank.dtype == torch.float8_e4m3fn else 8)  # stored a scale group
    if elements < 1 or elements & (elements - 1) or elements * (block_shape[1] // elements) != block_shape[1]:
        return False
    if bank.dtype == torch.uint8:  # read as int32 words
        return (bank.data_ptr() % 4 == 0 and bank.storage_offset() % 4 == 0 and bank.shape[-1] % 4 == 0
                and all(stride % 4 == 0 for stride in bank.stride()[:-1]))
    return True


@triton.jit
def _field_bits(stored, i: tl.constexpr, at: tl.constexpr):
    """Field i (bits 4i..4i+3) of int32 words moved to bits at..at+3 (the bits around them
    arbitrary): one shift."""
    if 4 * i <= at:
        return stored << (at - 4 * i)
    else:
        return stored >> (4 * i - at)


@triton.jit
def _int4_field(stored, i: tl.constexpr):
    """int4 field i of int32 words as fp32 1 + n / 16 (n the stored nibble, value n - 8): the
    nibble as the top of the mantissa of 1.0 (a shift and one logic op)."""
    return ((_field_bits(stored, i, 19) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_field(stored, i: tl.constexpr):
    """E2M1 field i of int32 words as fp32 value * 2^-126: the code's magnitude bits (two of
    exponent, one of mantissa) at float32's bits 24-22 and its sign at bit 31 make exactly that
    number, a subnormal for the code 0.5 (FFMA keeps subnormals). The field alone (one logic op)
    times 2^s + 2^(s + 6) holds two copies of it that cannot overlap, one with its magnitude at
    bits 24-22 and one with its sign at bit 31, which one more logic op keeps: three operations a
    value, the multiply on the FMA pipe. Fields 6 and 7, whose magnitude must move down, are
    fields 2 and 3 of the word shifted right by 16 (one shift for both)."""
    if i >= 6:
        field = (stored >> 16) & (0xF << (4 * i - 16))
        shift: tl.constexpr = 22 - 4 * (i - 4)
    else:
        field = stored & (0xF << (4 * i))
        shift: tl.constexpr = 22 - 4 * i
    both = field * ((1 << shift) + (1 << (shift + 6)))
    return (both & -0x7E400000).to(tl.float32, bitcast=True)


@triton.jit
def _row_sums(a_row_ptr, rows_ptrs, scale_rows_ptrs, stride_sk, k_in, col_valid,
              FORMAT: tl.constexpr, PACK: tl.constexpr, GROUP: tl.constexpr, STEP: tl.constexpr,
              EVEN: tl.constexpr):
    """[BLOCK_N] fp32: each row's a . w over all of K, STEP stored elements a step (EVEN: K is
    whole steps and the rows all valid, so no mask). The tile [BLOCK_N, STEP] of stored elements
    keeps a partial sum per element; 4-bit words are taken field by field (field i of element j
    is k = 8 j + i) against a's matching values, their products summed in the thread that
    unpacked them and scaled by their group's scale; the partial sums are added across the tile
    once, after the last step."""
    offs_e = tl.arange(0, STEP)
    num_elems = tl.cdiv(k_in, PACK)
    num_groups = tl.cdiv(k_in, GROUP)
    w_ptrs = rows_ptrs[:, None] + offs_e[None, :]
    partial = tl.zeros((col_valid.shape[0], STEP), dtype=tl.float32)
    for step in range(0, num_elems, STEP):
        e = step + offs_e
        stored_mask = col_valid[:, None] & (e < num_elems)[None, :]
        if EVEN:
            stored = tl.load(w_ptrs)
        elif FORMAT == INT4 or FORMAT == MXFP4:
            stored = tl.load(w_ptrs, mask=stored_mask, other=0)
        else:
            stored = tl.load(w_ptrs, mask=stored_mask, other=0.0)
        if FORMAT == PLAIN or FORMAT == FP8:
            a = tl.load(a_row_ptr + e, mask=(e < k_in) | EVEN, other=0.0).to(tl.float32)
            sums = stored.to(tl.float32) * a[None, :]
        else:
            sums = tl.zeros(stored.shape, dtype=tl.float32)
            a_sum = tl.zeros(offs_e.shape, dtype=tl.float32)
            EXACT: tl.constexpr = a_row_ptr.dtype.element_ty == tl.float32
            for i in tl.static_range(PACK):
                k = e * PACK + i
                a = tl.load(a_row_ptr + k, mask=(k < k_in) | EVEN, other=0.0).to(tl.float32)
                if FORMAT == INT4 and EXACT:  # (1 + n / 16) - 1.5 = (n - 8) / 16, exact
                    sums += (_int4_field(stored, i) - 1.5) * a[None, :]
                elif FORMAT == INT4:  # sum a (1 + n / 16), less 1.5 sum a below: fp32 loses ~2 bits
                    sums += _int4_field(stored, i) * a[None, :]
                    a_sum += a
                else:  # a * 2^64 keeps the products of values * 2^-126 normal
                    sums += _e2m1_field(stored, i) * (a * 18446744073709551616.0)[None, :]
            if FORMAT == INT4 and not EXACT:
                sums -= 1.5 * a_sum[None, :]
        if FORMAT != PLAIN:
            group = e * PACK // GROUP
            scale_ptrs = scale_rows_ptrs[:, None] + group[None, :] * stride_sk
            if EVEN:
                scales = tl.load(scale_ptrs)
            elif FORMAT == MXFP4:
                scales = tl.load(scale_ptrs, mask=col_valid[:, None] & (group < num_groups)[None, :], other=127)
            else:
                scales = tl.load(scale_ptrs, mask=col_valid[:, None] & (group < num_groups)[None, :], other=0.0)
            if FORMAT == MXFP4:
                scales = e8m0_value(scales.to(tl.int32))
            sums *= scales
        partial += sums
        w_ptrs += STEP
    acc = tl.sum(partial, axis=1)
    if FORMAT == INT4:
        acc *= 16.0  # the values were (n - 8) / 16: exact
    elif FORMAT == MXFP4:
        acc *= 4611686018427387904.0  # 2^62 = 2^126 / 2^64: exact
    return acc


@triton.jit
def _dp4a(w, a, c):
    """c + the sum of the products of w's four unsigned bytes and a's four signed bytes (int32
    lanes; dp4a.u32.s32 on the GPU, the same integers by shifts under the interpreter)."""
    if _INTERPRETED:
        for b in tl.static_range(4):
            c += ((w >> (8 * b)) & 0xFF) * ((a << (24 - 8 * b)) >> 24)
        return c
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [w, a, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _packed_bytes(q):
    """int32 words [n] of four signed bytes from q [n, 4] (byte b = q[:, b], two's complement)."""
    shifts = 8 * tl.arange(0, 4)
    return tl.sum((q & 0xFF) << shifts[None, :], axis=1)


@triton.jit
def _int8_row_sums(a_row_ptr, rows_ptrs, scale_rows_ptrs, stride_sk, k_in, col_valid,
                   GROUP: tl.constexpr, STEP: tl.constexpr, EVEN: tl.constexpr):
    """[BLOCK_N] fp32: each row's a . w over all of K in the int8 path (the module), int4 words
    STEP a step, GROUP values a scale group (STEP * 8 a multiple of GROUP, GROUP of 8)."""
    GROUPS: tl.constexpr = STEP * 8 // GROUP  # groups a step
    WORDS: tl.constexpr = GROUP // 8  # words a group
    offs_e = tl.arange(0, STEP)
    offs_k = tl.arange(0, STEP * 8)
    offs_g = tl.arange(0, GROUPS)
    num_elems = tl.cdiv(k_in, 8)
    num_groups = tl.cdiv(k_in, GROUP)
    w_ptrs = rows_ptrs[:, None] + offs_e[None, :]
    acc = tl.zeros(col_valid.shape, dtype=tl.float32)
    for step in range(0, num_elems, STEP):
        if EVEN:
            stored = tl.load(w_ptrs)
        else:
            stored = tl.load(w_ptrs, mask=col_valid[:, None] & ((step + offs_e) < num_elems)[None, :], other=0)
        k = step * 8 + offs_k
        x = tl.load(a_row_ptr + k, mask=(k < k_in) | EVEN, other=0.0).to(tl.float32)
        x = tl.reshape(x, (GROUPS, GROUP))
        amax = tl.max(tl.abs(x), axis=1)
        d = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
        divisor = tl.broadcast_to(tl.where(d > 0, d, 1.0)[:, None], x.shape)
        # rounded half to even by adding and taking off 1.5 * 2^23 (|x / d| <= 127)
        q = tl.where(d[:, None] > 0, (tl.math.div_rn(x, divisor) + 12582912.0) - 12582912.0, 0.0)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int32)
        q_sums = tl.sum(q, axis=1)
        even, odd = tl.split(tl.reshape(q, (STEP, 4, 2)))  # field i of word j is k = 8 j + i
        dots = _dp4a(stored & 0x0F0F0F0F, _packed_bytes(even)[None, :], tl.zeros(stored.shape, tl.int32))
        dots = _dp4a((stored >> 4) & 0x0F0F0F0F, _packed_bytes(odd)[None, :], dots)
        sums = tl.sum(tl.reshape(dots, (col_valid.shape[0], GROUPS, WORDS)), axis=2) - 8 * q_sums[None, :]
        group = step * 8 // GROUP + offs_g
        scale_ptrs = scale_rows_ptrs[:, None] + group[None, :] * stride_sk
        if EVEN:
            scales = tl.load(scale_ptrs)
        else:
            scales = tl.load(scale_ptrs, mask=col_valid[:, None] & (group < num_groups)[None, :], other=0.0)
        terms = sums.to(tl.float32) * (scales * d[None, :])
        for g in tl.static_range(GROUPS):  # in group order, each add rounded (no fused multiply-add)
            acc = acc + tl.sum(tl.where(offs_g[None, :] == g, terms, 0.0), axis=1)
        w_ptrs += STEP
    return acc


@triton.jit
def _route_gemv_kernel(
    a_ptr, b_ptr, c_ptr, route_weight_ptr, ids_ptr, num_routes, n_out, k_in,
    stride_am, stride_be, stride_bn, stride_cm,
    scale_ptr, stride_se, stride_sn, stride_sk, up_scale_row,
    bias_ptr, stride_bias_e, alpha, limit,
    FORMAT: tl.constexpr, PACK: tl.constexpr, GROUP: tl.constexpr, SCALE_BN: tl.constexpr,
    A_ROWS_PER_ROUTE_DIV: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
    BIAS: tl.constexpr, CLAMPED: tl.constexpr, INT8: tl.constexpr,
    BLOCK_N: tl.constexpr, STEP: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr,
):
    """c[route, n] for BLOCK_N columns of one route (program: route fastest, so a step's routes
    start together). GATED: the program's tile has 2 BLOCK_N rows, gate row j at 2j and up row j
    at 2j + 1, so both matrices' loads are in flight in one loop and share a's values."""
    wait_for_previous_kernel(PDL)
    route = tl.program_id(0) % num_routes
    ROWS: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    tile_rows = tl.arange(0, ROWS)
    if GATED:
        cols, up = tile_rows // 2, tile_rows % 2
    else:
        cols, up = tile_rows, 0
    cols += (tl.program_id(0) // num_routes) * BLOCK_N
    expert = tl.load(ids_ptr + route).to(tl.int64)
    a_row_ptr = a_ptr + (route // A_ROWS_PER_ROUTE_DIV).to(tl.int64) * stride_am
    rows_ptrs = b_ptr + expert * stride_be + (cols + up * n_out).to(tl.int64) * stride_bn
    scale_rows_ptrs = scale_ptr + expert * stride_se + (cols // SCALE_BN + up * up_scale_row) * stride_sn
    if INT8:
        acc = _int8_row_sums(a_row_ptr, rows_ptrs, scale_rows_ptrs, stride_sk, k_in, cols < n_out, GROUP, STEP, EVEN)
    else:
        acc = _row_sums(a_row_ptr, rows_ptrs, scale_rows_ptrs, stride_sk, k_in, cols < n_out,
                        FORMAT, PACK, GROUP, STEP, EVEN)
    if BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + cols + up * n_out, mask=cols < n_out,
                       other=0.0).to(tl.float32)
    offs_n = (tl.program_id(0) // num_routes) * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATED:
        gate, up_sums = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
        acc = activate(gate, up_sums, alpha, limit, CLAMPED)
    if WEIGHTED:
        acc *= tl.load(route_weight_ptr + route)
    out_type: tl.constexpr = c_ptr.dtype.element_ty
    tl.store(c_ptr + route.to(tl.int64) * stride_cm + offs_n, rounded(acc, out_type).to(out_type), mask=offs_n < n_out)


def launch_route_gemv(a, bank, c, route_weights, flat_ids, *, gated: bool, weighted: bool, a_div: int,
                      scales=None, block_shape=None, bias=None, activation=SILU, config: GemvConfig | None = None,
                      int8: bool = False):
    """c [N routes, n_out] = route r's row of a (row r // a_div) through expert flat_ids[r]'s rows
    of bank (see the module); `route_gemv_allowed` must hold. config: None for select_gemv_config.
    int8: the int8 path (int4 banks, scale groups of a multiple of 8 values that divide a step)."""
    quantized = scales is not None
    fmt, pack = _format(bank, quantized)
    if int8 and (fmt != INT4.value or block_shape[1] % 8):
        raise ValueError(f"the route GEMV's int8 path reads int4 banks in groups of a multiple of 8 values, not "
                         f"{bank.dtype} in groups of {block_shape and block_shape[1]}")
    config = config or select_gemv_config(gated, bank.dtype, stored_row(bank))
    if fmt == MXFP4.value:
        bank = bank.view(torch.int32)  # eight E2M1 codes a word, value 8w + i at bits 4i: int4's layout
    group = block_shape[1] if quantized else 1
    if int8 and (config.step * 8) % group:
        config = GemvConfig(config.block_n, group // 8, config.num_warps)  # a step of whole groups
    scale_bn = block_shape[0] if quantized else 1
    if not quantized:  # unread placeholders
        scales = route_weights
    scale_strides = scales.stride() if quantized else (0, 0, 0)
    n_out, num_routes = c.shape[1], flat_ids.numel()
    grid = (num_routes * triton.cdiv(n_out, config.block_n),)
    _route_gemv_kernel[grid](
        a, bank, c, route_weights, flat_ids, num_routes, n_out, a.shape[1],
        a.stride(0), bank.stride(0), bank.stride(1), c.stride(0),
        scales, *scale_strides, triton.cdiv(n_out, scale_bn),
        route_weights if bias is None else bias, 0 if bias is None else bias.stride(0),
        activation.alpha, activation.limit,
        FORMAT=fmt, PACK=pack, GROUP=group, SCALE_BN=scale_bn, A_ROWS_PER_ROUTE_DIV=a_div,
        GATED=gated, WEIGHTED=weighted, BIAS=bias is not None, CLAMPED=activation.name == "clamped_swiglu",
        INT8=int8, BLOCK_N=config.block_n, STEP=config.step,
        EVEN=n_out % config.block_n == 0 and a.shape[1] % (config.step * pack) == 0, num_warps=config.num_warps,
        enable_fp_fusion=not int8, **pdl_launch(a.device),
    )
