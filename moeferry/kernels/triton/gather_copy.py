"""Copy of an admission's misses as a Triton gather: host rows -> slot rows, no host sync.

``gather_copy(src_banks, dst_banks, plan_src, plan_dst, plan_count)`` has the signature
and the results of ``kernels/reference/gather_copy.py``.

Contract
- ``src_banks[b]``: ``[E, ...]`` contiguous, pinned host memory (or device memory);
  ``dst_banks[b]``: ``[S, ...]`` contiguous device memory, same row shape and dtype.
- ``plan_src/plan_dst``: int32 ``[P]``, ``plan_count``: int32 ``[1]``, all on the device;
  the count is read by the kernel, so the launch shape is fixed (CUDA-graph capturable).
- Writes rows ``plan_dst[:count]`` of every destination bank, nothing else. Source and
  destination never alias; the plan's destination slots are distinct.
- Ordering: launched on the admission's stream, after the admission that wrote the plan and
  before the next one. Stream order then guarantees both that the plan is read before it
  is rewritten and that a call's misses are in their slots before any later admission can
  evict them.

How: each row is reinterpreted as the widest words (int64 down to bytes) that divide it and
the bank pointers, and split into chunks of 64 KiB. One launch per bank with a fixed grid of
``min(P * chunks, 4 * SMs)`` programs, each looping over work items ``(miss, chunk)`` up to
``plan_count * chunks`` (so a call with no misses costs one wave of empty programs), and
copying its chunk in wide vectors straight from host memory over PCIe (unified addressing:
a pinned tensor's pointer is valid on the device).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moeferry.kernels.reference.gather_copy import check_banks, row_bytes

_CHUNK_BYTES = 64 * 1024
_BLOCK_BYTES = 16 * 1024
_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def _gather_rows_kernel(src_ptr, dst_ptr, plan_src_ptr, plan_dst_ptr, plan_count_ptr,
                        row_words, CHUNKS: tl.constexpr, CHUNK_WORDS: tl.constexpr,
                        BLOCK: tl.constexpr, EVEN: tl.constexpr,
                        NUM_PROGRAMS: tl.constexpr):
    count = tl.load(plan_count_ptr)
    for work in range(tl.program_id(0), count * CHUNKS, NUM_PROGRAMS):
        miss = work // CHUNKS
        first = (work - miss * CHUNKS).to(tl.int64) * CHUNK_WORDS
        src_row = src_ptr + tl.load(plan_src_ptr + miss).to(tl.int64) * row_words
        dst_row = dst_ptr + tl.load(plan_dst_ptr + miss).to(tl.int64) * row_words
        for offset in range(0, CHUNK_WORDS, BLOCK):
            w = first + offset + tl.arange(0, BLOCK)
            if EVEN:
                tl.store(dst_row + w, tl.load(src_row + w))
            else:
                tl.store(dst_row + w, tl.load(src_row + w, mask=w < row_words), mask=w < row_words)


class HostPointer:
    """A host tensor handed to a kernel as a bare pointer (``data_ptr`` and ``dtype``), for
    launchers that refuse a CPU tensor. Valid only for pinned memory under unified
    addressing, where the host pointer is also the device pointer."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


class _HostArgumentMode:
    """Remembers whether this process' launcher needed HostPointer (probed once)."""

    wrap = False


def _word_views(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    nbytes = row_bytes(src)
    for size, dtype in _WORD_DTYPES:
        if nbytes % size == 0 and src.data_ptr() % size == 0 and dst.data_ptr() % size == 0:
            return (src.view(torch.uint8).reshape(-1).view(dtype),
                    dst.view(torch.uint8).reshape(-1).view(dtype))
    raise AssertionError("unreachable: bytes always divide")


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_programs(work_items: int, device: torch.device) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(work_items, 4 * _multiprocessors(index)))
    return max(1, min(work_items, 8))


def _launch(src_words, dst_words, plan_src, plan_dst, plan_count, row_words: int) -> None:
    word_size = src_words.element_size()
    chunk_words = min(_CHUNK_BYTES // word_size, triton.next_power_of_2(row_words))
    block = min(_BLOCK_BYTES // word_size, chunk_words)
    chunks = triton.cdiv(row_words, chunk_words)
    num_programs = _num_programs(plan_src.numel() * chunks, dst_words.device)
    needs_host_pointer = src_words.device.type == "cpu" and dst_words.device.type == "cuda"

    def run(src_arg):
        _gather_rows_kernel[(num_programs,)](
            src_arg, dst_words, plan_src, plan_dst, plan_count, row_words,
            CHUNKS=chunks, CHUNK_WORDS=chunk_words, BLOCK=block,
            EVEN=row_words % chunk_words == 0, NUM_PROGRAMS=num_programs, num_warps=8)

    if needs_host_pointer and _HostArgumentMode.wrap:
        run(HostPointer(src_words))
        return
    try:
        run(src_words)
    except (ValueError, RuntimeError, TypeError):
        if not needs_host_pointer:
            raise
        run(HostPointer(src_words))
        _HostArgumentMode.wrap = True


def gather_copy(src_banks: list[torch.Tensor], dst_banks: list[torch.Tensor],
                plan_src: torch.Tensor, plan_dst: torch.Tensor,
                plan_count: torch.Tensor) -> None:
    """Copy rows ``plan_src[:count]`` of each source bank into rows ``plan_dst[:count]``."""
    check_banks(src_banks, dst_banks)
    for src, dst in zip(src_banks, dst_banks):
        if src.shape[0] == 0 or row_bytes(src) == 0:
            continue
        src_words, dst_words = _word_views(src, dst)
        row_words = row_bytes(src) // src_words.element_size()
        _launch(src_words, dst_words, plan_src, plan_dst, plan_count, row_words)
