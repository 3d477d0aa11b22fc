"""Calibration of the host channel: both channels' speeds, measured once at start-up with the
model's own banks (`measure_speeds`), as the route split reads them (`ChannelSpeeds`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moeferry.kernels.fused_moe import host as host_kernel

if TYPE_CHECKING:
    from moeferry.moe.host_channel import HostExpertChannel


@dataclass(frozen=True)
class ChannelSpeeds:
    """Measured once at start-up: bytes of expert weights per second over PCIe (pinned host to
    device copy) and through the host kernel (one token per expert, the decode case), and the
    host kernel's fixed cost per call (`host_call_s`: waking its threads, its barriers),
    which a layer pays whenever the host takes any of its experts."""

    pcie_bytes_per_s: float
    host_bytes_per_s: float
    host_call_s: float = 0.0
    expert_bytes: int = 0
    share: float | None = None  # --moe-host-share: the share, with no fixed cost

    @property
    def host_share(self) -> float:
        """The share of a layer's missed experts the host takes so that both channels finish
        together, before the fixed cost: host / (host + PCIe) bytes per second."""
        if self.share is not None:
            return self.share
        total = self.pcie_bytes_per_s + self.host_bytes_per_s
        return self.host_bytes_per_s / total if total > 0 else 0.0

    @property
    def host_offset(self) -> float:
        """Experts the fixed cost is worth: with n misses the host takes round(n * share -
        offset) of them (at least 0), the count that balances n_host * t_host + call cost
        against (n - n_host) * t_copy."""
        if self.share is not None or not (self.pcie_bytes_per_s > 0 and self.host_bytes_per_s > 0):
            return 0.0
        per_expert = self.expert_bytes / self.pcie_bytes_per_s + self.expert_bytes / self.host_bytes_per_s
        return self.host_call_s / per_expert if per_expert > 0 else 0.0

    def as_dict(self) -> dict:
        return {"pcie_gb_per_s": round(self.pcie_bytes_per_s / 1e9, 2),
                "host_gb_per_s": round(self.host_bytes_per_s / 1e9, 2),
                "host_call_us": round(self.host_call_s * 1e6, 1), "host_share": round(self.host_share, 3),
                "host_offset_experts": round(self.host_offset, 2)}


def measure_speeds(banks: dict, channel: HostExpertChannel, top_k: int, device: torch.device,
                   repeats: int = 7) -> ChannelSpeeds:
    """Both channels, timed on this machine with the model's own banks: the copy channel by
    copying `top_k` experts of one layer to the compute device (PCIe on a GPU, a memory copy
    on a CPU-only machine); the host kernel by one token routed to 1 and to `top_k` distinct
    experts (median times; the slope is its bytes per second, the rest its cost per call).
    A bank the kernel does not compute (a float32 model) measures 0 for the host."""
    layers = sorted(banks)
    bank = banks[layers[0]]
    count = min(top_k, bank.num_experts)
    pcie = _copy_speed(bank, count, device, repeats)
    if not channel.compiled:
        return ChannelSpeeds(pcie, 0.0, 0.0, bank.bytes_per_expert)
    one = host_call_time(banks, channel, 1, repeats)
    many = host_call_time(banks, channel, count, repeats)
    per_expert = (many - one) / (count - 1) if count > 1 and many > one else many / count
    return ChannelSpeeds(pcie, bank.bytes_per_expert / per_expert, max(0.0, many - count * per_expert),
                         bank.bytes_per_expert)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_speed(bank, count: int, device: torch.device, repeats: int) -> float:
    w13 = torch.empty((count, *bank.w13.shape[1:]), dtype=bank.w13.dtype, device=device)
    w2 = torch.empty((count, *bank.w2.shape[1:]), dtype=bank.w2.dtype, device=device)
    w13.copy_(bank.w13[:count], non_blocking=True)
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        w13.copy_(bank.w13[:count], non_blocking=True)
        w2.copy_(bank.w2[:count], non_blocking=True)
    _synchronize(device)
    return repeats * count * bank.bytes_per_expert / (time.perf_counter() - start)


def host_call_time(banks: dict, channel: HostExpertChannel, experts: int, repeats: int) -> float:
    """Median seconds of one host kernel call: one token routed to `experts` distinct experts,
    each run on experts (and layers) the runs before did not read, while they last."""
    layers = sorted(banks)
    sample = banks[layers[0]]
    hidden = torch.randn(1, sample.w2.shape[1]).to(torch.bfloat16)
    weights = torch.full((1, experts), 1.0 / experts)
    out = torch.empty(1, experts, hidden.shape[1], dtype=torch.bfloat16)
    times = []
    for run in range(repeats + 1):
        layer = layers[run % len(layers)]
        ids = ((torch.arange(experts) + run * experts) % sample.num_experts).to(torch.int32).reshape(1, experts)
        bank = banks[layer]
        call = host_kernel.make_call(hidden, ids, weights, out, bank.w13, bank.w2, channel.act, channel.threads,
                                     schedule=channel.options.schedule,
                                     activations=channel.options.activations, **bank.kernel_args())
        start = time.perf_counter()
        host_kernel.run(call)
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])  # the first run starts the threads
    return times[len(times) // 2]
