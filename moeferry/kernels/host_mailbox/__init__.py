"""The GPU's side of the host kernel's mailbox (kernels/fused_moe/host_experts.cpp: the
mailbox worker): a request posted and its completion awaited by kernels, so a captured decode
graph runs the host channel without CUDA host functions.

The mailbox `box` is pinned host memory, int64 [MAILBOX_WORDS]: REQUEST, the sequence number
of the last request posted; CALL, the index of the call it asks for; DONE, the last request the
worker finished (its own cache line); BAD_CALL, 1 once a request named no call. `counter` is
device memory, int64 [COUNTER_WORDS]: the last sequence number posted; STALLED, 1 once a wait
gave up; CONFIRMED, the last sequence number a wait saw done.

    post_request(box, counter, call_index, work=None, at_least=0, stage=()): counter[0] += 1;
        box[CALL] = call_index; then box[REQUEST] = counter[0], released after the CALL word (and
        after every write of the kernels before it, which the worker then reads). Given `work`
        (integers on the device) it posts only if one of them is >= `at_least`: a call with
        nothing to do (a layer's host route ids all -1, a copy plan's count 0) costs the
        worker nothing, and its wait nothing. Given `stage`, (source on the device, destination
        in the mailbox's memory) pairs as kernels/host_staging's `staged_copy` takes them, a
        post first copies each source over its destination, released with the request: the
        worker's inputs (a copy plan, a layer's tokens and routes) cross in the posting launch,
        with no launch of their own (a call that posts nothing copies nothing). One program
        copies them: for a few thousand elements.
    wait_done(box, counter, max_polls): returns at once if counter[CONFIRMED] >= counter[0]
        (nothing posted since the last wait), else once box[DONE] >= counter[0], recorded in
        counter[CONFIRMED]; after `max_polls` reads without that it gives up and sets
        counter[STALLED] = 1, so a worker that is gone never hangs the GPU.

Requests go one at a time: a post follows the wait for the one before. The reference does the
same on the host (a Python loop polls); the Triton kernels read the count on the device.
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation
from moeferry.kernels.host_staging import check_pairs

__all__ = ["BAD_CALL", "CALL", "CONFIRMED", "COUNTER_WORDS", "DONE", "MAILBOX_WORDS", "MAX_POLLS", "REQUEST",
           "STALLED", "post_request", "wait_done"]

REQUEST, CALL, DONE, BAD_CALL = 0, 1, 8, 16
MAILBOX_WORDS = 24
STALLED, CONFIRMED = 1, 2
COUNTER_WORDS = 3
MAX_POLLS = 1 << 26  # reads of the DONE word over PCIe (about a microsecond each): a minute or more


def post_request(box: torch.Tensor, counter: torch.Tensor, call_index: int, work: torch.Tensor | None = None,
                 at_least: int = 0, *, stage: list[tuple[torch.Tensor, torch.Tensor]] = (),
                 impl: str | None = None) -> None:
    """`work`: integers, any shape, contiguous, on the counter's device; `stage`: (source,
    destination) pairs, see the module."""
    if stage:
        check_pairs(stage)
    implementation("host_mailbox", counter, impl).post_request(box, counter, call_index, work, at_least, list(stage))


def wait_done(box: torch.Tensor, counter: torch.Tensor, max_polls: int = MAX_POLLS, *, impl: str | None = None) -> None:
    implementation("host_mailbox", counter, impl).wait_done(box, counter, max_polls)
