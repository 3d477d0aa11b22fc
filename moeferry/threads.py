"""The engine's use of torch's intra-op threads.

The engine's own torch work on the host is small (a step's bookkeeping tensors, the sampler's
staging, a CPU model's batch of a few rows): spread over torch's intra-op pool, its threads
spin at every barrier, and on a host whose cores are busy a descheduled one holds up each op
(a built-in model's generate took 30 s on a loaded two-core machine where one thread took 2 s).
So the engine's steps run with ENGINE_INTRA_OP_THREADS; the host expert kernel keeps its own
pool, sized from HOST_THREADS.
"""

from __future__ import annotations

import contextlib

import torch

ENGINE_INTRA_OP_THREADS = 1
# torch's intra-op thread count when moeferry loads (OMP_NUM_THREADS, else one per core): the
# host expert kernel's default pool is derived from it, whatever the calling thread's count
HOST_THREADS = torch.get_num_threads()


@contextlib.contextmanager
def engine_threads():
    """Inside: the calling thread's torch intra-op threads are ENGINE_INTRA_OP_THREADS; the
    count it had is restored on exit."""
    before = torch.get_num_threads()
    if before != ENGINE_INTRA_OP_THREADS:
        torch.set_num_threads(ENGINE_INTRA_OP_THREADS)
    try:
        yield
    finally:
        if before != ENGINE_INTRA_OP_THREADS:
            torch.set_num_threads(before)
