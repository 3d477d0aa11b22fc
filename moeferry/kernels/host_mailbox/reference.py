"""The mailbox's GPU side in plain Python on the host: the oracle of kernels/host_mailbox/triton.py
(the contract: kernels/host_mailbox/__init__.py)."""
from __future__ import annotations

import torch

from moeferry.kernels.host_mailbox import CALL, CONFIRMED, DONE, REQUEST, STALLED
from moeferry.kernels.host_staging import staged_copy


def post_request(box: torch.Tensor, counter: torch.Tensor, call_index: int, work: torch.Tensor | None = None,
                 at_least: int = 0, stage: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
    if work is not None and not bool((work >= at_least).any()):
        return
    if stage:
        staged_copy(stage, impl="reference")
    counter[0] += 1
    box[CALL] = call_index
    box[REQUEST] = counter[0].item()


def wait_done(box: torch.Tensor, counter: torch.Tensor, max_polls: int) -> None:
    target = int(counter[0])
    if int(counter[CONFIRMED]) >= target:
        return
    for _ in range(max_polls + 1):  # the first read, then `max_polls` polls
        if int(box[DONE]) >= target:
            counter[CONFIRMED] = target
            return
    counter[STALLED] = 1
