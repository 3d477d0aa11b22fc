"""Decode CUDA graphs: one captured graph per padded batch size, replayed each decode step.

Everything a graph reads lives in static buffers written before each replay (StagedInputs):
token ids, positions, output slots, page table, lengths. Rows past the live batch are
padding: they read and write the KV cache's scratch page only, and their logits are ignored.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from moeferry.engine.batch import fill_page_table
from moeferry.layers.batch import ForwardBatch
from moeferry.engine.sampler import SampleBuffers

logger = logging.getLogger(__name__)


def run_on_side_stream(fn: Callable[[], Any], times: int = 1) -> None:
    """``fn`` run ``times`` times on a new stream, ordered after and before the current one."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def capture(fn: Callable[[], Any], *, warmups: int = 1,
            pool=None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, what the captured call returned): ``fn`` run ``warmups`` times on a side
    stream (kernels compile and the caching allocator settles outside the capture), then
    captured once into a new graph (sharing memory ``pool`` when given)."""
    run_on_side_stream(fn, warmups)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        captured = fn()
    return graph, captured


def capture_sizes(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    return sizes


def _split_int32(buffer: torch.Tensor, rows: int, pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page table [rows, pages], lengths [rows], sampler slots [rows]): the views of an int32
    staging buffer."""
    table = rows * pages
    return buffer[:table].view(rows, pages), buffer[table:table + rows], buffer[table + rows:]


