"""Pull a tensor into the GPU's L2 cache ahead of the kernel that reads it (Hopper and later).

At one to four decode requests, a layer's weights are read by a few GEMVs and the expert
GEMMs, while between them the norms, the rotary embedding, attention and the router are
latency-bound kernels that leave HBM idle for microseconds at a time. A prefetch launched on a
side stream during those kernels (engine/prefetch.py) streams the next GEMV's weight into L2,
so the GEMV reads it from there.

``prefetch_l2(t, programs)`` launches ``programs`` programs that split ``t``'s bytes into
chunks of ``CHUNK_BYTES`` and issue one bulk L2 prefetch (``cp.async.bulk.prefetch.L2``, PTX
8.0, sm_90) per chunk, or, with ``bulk=False``, one ``prefetch.global.L2`` per 128-byte line.
A prefetch is a hint: it reads nothing into registers and writes nothing, so it cannot change
any result; it only moves lines into L2. The launch shape depends on ``t``'s size only (CUDA
graph capturable). On a CPU tensor, under TRITON_INTERPRET=1 (no inline PTX there) and on a
GPU before sm_90 it launches nothing and returns False.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moeferry.kernels.triton.common import INTERPRETED

__all__ = ["CHUNK_BYTES", "LINE_BYTES", "available", "prefetch_l2"]

CHUNK_BYTES = 64 * 1024  # one bulk prefetch; a multiple of 16, as the instruction requires
LINE_BYTES = 128
_BLOCK = 128  # chunks (lines) issued at once by one program: one per thread of 4 warps


@triton.jit
def _prefetch_kernel(base_ptr, num_bytes, CHUNK: tl.constexpr, BULK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p issues the chunks p * BLOCK + [0, BLOCK), then every num_programs * BLOCK on.
    The last chunk is clamped to the tensor's end (num_bytes is a multiple of 16); lanes past
    the end repeat the last chunk, which is harmless for a prefetch."""
    num_chunks = tl.cdiv(num_bytes, CHUNK)
    for start in range(tl.program_id(0) * BLOCK, num_chunks, tl.num_programs(0) * BLOCK):
        chunk = tl.minimum(start + tl.arange(0, BLOCK), num_chunks - 1).to(tl.int64)
        addr = base_ptr + chunk * CHUNK
        if BULK:
            size = tl.minimum(num_bytes - chunk * CHUNK, CHUNK).to(tl.int32)
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                                      "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
                                      "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _gpu_has_bulk_prefetch(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def available(device: torch.device) -> bool:
    """Whether prefetch_l2 launches anything for tensors on ``device``."""
    device = torch.device(device)
    if INTERPRETED or device.type != "cuda":
        return False
    return _gpu_has_bulk_prefetch(device.index if device.index is not None else torch.cuda.current_device())


def prefetch_l2(t: torch.Tensor, programs: int = 8, *, bulk: bool = True) -> bool:
    """Launch the prefetch of ``t``'s storage span (contiguous, 16-byte aligned, a multiple of
    16 bytes long) into L2 on the current stream; returns whether a kernel was launched (see the
    module docstring for when it is not). Nothing to wait for: it produces no value."""
    if not available(t.device) or t.numel() == 0:
        return False
    if not t.is_contiguous() or t.data_ptr() % 16 or (t.numel() * t.element_size()) % 16:
        raise ValueError(f"prefetch_l2: a contiguous, 16-byte aligned tensor of a multiple of 16 bytes "
                         f"expected, got {tuple(t.shape)} {t.dtype} at {t.data_ptr():#x}")
    raw = t.view(-1).view(torch.uint8)
    _prefetch_kernel[(max(1, programs),)](raw, raw.numel(), CHUNK=CHUNK_BYTES if bulk else LINE_BYTES,
                                          BULK=bulk, BLOCK=_BLOCK, num_warps=_BLOCK // 32)
    return True
