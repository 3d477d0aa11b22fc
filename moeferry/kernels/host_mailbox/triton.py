"""The mailbox's GPU side as two one-program Triton kernels (the contract:
kernels/host_mailbox/__init__.py). The mailbox is pinned host memory, handed over as a bare
pointer (triton_common.kernel_argument); its words are read with volatile loads (every poll
crosses PCIe) and the request is published by a system-scope release exchange, ordered after
the CALL word, the kernels before it and, behind a barrier of the program's threads, the staged
copies every thread wrote (host_staging's copy_pair). A post given work reads it on the device
first, WORK_BLOCK values a pass, and posts nothing if none is >= at_least; a wait reads the
mailbox only while its CONFIRMED word trails the sequence."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.kernels.host_mailbox import CALL, CONFIRMED, DONE, REQUEST, STALLED
from moeferry.kernels.host_staging.triton import BLOCK as STAGE_BLOCK, copy_pair, pair_arguments
from moeferry.kernels.triton_common import kernel_argument, pdl_launch, wait_for_previous_kernel


WORK_BLOCK = 256


@triton.jit(do_not_specialize=["call_index", "num_work", "at_least", "n0", "n1", "n2"])
def _post_request_kernel(box_ptr, counter_ptr, call_index, work_ptr, num_work, at_least,
                         src0, dst0, n0, src1, dst1, n1, src2, dst2, n2,
                         REQUEST_WORD: tl.constexpr, CALL_WORD: tl.constexpr, HAS_WORK: tl.constexpr,
                         STAGED_PAIRS: tl.constexpr, WORK_BLOCK: tl.constexpr, STAGE_BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    post = True
    if HAS_WORK:
        found = tl.zeros([WORK_BLOCK], dtype=tl.int32)
        for start in range(0, num_work, WORK_BLOCK):
            offs = start + tl.arange(0, WORK_BLOCK)
            values = tl.load(work_ptr + offs, mask=offs < num_work, other=at_least - 1)
            found = tl.maximum(found, (values >= at_least).to(tl.int32))
        post = tl.max(found, axis=0) > 0
    if post:
        if STAGED_PAIRS > 0:  # every thread's copies, then the barrier: the release below covers them all
            copy_pair(src0, dst0, n0, STAGE_BLOCK)
            if STAGED_PAIRS > 1:
                copy_pair(src1, dst1, n1, STAGE_BLOCK)
            if STAGED_PAIRS > 2:
                copy_pair(src2, dst2, n2, STAGE_BLOCK)
            tl.debug_barrier()
        sequence = tl.load(counter_ptr) + 1
        tl.store(counter_ptr, sequence)
        tl.store(box_ptr + CALL_WORD, call_index)
        tl.atomic_xchg(box_ptr + REQUEST_WORD, sequence, sem="release", scope="sys")


@triton.jit(do_not_specialize=["max_polls"])
def _wait_done_kernel(box_ptr, counter_ptr, max_polls, DONE_WORD: tl.constexpr, STALLED_WORD: tl.constexpr,
                      CONFIRMED_WORD: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    target = tl.load(counter_ptr)
    if tl.load(counter_ptr + CONFIRMED_WORD) < target:
        done = tl.load(box_ptr + DONE_WORD, volatile=True)
        polls = 0
        while (done < target) & (polls < max_polls):
            done = tl.load(box_ptr + DONE_WORD, volatile=True)
            polls += 1
        if done < target:
            tl.store(counter_ptr + STALLED_WORD, 1)
        else:
            tl.store(counter_ptr + CONFIRMED_WORD, target)


def post_request(box: torch.Tensor, counter: torch.Tensor, call_index: int, work: torch.Tensor | None = None,
                 at_least: int = 0, stage: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
    has_work = work is not None
    _post_request_kernel[(1,)](kernel_argument(box, counter.is_cuda), counter, call_index,
                               work if has_work else counter, work.numel() if has_work else 0, at_least,
                               *pair_arguments(stage, counter.device),
                               REQUEST_WORD=REQUEST, CALL_WORD=CALL, HAS_WORK=has_work, STAGED_PAIRS=len(stage),
                               WORK_BLOCK=WORK_BLOCK, STAGE_BLOCK=STAGE_BLOCK, num_warps=4 if stage else 1,
                               **pdl_launch(counter.device))


def wait_done(box: torch.Tensor, counter: torch.Tensor, max_polls: int) -> None:
    _wait_done_kernel[(1,)](kernel_argument(box, counter.is_cuda), counter, max_polls, DONE_WORD=DONE,
                            STALLED_WORD=STALLED, CONFIRMED_WORD=CONFIRMED, num_warps=1, **pdl_launch(counter.device))
