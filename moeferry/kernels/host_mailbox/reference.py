"""The mailbox's GPU side in plain Python on the host: the oracle of kernels/host_mailbox/triton.py
(the contract: kernels/host_mailbox/__init__.py)."""
from __future__ import annotations

import torch

from moeferry.kernels.host_mailbox import CALL, DONE, REQUEST, STALLED


def post_request(box: torch.Tensor, counter: torch.Tensor, call_index: int) -> None:
    counter[0] += 1
    box[CALL] = call_index
    box[REQUEST] = counter[0].item()


def wait_done(box: torch.Tensor, counter: torch.Tensor, max_polls: int) -> None:
    target = int(counter[0])
    for _ in range(max_polls):
        if int(box[DONE]) >= target:
            return
    if int(box[DONE]) < target:
        counter[STALLED] = 1
