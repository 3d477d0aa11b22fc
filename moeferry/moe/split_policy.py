"""Route splits: which routes of a layer go to the host channel and which to the device.

`AllToHost` (`cpu`) gives the host every route. `ByChannelSpeed` (`hybrid`) gives the host a share
of the slot cache's misses, set by the two channels' speeds (moe/host_speeds.py) and kept matched
to the host kernel's speed as decode finds it (`SplitTuner`); the split runs on the device,
inside the decode graph (kernels/route_split).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moeferry.kernels.fused_moe import host as host_kernel
from moeferry.kernels.route_split import split_routes, split_values
from moeferry.moe.host_speeds import ChannelSpeeds


@dataclass(frozen=True)
class TunerSettings:
    """How `SplitTuner` measures: every `period` decode steps, from at least `min_experts`
    host experts, moving the estimate by `weight` of the gap, never below `floor` of the
    start-up figure."""

    period: int = 8
    min_experts: int = 8
    weight: float = 0.5
    floor: float = 0.25


_COUNTERS = ("working_calls", "working_seconds", "experts")


class SplitTuner:
    """The host's share of a layer's misses, kept matched to the host kernel's speed as decode
    finds it. The start-up figure is one moment of a host that other work (the copies over
    the same DRAM, other processes) slows by a varying amount; a share set from a figure the
    host no longer reaches leaves every layer waiting for it. So every `period` decode steps
    the host kernel's own counters (kernels/fused_moe/host.py timing: the calls that computed
    experts, their seconds and their distinct experts) give the bytes per second it achieved,
    less its fixed cost per call, and the estimate moves by `weight` of the gap; the share and
    offset follow (`ChannelSpeeds`).

    Invariants: `split` (kernels/route_split's float32 [2] of share and offset, on the compute
    device) is allocated once and written only in place, in stream order, so captured graphs
    follow it; the estimate never falls below `floor` of the start-up figure, so the host
    keeps experts to measure and the estimate can recover; a share the user fixed
    (--moe-host-share) never moves; a prefill's host calls are never counted (`interrupt`
    banks the period's decode counts so far and the count resumes at the next decode step);
    a period with fewer than `min_experts` host experts moves nothing. The counters are the
    process's: one host channel in a process is what the figures assume."""

    def __init__(self, speeds: ChannelSpeeds, device: torch.device, settings: TunerSettings = TunerSettings()):
        self.start = self.speeds = speeds
        self.settings = settings
        self.fixed = speeds.share is not None or speeds.host_bytes_per_s <= 0  # user's share, or no host kernel
        self.split = split_values(speeds.host_share, speeds.host_offset, device)
        on_gpu = device.type == "cuda"
        self._staged = torch.empty(2, dtype=torch.float32, pin_memory=on_gpu)  # the next split, pinned
        self._copied = torch.cuda.Event() if on_gpu else None  # the staged row's last copy
        self.updates = 0
        self._mark: dict | None = None  # the counters at the start of the current decode stretch
        self._banked = dict.fromkeys(_COUNTERS, 0)  # the period's counts from stretches a prefill ended
        self._steps = 0

    def _since_mark(self, now: dict) -> dict:
        return {k: now[k] - self._mark[k] for k in _COUNTERS}

    def interrupt(self) -> None:
        """Host calls that are not decode's are about to run (a prefill): bank this stretch's
        decode counts; counting resumes at the next decode step."""
        if self._mark is not None:
            for k, v in self._since_mark(host_kernel.timing()).items():
                self._banked[k] += v
            self._mark = None

    def decode_step(self) -> None:
        """Called on the host before each decode step (outside any graph)."""
        if self.fixed:
            return
        if self._mark is None:
            self._mark = host_kernel.timing()
            return
        self._steps += 1
        if self._steps < self.settings.period:
            return
        now = host_kernel.timing()  # one read ends this period and starts the next
        counts = {k: v + self._banked[k] for k, v in self._since_mark(now).items()}
        self._mark, self._steps, self._banked = now, 0, dict.fromkeys(_COUNTERS, 0)
        busy = counts["working_seconds"] - counts["working_calls"] * self.speeds.host_call_s
        if counts["experts"] < self.settings.min_experts or busy <= 0:
            return
        self.observe(counts["experts"] * self.speeds.expert_bytes / busy)

    def observe(self, host_bytes_per_s: float) -> None:
        """Move the host's estimate by `weight` of the gap to `host_bytes_per_s` (at least
        `floor` of the start-up figure) and write the split that balances it."""
        weight = self.settings.weight
        estimate = (1 - weight) * self.speeds.host_bytes_per_s + weight * host_bytes_per_s
        estimate = max(estimate, self.settings.floor * self.start.host_bytes_per_s)
        self.speeds = replace(self.speeds, host_bytes_per_s=estimate)
        self.write()
        self.updates += 1

    def hold(self, share: float) -> None:
        """From now on the host takes `share` of the misses with no offset, as --moe-host-share
        would have it: written now, never moved again."""
        self.fixed = True
        self.speeds = replace(self.speeds, share=share)
        self.write()

    def write(self) -> None:
        """Write `speeds`' share and offset into `split`: from pinned memory, in stream order,
        without waiting for the stream; the staged row is rewritten only once its last copy is
        done (long since, in a decode loop)."""
        if self._copied is not None:
            self._copied.synchronize()
        self._staged.copy_(split_values(self.speeds.host_share, self.speeds.host_offset))
        self.split.copy_(self._staged, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def as_dict(self) -> dict:
        """The current estimate's host figures (as `ChannelSpeeds.as_dict` words them) and the updates."""
        current = self.speeds.as_dict()
        return {**{k: current[k] for k in ("host_gb_per_s", "host_share", "host_offset_experts")},
                "updates": self.updates}


class AllToHost:
    """`cpu`: every route of a layer goes to the host; nothing is computed on the device."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def start(self, speeds: ChannelSpeeds, device: torch.device) -> None:
        pass

    def routes(self, moe_layer: int, topk_ids: torch.Tensor, residency: torch.Tensor | None,
               tally: torch.Tensor | None, weights: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        """(host ids, device ids, the device's weights): here every id to the host, None for the
        device; `tally` [1] (decode) counts the layer's distinct routed experts."""
        if tally is not None:
            distinct = torch.zeros(self.num_experts, dtype=torch.int32, device=topk_ids.device)
            distinct.index_fill_(0, topk_ids.reshape(-1).long(), 1)
            tally += distinct.sum()
        return topk_ids, None, None

    def device_part(self, predicted_ids: torch.Tensor, residency: torch.Tensor) -> torch.Tensor:
        """Of a lookahead's predicted experts, none for the device: every route is the host's."""
        return torch.full_like(predicted_ids, -1)

    def decode_step(self) -> None:
        pass

    def interrupt(self) -> None:
        pass

    def stats(self) -> dict:
        return {}


class ByChannelSpeed:
    """`hybrid`: of a layer's routes, the slot cache's hits stay on the device and a share of the
    misses goes to the host (kernels/route_split, rotating which misses), the rest is copied
    and admitted. The share follows the host's measured speed (`SplitTuner`).
    Invariant: a route is given to exactly one of the two; the routes the host computes are
    never admitted, so they cost the cache nothing."""

    def __init__(self, settings: TunerSettings = TunerSettings()):
        self.settings = settings

    def start(self, speeds: ChannelSpeeds, device: torch.device) -> None:
        """With the channels' speeds measured at start-up: the tuner and the rotation counter."""
        self.tuner = SplitTuner(speeds, device, self.settings)
        self.rotation = torch.zeros(1, dtype=torch.int64, device=device)
        self.ahead_rotation = torch.zeros(1, dtype=torch.int64, device=device)

    def routes(self, moe_layer: int, topk_ids: torch.Tensor, residency: torch.Tensor,
               tally: torch.Tensor | None, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(host ids, device ids, the device's weights): each route's expert in one of the two, -1
        in the other, and `weights` with zeros at the host's routes; `residency` is the layer's row
        of the slot cache's slot_of; `tally` [1] (decode) counts the experts the host takes."""
        host_ids, device_ids, _, device_weights = split_routes(topk_ids, residency, self.tuner.split, self.rotation,
                                                               tally, weights)
        return host_ids, device_ids, device_weights

    def device_part(self, predicted_ids: torch.Tensor, residency: torch.Tensor) -> torch.Tensor:
        """Of a lookahead's predicted experts (moe/prefetch.py), those the device channel fetches
        ahead: the hits and the device's share of the misses, by the same split (-1 for the
        host's share, which stays a miss and is split again when the layer routes). Copies
        ahead run beside compute, so this share of the predicted misses is hidden; a split of
        nothing but the prefetch would leave the host idle and the copies on the critical path."""
        return split_routes(predicted_ids, residency, self.tuner.split, self.ahead_rotation)[1]

    def decode_step(self) -> None:
        self.tuner.decode_step()

    def interrupt(self) -> None:
        self.tuner.interrupt()

    def stats(self) -> dict:
        return {"split_now": self.tuner.as_dict()}
