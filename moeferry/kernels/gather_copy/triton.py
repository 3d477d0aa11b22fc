"""Copy of an admission's misses as a Triton gather: host rows -> slot rows, no host sync.

``gather_copy(src_banks, dst_banks, plan_src, plan_dst, plan_count)`` has the signature
and the results of ``kernels/gather_copy/reference.py``.

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
the bank pointers, and split into chunks of ``tuning.chunk_bytes``. One launch per pair of banks (w13 and w2
of an expert: one launch per call) with a fixed grid of ``min(P * chunks,
tuning.programs_per_sm * SMs)`` programs, each looping over work items ``(miss, bank, chunk)`` up
to ``plan_count * chunks`` (so a call with no misses costs one wave of empty programs), and
copying its chunk in wide vectors straight from host memory over PCIe (unified addressing:
a pinned tensor's pointer is valid on the device).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moeferry.kernels.gather_copy import GatherTuning, check_banks, row_bytes
from moeferry.kernels.triton_common import HostPointer, pdl_launch, wait_for_previous_kernel

_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def _copy_chunk(src_row, dst_row, first, row_words, CHUNK_WORDS: tl.constexpr,
                BLOCK: tl.constexpr, EVEN: tl.constexpr):
    for offset in range(0, CHUNK_WORDS, BLOCK):
        w = first + offset + tl.arange(0, BLOCK)
        if EVEN:
            tl.store(dst_row + w, tl.load(src_row + w))
        else:
            tl.store(dst_row + w, tl.load(src_row + w, mask=w < row_words), mask=w < row_words)


@triton.jit
def _gather_rows_kernel(src0_ptr, dst0_ptr, src1_ptr, dst1_ptr, plan_src_ptr, plan_dst_ptr,
                        plan_count_ptr, row_words0, row_words1,
                        CHUNKS0: tl.constexpr, CHUNKS1: tl.constexpr,
                        CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr,
                        EVEN0: tl.constexpr, EVEN1: tl.constexpr,
                        NUM_PROGRAMS: tl.constexpr, PDL: tl.constexpr):
    """Work item w = miss * (CHUNKS0 + CHUNKS1) + c: chunk c of bank 0 when c < CHUNKS0,
    else chunk c - CHUNKS0 of bank 1 (CHUNKS1 = 0: one bank)."""
    wait_for_previous_kernel(PDL)
    count = tl.load(plan_count_ptr)
    per_miss = CHUNKS0 + CHUNKS1
    for work in range(tl.program_id(0), count * per_miss, NUM_PROGRAMS):
        miss = work // per_miss
        chunk = work - miss * per_miss
        src_expert = tl.load(plan_src_ptr + miss).to(tl.int64)
        dst_slot = tl.load(plan_dst_ptr + miss).to(tl.int64)
        if chunk < CHUNKS0:
            _copy_chunk(src0_ptr + src_expert * row_words0, dst0_ptr + dst_slot * row_words0,
                        chunk.to(tl.int64) * CHUNK_WORDS, row_words0, CHUNK_WORDS, BLOCK, EVEN0)
        else:
            _copy_chunk(src1_ptr + src_expert * row_words1, dst1_ptr + dst_slot * row_words1,
                        (chunk - CHUNKS0).to(tl.int64) * CHUNK_WORDS, row_words1, CHUNK_WORDS,
                        BLOCK, EVEN1)


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


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_programs(work_items: int, device: torch.device, tuning: GatherTuning) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        grid = tuning.programs_per_sm * _multiprocessors(index)
    else:
        grid = 8
    return max(1, min(work_items, grid, tuning.max_programs or grid))


def _launch(pairs, plan_src, plan_dst, plan_count, tuning: GatherTuning) -> None:
    """One launch copying the planned rows of one or two (src_words, dst_words, row_words)
    bank pairs of one word size."""
    row_words = [words for _, _, words in pairs]
    pairs = [(src, dst) for src, dst, _ in pairs]
    word_size = pairs[0][0].element_size()
    chunk_words = min(tuning.chunk_bytes // word_size, triton.next_power_of_2(max(row_words)))
    block = min(tuning.block_bytes // word_size, chunk_words)
    chunks = [triton.cdiv(words, chunk_words) for words in row_words]
    if len(pairs) == 1:  # no second bank: placeholders (never read; the interpreter copies
        # every argument back after the launch, so no tensor may be passed twice); on the
        # destination's device, where any launcher accepts them
        unused = tuple(torch.empty(1, dtype=t.dtype, device=pairs[0][1].device) for t in pairs[0])
        pairs, row_words, chunks = pairs + [unused], row_words + [1], chunks + [0]
    (src0, dst0), (src1, dst1) = pairs
    num_programs = _num_programs(plan_src.numel() * sum(chunks), dst0.device, tuning)
    needs_host_pointer = src0.device.type == "cpu" and dst0.device.type == "cuda"

    def run(wrap):
        _gather_rows_kernel[(num_programs,)](
            wrap(src0), dst0, wrap(src1), dst1, plan_src, plan_dst, plan_count,
            row_words[0], row_words[1], CHUNKS0=chunks[0], CHUNKS1=chunks[1],
            CHUNK_WORDS=chunk_words, BLOCK=block,
            EVEN0=row_words[0] % chunk_words == 0, EVEN1=row_words[1] % chunk_words == 0,
            NUM_PROGRAMS=num_programs, num_warps=tuning.num_warps, **pdl_launch(dst0.device))

    if needs_host_pointer and _HostArgumentMode.wrap:
        run(HostPointer)
        return
    try:
        run(lambda t: t)
    except (ValueError, RuntimeError, TypeError):
        if not needs_host_pointer:
            raise
        run(HostPointer)
        _HostArgumentMode.wrap = True


def gather_copy(src_banks: list[torch.Tensor], dst_banks: list[torch.Tensor],
                plan_src: torch.Tensor, plan_dst: torch.Tensor,
                plan_count: torch.Tensor, tuning: GatherTuning = GatherTuning()) -> None:
    """Copy rows ``plan_src[:count]`` of each source bank into rows ``plan_dst[:count]``.
    Consecutive banks of one word size share a launch, two at a time (an expert's w13 and
    w2: one launch per miss copy)."""
    check_banks(src_banks, dst_banks)
    pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    for src, dst in zip(src_banks, dst_banks):
        if src.shape[0] == 0 or row_bytes(src) == 0:
            continue
        src_words, dst_words = _word_views(src, dst)
        words = (src_words, dst_words, row_bytes(src) // src_words.element_size())
        if pending and pending[0][0].dtype != src_words.dtype:
            _launch(pending, plan_src, plan_dst, plan_count, tuning)
            pending = []
        pending.append(words)
        if len(pending) == 2:
            _launch(pending, plan_src, plan_dst, plan_count, tuning)
            pending = []
    if pending:
        _launch(pending, plan_src, plan_dst, plan_count, tuning)
