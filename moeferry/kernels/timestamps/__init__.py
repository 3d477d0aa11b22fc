"""Device timestamps inside a captured graph: where the time of one decode step goes, layer by
layer, measured where it is spent (bench_hybrid --parts timeline; moe/timeline.py).

    stamp(times, counter, point, advance=False): times[counter[0] % rows, point] = now, in
        nanoseconds of the device's clock (on a GPU %globaltimer, a clock all of its SMs
        share; on the host the monotonic clock); with `advance`, then counter[0] += 1, so the
        next step's stamps go to the next row.

`times` is int64 [rows, points] and `counter` int64 [1], both on the device the stream runs
on; `point` is fixed per call site (a graph captures it). A stamp is ordered after every
kernel before it on the stream and before every kernel after it (under programmatic
dependent launch it waits for its predecessor first), so two stamps bracket the work between
them. Only differences of stamps of one device mean anything.
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation

__all__ = ["stamp"]


def stamp(times: torch.Tensor, counter: torch.Tensor, point: int, advance: bool = False, *,
          impl: str | None = None) -> None:
    implementation("timestamps", counter, impl).stamp(times, counter, point, advance)
