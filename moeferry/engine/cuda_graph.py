"""Decode CUDA graphs: one captured graph per padded batch size, replayed each decode step.

Everything a graph reads lives in static buffers written before each replay: token ids,
positions, output slots, page table, lengths. Rows past the live batch are padding: they
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
        bmax = self.sizes[-1]
        ps = runner.ec.page_size
        scratch_slot = runner.scratch_page * ps
        self.input_ids = torch.zeros(bmax, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(bmax, dtype=torch.int64, device=dev)
        self.out_slots = torch.full((bmax,), scratch_slot, dtype=torch.int64, device=dev)
        self.page_table = torch.full((bmax, runner.max_pages_per_req), runner.scratch_page, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(bmax, dtype=torch.int32, device=dev)
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
        self._reset_padding(self.sizes[-1], 0)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _reset_padding(self, bmax: int, live: int) -> None:
        ps = self.runner.ec.page_size
        self.out_slots[live:bmax].fill_(self.runner.scratch_page * ps)
        self.page_table[live:bmax].fill_(self.runner.scratch_page)
        self.seq_lens[live:bmax].fill_(1)

    def can_run(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def run(self, reqs) -> torch.Tensor:
        n = len(reqs)
        b = next(s for s in self.sizes if s >= n)
        ids, pos, slots, table, lens = self.runner.decode_inputs(reqs)
        self.input_ids[:n].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(pos), non_blocking=True)
        self.out_slots[:n].copy_(torch.tensor(slots), non_blocking=True)
        self.page_table[:n].copy_(table, non_blocking=True)
        self.seq_lens[:n].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self._reset_padding(b, n)
        self.graphs[b].replay()
        return self.outputs[b][:n]
