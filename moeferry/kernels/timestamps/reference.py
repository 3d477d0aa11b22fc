"""Timestamps on the host: the monotonic clock, for CPU runs and as the Triton kernel's oracle
of what goes where (kernels/timestamps)."""
from __future__ import annotations

import time

import torch


def stamp(times: torch.Tensor, counter: torch.Tensor, point: int, advance: bool) -> None:
    row = int(counter[0]) % times.shape[0]
    times[row, point] = time.monotonic_ns()
    if advance:
        counter += 1
