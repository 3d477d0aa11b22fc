"""The mailbox's GPU side as two one-program Triton kernels (the contract:
kernels/host_mailbox/__init__.py). The mailbox is pinned host memory, handed over as a bare
pointer (triton_common.kernel_argument); its words are
read with volatile loads (every poll crosses PCIe) and the request is published by a
system-scope release exchange, ordered after the CALL word and the kernels before it. A post
given routes reads them on the device first, ROUTE_BLOCK ids a pass, and posts nothing if none
is >= 0; a wait reads the mailbox only while its CONFIRMED word trails the sequence."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.kernels.host_mailbox import CALL, CONFIRMED, DONE, REQUEST, STALLED
from moeferry.kernels.triton_common import kernel_argument, pdl_launch, wait_for_previous_kernel


ROUTE_BLOCK = 256


@triton.jit(do_not_specialize=["call_index", "num_routes"])
def _post_request_kernel(box_ptr, counter_ptr, call_index, routes_ptr, num_routes, REQUEST_WORD: tl.constexpr,
                         CALL_WORD: tl.constexpr, HAS_ROUTES: tl.constexpr, ROUTE_BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    post = True
    if HAS_ROUTES:
        routed = tl.zeros([ROUTE_BLOCK], dtype=tl.int32)
        for start in range(0, num_routes, ROUTE_BLOCK):
            offs = start + tl.arange(0, ROUTE_BLOCK)
            ids = tl.load(routes_ptr + offs, mask=offs < num_routes, other=-1)
            routed = tl.maximum(routed, (ids >= 0).to(tl.int32))
        post = tl.max(routed, axis=0) > 0
    if post:
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


def post_request(box: torch.Tensor, counter: torch.Tensor, call_index: int, routes: torch.Tensor | None = None) -> None:
    has_routes = routes is not None
    _post_request_kernel[(1,)](kernel_argument(box, counter.is_cuda), counter, call_index,
                               routes if has_routes else counter, routes.numel() if has_routes else 0,
                               REQUEST_WORD=REQUEST, CALL_WORD=CALL, HAS_ROUTES=has_routes, ROUTE_BLOCK=ROUTE_BLOCK,
                               num_warps=1, **pdl_launch(counter.device))


def wait_done(box: torch.Tensor, counter: torch.Tensor, max_polls: int) -> None:
    _wait_done_kernel[(1,)](kernel_argument(box, counter.is_cuda), counter, max_polls, DONE_WORD=DONE,
                            STALLED_WORD=STALLED, CONFIRMED_WORD=CONFIRMED, num_warps=1, **pdl_launch(counter.device))
