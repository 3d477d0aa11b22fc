"""Streamed prefill: every expert of a layer that the device does not hold crosses the link into
one of two layer buffers on a copy stream, layer l+1's copy behind layer l's compute."""

from __future__ import annotations

import numpy as np
import torch

from moeferry.moe.banks import ExpertBanks


def missing_runs(missing: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of a [L, E] bool tensor on the host, (start, stop) of every run of consecutive
    True values (one vectorized pass: this runs before a chunk's first copy, the GPU idle)."""
    padded = np.zeros((missing.shape[0], missing.shape[1] + 2), dtype=np.int8)
    padded[:, 1:-1] = missing.numpy()
    edges = np.diff(padded, axis=1)
    runs: list[list[tuple[int, int]]] = [[] for _ in range(missing.shape[0])]
    for (row, start), (_, stop) in zip(np.argwhere(edges == 1).tolist(), np.argwhere(edges == -1).tolist()):
        runs[row].append((start, stop))
    return runs


class LayerStream:
    """Streamed prefill over the slot pool: a chunk's experts resident in slots are computed
    from their slots; every other expert of MoE layer l crosses the link into buffer l % 2,
    rows `base + (l % 2) * E + e` of the same banks (past the pool's `base` slots), on a copy
    stream, layer l+1's copy running behind layer l's compute. One fused_moe per layer then
    reads slots and buffer rows alike, at the routes' expert ids mapped to rows on the device
    (`acquire`'s map). Copies go by runs of consecutive missing expert ids, one copy per run
    and bank (scale banks included), on the copy engines.

    `begin` reads the residency (`slot_of`) to the host once per chunk (or takes the copy the
    auto decision read), one device sync. It
    holds for the whole forward: only admission writes the maps, a streamed forward admits
    nothing, and the buffers lie past the slots, so streaming never evicts decode's experts.
    A store without a slot cache (`cpu`'s) passes no residency: every expert streams.

    Invariants: a buffer is overwritten only after the compute that read it has finished
    (event `consumed`); compute on a buffer starts only after its copy finished (event
    `ready`); a layer with every expert resident copies nothing and waits for nothing. On the
    CPU the copies are plain and in order, through the same map.
    """

    def __init__(self, banks: ExpertBanks, base: int, num_experts: int, num_layers: int):
        if banks.num_experts < base + 2 * num_experts:
            raise ValueError(f"stream banks of {banks.num_experts} rows: need {base} slots + 2 x {num_experts}")
        self.banks, self.base, self.num_experts = banks, base, num_experts
        device = banks.w13.device
        buffer = base + (torch.arange(num_layers) % 2)[:, None] * num_experts + torch.arange(num_experts)
        self.buffer_rows = buffer.to(device=device, dtype=torch.int32)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.copy_stream is not None:  # copies come after the banks' allocation (a zero fill)
            self.copy_stream.wait_stream(torch.cuda.current_stream(device))
        self.ready = [torch.cuda.Event() for _ in range(2)] if self.copy_stream else []
        self.consumed = [torch.cuda.Event() for _ in range(2)] if self.copy_stream else []
        self.order: list[int] = []
        self.position: dict[int, int] = {}

    def begin(self, host_banks: dict[int, ExpertBanks], slot_of: torch.Tensor | None,
              slot_of_host: torch.Tensor | None = None) -> None:
        """Start a chunk over every MoE layer of `host_banks` (in layer order): read which
        experts `slot_of` [L, E] holds (None: none; `slot_of_host`: its host copy when the
        caller has read it already), map each (layer, expert) to its row, and issue the first
        layer's copies."""
        self.order, self.position = sorted(host_banks), {l: i for i, l in enumerate(sorted(host_banks))}
        self.host = host_banks
        if slot_of is None:
            self.row_of = self.buffer_rows
            missing = torch.ones(self.buffer_rows.shape, dtype=torch.bool)
        else:
            self.row_of = torch.where(slot_of >= 0, slot_of, self.buffer_rows)
            missing = (slot_of.cpu() if slot_of_host is None else slot_of_host) < 0  # the chunk's one read
        self.runs = missing_runs(missing)
        self.copied = missing.sum(dim=1).tolist()
        self._issue_copy(0)

    def _issue_copy(self, index: int) -> None:
        runs = self.runs[index]
        if not runs:
            return
        buf = index % 2
        first = self.base + buf * self.num_experts
        pairs = list(zip(self.banks.tensors(), self.host[self.order[index]].tensors()))
        if self.copy_stream is None:
            for dst, src in pairs:
                for start, stop in runs:
                    dst[first + start:first + stop].copy_(src[start:stop])
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.consumed[buf])
            for dst, src in pairs:
                for start, stop in runs:
                    dst[first + start:first + stop].copy_(src[start:stop], non_blocking=True)
            self.ready[buf].record(self.copy_stream)

    def acquire(self, layer_id: int) -> tuple[torch.Tensor, int]:
        """The layer's map [E] int32 (expert -> row of `banks`) once its copies have landed, the
        next layer's copies issued first; and how many experts it copied."""
        index = self.position[layer_id]
        if index + 1 < len(self.order):
            self._issue_copy(index + 1)
        if self.copy_stream is not None and self.runs[index]:
            torch.cuda.current_stream().wait_event(self.ready[index % 2])
        return self.row_of[index], self.copied[index]

    def release(self, layer_id: int) -> None:
        """The layer's compute is enqueued: its buffer may be overwritten behind it."""
        index = self.position[layer_id]
        if self.copy_stream is not None and self.runs[index]:
            self.consumed[index % 2].record(torch.cuda.current_stream())
