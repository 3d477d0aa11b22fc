"""The GPU's side of the host kernel's mailbox (kernels/fused_moe/host_experts.cpp: the
mailbox worker): a request posted and its completion awaited by kernels, so a captured decode
graph runs the host channel without CUDA host functions.

The mailbox `box` is pinned host memory, int64 [MAILBOX_WORDS]: REQUEST, the sequence number
of the last request posted; CALL, the index of the call it asks for; DONE, the last request the
worker finished (its own cache line); BAD_CALL, 1 once a request named no call. `counter` is
device memory, int64 [2]: the last sequence number posted, and STALLED, 1 once a wait gave up.

    post_request(box, counter, call_index): counter[0] += 1; box[CALL] = call_index; then
        box[REQUEST] = counter[0], released after the CALL word (and after every write of
        the kernels before it, which the worker then reads).
    wait_done(box, counter, max_polls): returns once box[DONE] >= counter[0]; after
        `max_polls` reads without that it gives up and sets counter[STALLED] = 1, so a worker
        that is gone never hangs the GPU.

Requests go one at a time: a post follows the wait for the one before. The reference does the
same on the host (a Python loop polls); the Triton kernels read the count on the device.
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation

__all__ = ["BAD_CALL", "CALL", "CONFIRMED", "COUNTER_WORDS", "DONE", "MAILBOX_WORDS", "MAX_POLLS", "REQUEST",
           "STALLED", "post_request", "wait_done"]

REQUEST, CALL, DONE, BAD_CALL = 0, 1, 8, 16
MAILBOX_WORDS = 24
STALLED, CONFIRMED = 1, 2
COUNTER_WORDS = 3
MAX_POLLS = 1 << 26  # reads of the DONE word over PCIe (about a microsecond each): a minute or more


def post_request(box: torch.Tensor, counter: torch.Tensor, call_index: int, routes: torch.Tensor | None = None, *,
                 impl: str | None = None) -> None:
    """`routes`: integer route ids, any shape, contiguous, on the counter's device."""
    implementation("host_mailbox", counter, impl).post_request(box, counter, call_index, routes)


def wait_done(box: torch.Tensor, counter: torch.Tensor, max_polls: int = MAX_POLLS, *, impl: str | None = None) -> None:
    implementation("host_mailbox", counter, impl).wait_done(box, counter, max_polls)
