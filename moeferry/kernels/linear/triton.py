"""Skinny linear for decode: y = x @ weight.T (+ bias) for a few rows of x, in Triton.

At decode sizes a linear layer is a stream of its weight and cuBLAS leaves much of HBM's
bandwidth unused (o_proj, 2048 x 4096, with a split-K reduce of its own). The time goes to too
few programs with too little in flight, so the kernel has two paths (LinearConfig.tensor_cores;
select_config picks; the figures against cuBLAS: benchmarks/RESULTS.md, `linear`):
    CUDA cores: thousands of short programs, each owning 1-4 weight rows and BLOCK_M rows of
        x, reading the weight once with 16-byte loads and keeping fp32 partial sums per k
        lane. For one row, or up to FMA_MAX_MACS multiply-adds: faster than cuBLAS there.
    tensor cores: a 16-row tile of x against BLOCK_N weight rows, K streamed through tl.dot's
        software pipeline. At most N / 16 programs, so on these shapes it trails cuBLAS
        (benchmarks/bench_linear.py; the dispatcher sends those calls to cuBLAS).

Contract of ``linear`` (the oracle is kernels/linear/reference.py, F.linear):
    x       [M, K] bf16|fp16|fp32, unit last stride, any row stride; read only. Any M >= 0;
            rows past one row block take more programs, each re-reading its weight rows.
    weight  [N, K] dtype of x, unit last stride, any row stride; read only.
    bias    [N] dtype of x, or None.
    returns y [M, N] dtype of x, contiguous, newly allocated: fp32 products and sums, plus
            the bias in fp32, rounded once to x.dtype (to nearest, ties to even).
    config  LinearConfig, or None for select_config(M, N, K): benchmarks sweep it.

Reproducibility: one program owns each tile of y and sums its K in a fixed order (BLOCK_K
chunks in turn, then the k lanes by tl.sum on CUDA cores); no atomics, no split of K across
programs, tiles from the shapes alone: identical bits run to run and in a replayed graph.
Rows of one call are independent, but the path and tiles follow M, so a row's bits may differ
between batch sizes (as cuBLAS's do).

The grid comes from shapes only and nothing is read back to the host: a call captures in a
CUDA graph. No autotuning at run time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeferry.kernels.triton_common import dot, exact_dot, pdl_launch, rounded, wait_for_previous_kernel

__all__ = ["LinearConfig", "linear", "select_config"]

DOT_BLOCK_M = 16  # the smallest tensor-core tile (tl.dot needs 16 rows)
FMA_MAX_MACS = 1 << 24  # CUDA cores up to here: o_proj (2048 x 4096) at 2 rows, qkv at 1
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class LinearConfig:
    """Path, tiles and launch parameters of one linear call (powers of two throughout)."""

    block_m: int  # rows of x per program: 1..16 on CUDA cores, 16 on tensor cores
    block_n: int  # weight rows per program (>= 16 on tensor cores)
    block_k: int  # K chunk per loop step (>= 16)
    num_warps: int
    num_stages: int  # K chunks in flight on tensor cores (the software pipeline's depth)
    tensor_cores: bool = False

    def check(self) -> None:
        sizes = (self.block_m, self.block_n, self.block_k)
        if any(v < 1 or v & (v - 1) for v in sizes) or self.block_k < 16 or self.block_m > DOT_BLOCK_M:
            raise ValueError(f"{self}: powers of two, block_m <= 16, block_k >= 16")
        if self.tensor_cores and (self.block_m != DOT_BLOCK_M or self.block_n < 16):
            raise ValueError(f"{self}: tensor cores take 16-row tiles of >= 16 weight rows")


def select_config(m: int, n: int, k: int) -> LinearConfig:
    """Tiles for x [m, k] @ weight [n, k].T, from the H200 sweeps of benchmarks/bench_linear.py.

    CUDA cores (one row, or up to FMA_MAX_MACS multiply-adds): thousands of short programs,
    each reading a few weight rows once with many 16-byte loads in flight, at most 64 fp32
    partial sums a thread. One weight row a program up to 2048 rows (o_proj: 2048 programs),
    four past that (qkv: 1280); narrow weights are latency-bound (the router: 128 programs),
    so there each program takes its whole K at once with 8 warps. Past that budget each weight
    element meets too many rows for CUDA cores: tensor cores, 16 rows to a tile."""
    if m > 1 and m * n * k > FMA_MAX_MACS:
        block_n, block_k, num_stages = (16, 256, 4) if n <= 2048 else (32, 128, 4) if n <= 8192 else (64, 256, 3)
        return LinearConfig(DOT_BLOCK_M, block_n, min(block_k, _pow2_floor(k)), 4, num_stages, tensor_cores=True)
    block_m = min(DOT_BLOCK_M, triton.next_power_of_2(m))
    block_n = 1 if n <= 2048 else 4
    num_warps = 8 if n <= 256 else 4
    block_k = min(2048 if n <= 256 else 512, 64 * 32 * num_warps // (block_m * block_n), _pow2_floor(k))
    return LinearConfig(block_m, block_n, max(16, block_k), num_warps, 1)


def _pow2_floor(v: int) -> int:
    """The largest power of two <= v, at least 16."""
    return 1 << max(4, v.bit_length() - 1)


@triton.jit(do_not_specialize=["M"])
def _fma_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """y for BLOCK_M rows x BLOCK_N columns on CUDA cores. Lane p of the tile is (row p //
    BLOCK_N, column p % BLOCK_N) and keeps BLOCK_K fp32 partial sums, added up at the end.
    All 2-D, so both loads stay 16-byte vectors in the accumulator's own layout; a weight row
    read for several rows of x is read once from HBM, the repeats from L1."""
    wait_for_previous_kernel(PDL)
    pairs = tl.arange(0, BLOCK_M * BLOCK_N)
    num_m_blocks = tl.cdiv(M, BLOCK_M)  # adjacent programs share weight rows: repeats hit L2
    first_row = (tl.program_id(0) % num_m_blocks) * BLOCK_M
    rows = first_row + pairs // BLOCK_N
    cols = (tl.program_id(0) // num_m_blocks) * BLOCK_N + pairs % BLOCK_N
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    x_row_ptrs = x_ptr + first_row.to(tl.int64) * stride_xm + ks
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    partial = tl.zeros([BLOCK_M * BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (ks < K - k0) | EVEN_K  # EVEN_K: no K mask, folded away at compile time
        w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_M == 1:  # one row of x: loaded once, broadcast over the lanes
            x = tl.load(x_row_ptrs, mask=k_ok, other=0.0)[None, :]
            x_row_ptrs += BLOCK_K
        else:
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            x_ptrs += BLOCK_K
        partial += x.to(tl.float32) * w.to(tl.float32)
        w_ptrs += BLOCK_K
    acc = tl.sum(partial, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out_ty = y_ptr.dtype.element_ty  # rounded() gives values of out_ty: the cast is exact
    tl.store(y_ptr + rows.to(tl.int64) * stride_ym + cols, rounded(acc, out_ty).to(out_ty), mask=row_ok & col_ok)


@triton.jit(do_not_specialize=["M"])
def _dot_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PDL: tl.constexpr):
    """y for [BLOCK_M, BLOCK_N] on tensor cores, K summed in BLOCK_K chunks in order."""
    wait_for_previous_kernel(PDL)
    num_m_blocks = tl.cdiv(M, BLOCK_M)  # adjacent programs share weight rows: repeats hit L2
    rows = (tl.program_id(0) % num_m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tl.program_id(0) // num_m_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = dot(x, w, acc, IEEE)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], rounded(acc, out_ty).to(out_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)}: expected "
                         "x [M, K] and weight [N, K], bf16|fp16|fp32")
    if weight.dtype != x.dtype or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    if weight.stride(1) != 1:  # a copy would cost more than the call: the caller decides
        raise ValueError(f"weight: unit last stride expected, got strides {weight.stride()}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype}: expected [{weight.shape[0]}] {x.dtype}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           config: LinearConfig | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K].T (+ bias [N]) in one launch; see the module
    docstring for the contract."""
    _check(x, weight, bias)
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    config = config or select_config(m, n, k)
    config.check()
    grid = (triton.cdiv(n, config.block_n) * triton.cdiv(m, config.block_m),)
    args = (x, weight, y if bias is None else bias, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0))
    common = {"HAS_BIAS": bias is not None, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
              "BLOCK_K": config.block_k, "num_warps": config.num_warps, "num_stages": config.num_stages,
              **pdl_launch(x.device)}
    if config.tensor_cores:
        _dot_kernel[grid](*args, IEEE=exact_dot(x.dtype), **common)
    else:
        _fma_kernel[grid](*args, EVEN_K=k % config.block_k == 0, **common)
    return y
