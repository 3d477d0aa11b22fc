"""Recording a running engine's routing (--moe-record-routing FILE) into a routing trace
(trace.py), decode CUDA graphs included."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from moeferry.routing.trace import TraceStep, TraceWriter


class RoutingRecorder:
    """Collects one forward's routed expert ids per MoE layer on the device, and writes them
    to the trace after the forward.

    Every MoE block calls `record` in every forward, eager or inside a captured decode graph:
    it writes the layer's route count and ids into row `moe_layer` of one static device buffer
    (`buffer[L, 1 + max_rows * K]` int32: column 0 the count, then the ids), with a copy and a
    fill, no host sync, so a replayed graph records too. The runner wraps each forward in
    `step`: once the device has finished the forward (on decode, after the host read its
    sampled tokens: the step's own sync), one device-to-host copy drains the buffer into the
    trace and the counts are zeroed.

    Invariants: the buffer is allocated once and never reallocated (captured graphs hold its
    pointer); each forward is drained before the next one runs, so a trace step is exactly one
    forward's routes, in the order the layers admitted them; every MoE layer records once per
    forward with the same number of rows (checked at each drain). Once the writer's cap is
    reached, `step` stops reading the buffer: the graphs still write it, nothing reads it.
    """

    def __init__(self, writer: TraceWriter, max_rows: int, decode_rows: int, device: torch.device):
        header = writer.header
        self.writer, self.top_k, self.max_rows, self.decode_rows = writer, header.top_k, max_rows, decode_rows
        self.buffer = torch.zeros((header.num_moe_layers, 1 + max_rows * header.top_k), dtype=torch.int32,
                                  device=device)

    def record(self, moe_layer: int, topk_ids: torch.Tensor) -> None:
        """Layer `moe_layer`'s routes of this forward (`topk_ids` [T, K] on the buffer's device)."""
        routes = topk_ids.numel()
        if routes > self.max_rows * self.top_k:
            raise ValueError(f"a forward of {topk_ids.shape[0]} tokens exceeds the routing recorder's "
                             f"{self.max_rows} rows (--max-prefill-tokens, --max-running-requests)")
        row = self.buffer[moe_layer]
        row[1:1 + routes].copy_(topk_ids.reshape(-1))
        row[:1].fill_(routes)

    @contextmanager
    def step(self, is_decode: bool, num_tokens: int, demand: Callable[[], bool]) -> Iterator[None]:
        """Around one forward of `num_tokens` live tokens: then its routes into the trace, with
        `demand()` (asked after the forward) saying whether a prefill went through the cache."""
        start = time.perf_counter()
        yield
        if self.writer.full:
            return
        if self.buffer.is_cuda:
            torch.cuda.current_stream(self.buffer.device).synchronize()
        step_ms = (time.perf_counter() - start) * 1e3
        ids = self._drain(self.decode_rows if is_decode else num_tokens)
        self.writer.write(TraceStep("decode" if is_decode else "prefill", not is_decode and demand(), num_tokens,
                                    step_ms, ids))

    def _drain(self, rows: int):
        """The forward's ids [L, rows routed, K] as numpy, read in one copy; zeroes the counts."""
        # a copy even on the CPU, where .cpu() would alias the buffer zeroed next
        block = self.buffer[:, :1 + min(rows, self.max_rows) * self.top_k].to("cpu", copy=True).numpy()
        self.buffer[:, 0].zero_()
        counts = block[:, 0]
        routes = int(counts[0])
        if not 0 < routes < block.shape[1] or routes % self.top_k or (counts != routes).any():
            raise RuntimeError(f"the MoE layers recorded {counts.tolist()} routes in one forward: each layer must "
                               f"record its {self.top_k} routes per row once per forward")
        return block[:, 1:1 + routes].reshape(len(counts), routes // self.top_k, self.top_k)

    def close(self) -> None:
        self.writer.close()
