"""Miss copies on the GPU's copy engine (DMA), their plan decided on the device: the other way
to run `gather_copy` beside compute (copy_engine.cpp has the protocol).

    engine = CopyEngine(host_banks, slot_banks, capacity, device)   # a worker thread starts
    engine.post(layer, plan)   # on the current stream, one launch: the plan [1 + 2P] (count,
                               # sources, destinations) staged to pinned memory, a request posted
    engine.wait()              # on the current stream: returns once that request's copies landed

Both are device work (two one-program kernels), so they replay inside a captured
decode graph; the copies themselves are issued by the worker on its own stream as each request
arrives. The SM gather (triton.py) reads host memory with loads from every SM, which slows a
kernel running beside it several-fold; the copy engine leaves the SMs to the compute (RESULTS
copy/beside-compute).

The lookahead prefetch copies through it by default (moe/prefetch.py, --moe-prefetch-copy), and a
slot store's demand copies under --moe-miss-copy dma (moe/stores.py SlotStore.copy_engine).
The main thread must not read results back with a pageable copy while a graph waits on the
worker: that read blocks in the driver and stalls the worker's calls (the engine's sampler
reads through pinned memory and an event; tests/kernels/test_copy_engine.py).

Invariants: one request in flight (`post` after the last `wait`); the banks' tensors outlive
the engine (their addresses are in its table); `close` (or the engine's collection) stops the
worker.
"""
from __future__ import annotations

import ctypes
import functools
import weakref
from pathlib import Path

import torch

from moeferry.kernels import cpp_build, host_mailbox
from moeferry.kernels.gather_copy import row_bytes

SOURCE = Path(__file__).with_name("copy_engine.cpp")
FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17", "-pthread", "-msse2")


class MoECopyTable(ctypes.Structure):
    """copy_engine.cpp's MoECopyTable, field for field."""

    _fields_ = [("box", ctypes.c_void_p), ("plan", ctypes.c_void_p), ("capacity", ctypes.c_int64),
                ("layers", ctypes.c_int64), ("banks", ctypes.c_int64), ("host", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("row_bytes", ctypes.c_void_p), ("stream", ctypes.c_void_p)]


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    lib = cpp_build.build(SOURCE, FLAGS, "moeferry_copy_engine")
    lib.moe_copy_engine_start.argtypes = [ctypes.POINTER(MoECopyTable), ctypes.c_char_p, ctypes.c_int64]
    lib.moe_copy_engine_start.restype = ctypes.c_void_p
    lib.moe_copy_engine_stop.argtypes = [ctypes.c_void_p]
    lib.moe_copy_engine_stop.restype = None
    return lib


def available(device: torch.device) -> bool:
    """Whether copies can go to the copy engine here: a CUDA device and a worker that builds."""
    if torch.device(device).type != "cuda":
        return False
    try:
        library()
    except cpp_build.BuildUnavailable:
        return False
    return True


class CopyEngine:
    """A worker copying planned rows of `host_banks` (per MoE layer, one list of pinned [E, ...]
    banks) into `slot_banks` (the pool's [S, ...] banks, the same order) by DMA."""

    def __init__(self, host_banks: list[list[torch.Tensor]], slot_banks: list[torch.Tensor], capacity: int,
                 device: torch.device):
        banks = len(slot_banks)
        if any(len(layer) != banks for layer in host_banks):
            raise ValueError("every layer needs as many host banks as there are slot banks")
        self.device = torch.device(device)
        self.capacity = capacity
        self.box = torch.zeros(host_mailbox.MAILBOX_WORDS, dtype=torch.int64, pin_memory=True)
        self.counter = torch.zeros(host_mailbox.COUNTER_WORDS, dtype=torch.int64, device=self.device)
        self.plan = torch.zeros(1 + 2 * capacity, dtype=torch.int32, pin_memory=True)
        self.stream = torch.cuda.Stream(self.device)
        self._host = (ctypes.c_uint64 * (len(host_banks) * banks))(
            *[bank.data_ptr() for layer in host_banks for bank in layer])
        self._slots = (ctypes.c_uint64 * banks)(*[bank.data_ptr() for bank in slot_banks])
        self._row_bytes = (ctypes.c_int64 * banks)(*[row_bytes(bank) for bank in slot_banks])
        self._table = MoECopyTable(self.box.data_ptr(), self.plan.data_ptr(), capacity, len(host_banks), banks,
                                   ctypes.addressof(self._host), ctypes.addressof(self._slots),
                                   ctypes.addressof(self._row_bytes), self.stream.cuda_stream)
        error = ctypes.create_string_buffer(256)
        with torch.cuda.device(self.device):
            handle = library().moe_copy_engine_start(ctypes.byref(self._table), error, len(error))
        if not handle:
            raise RuntimeError(f"the copy engine's worker did not start: {error.value.decode()}")
        self._stop = weakref.finalize(self, library().moe_copy_engine_stop, handle)

    def post(self, layer: int, plan: torch.Tensor) -> None:
        """Copy `plan`'s rows (int32 [1 + 2P] on the device, contiguous) of MoE layer `layer`'s
        host banks: one launch on the current stream stages the plan to pinned memory and posts
        the request; a plan of no rows stages and posts nothing (its wait returns at once)."""
        if plan.numel() != self.plan.numel():
            raise ValueError(f"a plan of {plan.numel()} words for a copy engine of {self.plan.numel()}")
        host_mailbox.post_request(self.box, self.counter, layer, plan[:1], 1, stage=[(plan, self.plan)])

    def wait(self, max_polls: int = host_mailbox.MAX_POLLS) -> None:
        """The current stream waits until the last posted request's copies have landed (or
        gives up after `max_polls` reads, flagged: `failed`)."""
        host_mailbox.wait_done(self.box, self.counter, max_polls)

    def error_code(self) -> int:
        """The driver's error code of a failed request (-1: a bad plan or layer), 0 while none
        failed: reads pinned memory, no device sync."""
        return int(self.box[host_mailbox.BAD_CALL])

    def failed(self) -> str | None:
        """Why a request went wrong (a driver error, or a wait that gave up), or None; reads one
        device word (a sync)."""
        code = self.error_code()
        if code:
            return f"a copy failed (CUDA driver error {code})"
        if int(self.counter[host_mailbox.STALLED].item()):
            return "a wait for copies gave up"
        return None

    def close(self) -> None:
        self._stop()
