"""The mailbox's GPU side as two one-program Triton kernels (the contract:
kernels/host_mailbox/__init__.py). The mailbox is pinned host memory, handed over as a bare
pointer (triton_common.kernel_argument); its words are
read with volatile loads (every poll crosses PCIe) and the request is published by a
system-scope release exchange, ordered after the CALL word and the kernels before it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.kernels.host_mailbox import CALL, DONE, REQUEST, STALLED
from moeferry.kernels.triton_common import kernel_argument, pdl_launch, wait_for_previous_kernel


@triton.jit(do_not_specialize=["call_index"])
def _post_request_kernel(box_ptr, counter_ptr, call_index, REQUEST_WORD: tl.constexpr, CALL_WORD: tl.constexpr,
                         PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    sequence = tl.load(counter_ptr) + 1
    tl.store(counter_ptr, sequence)
    tl.store(box_ptr + CALL_WORD, call_index)
    tl.atomic_xchg(box_ptr + REQUEST_WORD, sequence, sem="release", scope="sys")


@triton.jit(do_not_specialize=["max_polls"])
def _wait_done_kernel(box_ptr, counter_ptr, max_polls, DONE_WORD: tl.constexpr, STALLED_WORD: tl.constexpr,
                      PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    target = tl.load(counter_ptr)
    done = tl.load(box_ptr + DONE_WORD, volatile=True)
    polls = 0
    while (done < target) & (polls < max_polls):
        done = tl.load(box_ptr + DONE_WORD, volatile=True)
        polls += 1
    if done < target:
        tl.store(counter_ptr + STALLED_WORD, 1)


def post_request(box: torch.Tensor, counter: torch.Tensor, call_index: int) -> None:
    _post_request_kernel[(1,)](kernel_argument(box, counter.is_cuda), counter, call_index, REQUEST_WORD=REQUEST, CALL_WORD=CALL,
                               num_warps=1, **pdl_launch(counter.device))


def wait_done(box: torch.Tensor, counter: torch.Tensor, max_polls: int) -> None:
    _wait_done_kernel[(1,)](kernel_argument(box, counter.is_cuda), counter, max_polls, DONE_WORD=DONE, STALLED_WORD=STALLED,
                            num_warps=1, **pdl_launch(counter.device))
