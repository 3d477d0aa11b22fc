"""Where a decode step's time goes, layer by layer: under --moe-timeline a strategy keeps a
`LayerTimeline` and stamps named points of each MoE layer's work (kernels/timestamps) inside
the captured decode graph; `summary` reads them back as the mean microseconds from each point
to the next (bench_hybrid --parts timeline)."""
from __future__ import annotations

import torch

from moeferry.kernels.timestamps import stamp

# The points `hybrid` stamps in a decode layer (moe/strategy.py, under --moe-timeline), in order.
HYBRID_POINTS = ("start", "split", "posted", "copied", "computed", "joined", "combined")


class LayerTimeline:
    """Stamps of `points` (in order) for each of `num_layers` MoE layers, one row per decode step.

    Invariants: `times` [rows, num_layers * len(points)] and `counter` [1] are allocated once on
    the compute device and written in place (a captured graph holds their addresses); row
    r % rows holds step r; the last point of the last layer advances the row, so a step's
    stamps never straddle two rows."""

    def __init__(self, points: tuple[str, ...], num_layers: int, device: torch.device, rows: int = 64):
        self.points, self.num_layers, self.rows = tuple(points), num_layers, rows
        self.index = {p: i for i, p in enumerate(self.points)}
        self.times = torch.zeros(rows, num_layers * len(self.points), dtype=torch.int64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)

    def mark(self, moe_layer: int, point: str) -> None:
        """Stamp `point` of MoE layer `moe_layer` (enqueued on the current stream)."""
        column = moe_layer * len(self.points) + self.index[point]
        last = moe_layer == self.num_layers - 1 and point == self.points[-1]
        stamp(self.times, self.counter, column, advance=last)

    def reset(self) -> None:
        self.times.zero_()
        self.counter.zero_()

    def summary(self) -> dict:
        """Means over the recorded steps (at most `rows`, the latest), in microseconds: each
        point to the next within a layer (`"a -> b"`, over every layer), from a layer's last
        point to the next layer's first (`"between layers"`: attention, router and the rest),
        and from the first layer's first point to the last layer's last (`"layers"`); `steps`
        the number of steps averaged. Reads the device (a sync)."""
        steps = min(int(self.counter.item()), self.rows)
        if steps == 0:
            return {"steps": 0}
        valid = self.times[:steps].view(steps, self.num_layers, len(self.points)).double().cpu() / 1e3
        out = {f"{a} -> {b}": (valid[:, :, i + 1] - valid[:, :, i]).mean().item()
               for i, (a, b) in enumerate(zip(self.points, self.points[1:]))}
        if self.num_layers > 1:
            out["between layers"] = (valid[:, 1:, 0] - valid[:, :-1, -1]).mean().item()
        out["layers"] = (valid[:, -1, -1] - valid[:, 0, 0]).mean().item()
        out["steps"] = steps
        return out