class StagedInputs:
    """The decode graphs' inputs for up to `rows` requests, as the graphs read them: int64
    `input_ids`, `positions`, `out_slots`, `draw_positions` [rows] and int32 `page_table`
    [rows, pages], `seq_lens`, `sample_slots` [rows] on the device. `write` puts a step's
    values into pinned host twins of the two buffers (one per dtype) and copies each over: two
    copies per step.

    Invariants: the device tensors never move (captured graphs hold their pointers); the host
    twins are rewritten only once the previous copies from them finished (event `copied`);
    rows past the live requests are padding: scratch slot, scratch page, length 1, sampler
    slot -1 (the sampler skips them).
    """

    def __init__(self, rows: int, pages: int, device: torch.device, scratch_page: int, page_size: int):
        pinned = device.type == "cuda"
        self.rows = rows
        self.scratch_page, self.scratch_slot = scratch_page, scratch_page * page_size
        self.host64 = torch.zeros((4, rows), dtype=torch.int64, pin_memory=pinned)
        self.host32 = torch.zeros(rows * (pages + 2), dtype=torch.int32, pin_memory=pinned)
        self.dev64 = torch.zeros_like(self.host64, device=device)
        self.dev32 = torch.zeros_like(self.host32, device=device)
        self.copied = torch.cuda.Event() if pinned else None
        self.input_ids, self.positions, self.out_slots, self.draw_positions = self.dev64
        self.page_table, self.seq_lens, self.sample_slots = _split_int32(self.dev32, rows, pages)
        self._ids, self._positions, self._slots, self._draws = self.host64.numpy()
        self._table, self._lens, self._sample_slots = (view.numpy() for view in _split_int32(self.host32, rows, pages))

    def write(self, ids, positions, slots, lens, pages, rows: int, sample_slots=None) -> None:
        """Rows [0, rows) for len(ids) live requests (their ids, positions, output slots,
        lengths, page lists and sampler slots; a request draws the token at its position + 1),
        the rest padding; then the two copies."""
        n = len(ids)
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copies have read the host twins
        self._ids[:n], self._positions[:n], self._slots[:n], self._lens[:n] = ids, positions, slots, lens
        self._draws[:n] = self._positions[:n] + 1
        self._sample_slots[:n] = -1 if sample_slots is None else sample_slots
        fill_page_table(self._table, pages, self.scratch_page)
        self._ids[n:rows], self._positions[n:rows], self._slots[n:rows] = 0, 0, self.scratch_slot
        self._draws[n:rows], self._sample_slots[n:rows] = 0, -1
        self._table[n:rows], self._lens[n:rows] = self.scratch_page, 1
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class DecodeGraphs:
    """Captured decode steps for batch sizes 1, 2, 4, ... up to max_running_requests: the
    forward, then the sampler over its logits (engine/sampler.py), in one graph per size.

    Invariant: the static buffers (staged inputs, each size's ForwardBatch, whose row index
    tensor the graph reads, and each size's sampler buffers) are allocated once, before
    capture, and live as long as the graphs; `run` copies a step's inputs into them and
    replays the smallest graph that fits, so no captured pointer changes. Rows without a
    sampler slot (padding, or a step that only wants logits) draw nothing.

    A step with a constrained row (structured output) replays the same forward and sampler as
    two graphs of its size instead (`split`, captured at the first such step of that size):
    the host computes the rows' token masks while the GPU runs the forward, then copies them
    and replays the sampler. Steps without one keep the single graph.
    """

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], sampler, decode_inputs: Callable,
                 inputs: StagedInputs, vocab_size: int):
        """`forward` runs the model over a decode batch (its logits), `sampler` draws from them
        (engine/sampler.py), `decode_inputs` gives a step's host-side inputs (ModelRunner's),
        `inputs` holds the largest batch's staged inputs."""
        self.forward, self.sampler, self.decode_inputs = forward, sampler, decode_inputs
        self.inputs = inputs
        self.sizes = capture_sizes(inputs.rows)
        self.inputs.write([], [], [], [], [], self.sizes[-1])
        device = inputs.dev64.device
        samples = SampleBuffers.allocate(self.sizes[-1], vocab_size, device,
                                         row_slot=self.inputs.sample_slots, positions=self.inputs.draw_positions)
        self.sample_views = {b: samples.view(b) for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.batches: dict[int, ForwardBatch] = {}  # kept alive: a graph reads their tensors at every replay
        self.logits: dict[int, torch.Tensor] = {}
        # size -> (forward graph, sampler graph, the forward's logits): steps with token masks
        self.split: dict[int, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self._capture_all()

    def _batch(self, b: int) -> ForwardBatch:
        x = self.inputs
        return ForwardBatch(True, x.input_ids[:b], x.positions[:b], x.out_slots[:b],
                            torch.arange(b, device=x.input_ids.device), page_table=x.page_table[:b],
                            seq_lens=x.seq_lens[:b])

    def _step(self, b: int) -> torch.Tensor:
        logits = self.forward(self.batches[b])
        self.sampler.run(logits, self.sample_views[b])
        return logits

    @torch.inference_mode()
    def _capture_all(self) -> None:
        for b in reversed(self.sizes):
            self.batches[b] = self._batch(b)
            graph, self.logits[b] = capture(functools.partial(self._step, b), warmups=2, pool=self.pool)
            self.pool = graph.pool()
            self.graphs[b] = graph
        self._settle()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _settle(self) -> None:
        # One more eager forward on a side stream, after the last capture: without it an
        # offload engine's start-up graphs replay slower until the fused MoE next runs eagerly
        # on a side stream, which speeds up graphs already captured too; an eager decode
        # forward on the default stream can bring the slow mode back. With every Triton
        # kernel's preferred shared-memory carveout set to 100% the slow mode never shows, so
        # it is the driver's choice of the SMs' L1/shared split around the MoE GEMM (110,592
        # bytes of shared memory). Triton has no launch option for the carveout. (Figures and
        # commits: benchmarks/RESULTS.md, Findings.)
        run_on_side_stream(functools.partial(self.forward, self.batches[self.sizes[0]]))

    @torch.inference_mode()
    def _capture_split(self, b: int) -> None:
        """Size b's forward and sampler as two graphs in the shared pool. The staged inputs are
        padding first, so the warm-ups write the scratch page only and draw nothing."""
        self.inputs.write([], [], [], [], [], self.sizes[-1])
        forward, logits = capture(functools.partial(self.forward, self.batches[b]), warmups=2, pool=self.pool)
        sampler, _ = capture(functools.partial(self.sampler.run, logits, self.sample_views[b]),
                             pool=self.pool)
        self.split[b] = (forward, sampler, logits)
        self._settle()
        logger.info("captured the split decode graphs (forward, sampler) of batch size %d for token masks", b)

    def can_run(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def run(self, reqs, sample_slots=None, ahead: int = 0,
            input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, SampleBuffers]:
        """Replay one decode step of `reqs`: (their logits [n, V], the sampler buffers of the
        graph's rows). Rows draw a token only with `sample_slots` (one per request). With
        `ahead` and `input_ids` [n] on the device, a step launched before the host read the
        tokens it decodes (ModelRunner.decode_inputs): those ids are copied in on the device."""
        n = len(reqs)
        b = next(s for s in self.sizes if s >= n)
        if sample_slots is not None and any(r.grammar is not None for r in reqs):
            assert input_ids is None, "a step with token masks needs its tokens on the host"
            return self._run_masked(reqs, sample_slots, b)
        self.inputs.write(*self.decode_inputs(reqs, ahead), b, sample_slots)
        if input_ids is not None:
            self.inputs.input_ids[:n].copy_(input_ids, non_blocking=True)
        if sample_slots is not None:
            self.sampler.stage_masks(self.sample_views[b], reqs)  # clears the flags a masked step left
        self.graphs[b].replay()
        return self.logits[b][:n], self.sample_views[b]

    def _run_masked(self, reqs, sample_slots, b: int) -> tuple[torch.Tensor, SampleBuffers]:
        """A step with token masks: the forward's graph, the masks on the host while it runs
        (they need the previous step's tokens, which the host has, and nothing of this one's
        forward), their copy, then the sampler's graph."""
        if b not in self.split:
            self._capture_split(b)
        forward, sampler, logits = self.split[b]
        self.inputs.write(*self.decode_inputs(reqs), b, sample_slots)
        forward.replay()
        self.sampler.stage_masks(self.sample_views[b], reqs)
        sampler.replay()
        return logits[:len(reqs)], self.sample_views[b]
