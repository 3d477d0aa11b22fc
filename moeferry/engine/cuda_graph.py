"""Decode CUDA graphs: one captured graph per padded batch size, replayed each decode step.

Everything a graph reads lives in static buffers written before each replay: token ids,
positions, output slots, page table, lengths. They are staged in two pinned host buffers
and reach the device in two copies per step. Rows past the live batch are padding: they
read and write the KV cache's scratch page only, and their logits are ignored.
"""

from __future__ import annotations

import logging

import torch

from moeferry.engine.batch import ForwardBatch

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Captured decode forwards for batch sizes 1, 2, 4, ... up to max_running_requests.

    Invariant: the static buffers (and each size's ForwardBatch, whose row index tensor the
    graph reads) are allocated once, before capture, and live as long as the graphs; `run`
    copies a step's inputs into them and replays the smallest graph that fits, so no captured pointer changes.
    """

    def __init__(self, runner):
        self.runner = runner
        dev = runner.device
        self.sizes = capture_sizes(runner.ec.max_running_requests)
        bmax, pages = self.sizes[-1], runner.max_pages_per_req
        self.scratch_slot = runner.scratch_page * runner.ec.page_size
        # Staging: int64 rows (token ids, positions, output slots) and int32 (page table rows,
        # then lengths), pinned on the host, mirrored on the device; the graph reads views.
        self.host64 = torch.zeros((3, bmax), dtype=torch.int64, pin_memory=True)
        self.host32 = torch.zeros(bmax * (pages + 1), dtype=torch.int32, pin_memory=True)
        self.dev64 = torch.zeros_like(self.host64, device=dev)
        self.dev32 = torch.zeros_like(self.host32, device=dev)
        self.copied = torch.cuda.Event()  # the host buffers may be rewritten once it fired
        self.input_ids, self.positions, self.out_slots = self.dev64
        self.page_table = self.dev32[:bmax * pages].view(bmax, pages)
        self.seq_lens = self.dev32[bmax * pages:]
        self._stage([], bmax)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.batches: dict[int, ForwardBatch] = {}  # kept alive: a graph reads their tensors at every replay
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self._capture_all()

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(True, self.input_ids[:b], self.positions[:b], self.out_slots[:b],
                            torch.arange(b, device=self.input_ids.device), page_table=self.page_table[:b],
                            seq_lens=self.seq_lens[:b])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model, kv = self.runner.model, self.runner.kv
        for b in reversed(self.sizes):
            batch = self.batches[b] = self._batch(b)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: compile kernels, settle the allocator
                    model(batch, kv)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b] = model(batch, kv)
            self.pool = graph.pool()
            self.graphs[b] = graph
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _stage(self, reqs, b: int) -> None:
        """Write rows [0, b) of the inputs for `reqs` (rows past them: padding) to the host
        buffers and copy them to the device."""
        n = len(reqs)
        bmax, pages = self.host64.shape[1], self.runner.max_pages_per_req
        h64, h32 = self.host64.numpy(), self.host32.numpy()
        self.copied.synchronize()  # the previous step's copy has read the buffers
        if n:
            ids, pos, slots, lens, page_lists = self.runner.decode_inputs(reqs)
            h64[0, :n], h64[1, :n], h64[2, :n] = ids, pos, slots
            h32[bmax * pages:bmax * pages + n] = lens
            self.runner.fill_page_table(h32[:bmax * pages].reshape(bmax, pages), page_lists)
        h64[:2, n:b] = 0
        h64[2, n:b] = self.scratch_slot
        h32[:bmax * pages].reshape(bmax, pages)[n:b] = self.runner.scratch_page
        h32[bmax * pages + n:bmax * pages + b] = 1
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        self.copied.record()

    def can_run(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def run(self, reqs) -> torch.Tensor:
        n = len(reqs)
        b = next(s for s in self.sizes if s >= n)
        self._stage(reqs, b)
        self.graphs[b].replay()
        return self.outputs[b][:n]
