"""The host CPU as a MoE strategy's second compute (`cpu`, `hybrid`): the transport that runs the
host kernel beside the device (moe/host_channel.py), its speeds measured at start-up
(moe/host_speeds.py), and a per-layer count of the experts it computed in decode (a device
counter, graph-safe). Which routes it gets is the route split's (moe/split_policy.py)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from moeferry.kernels.fused_moe import host as host_kernel
from moeferry.moe.host_channel import HostChannelOptions, HostExpertChannel
from moeferry.moe.host_speeds import ChannelSpeeds, measure_speeds

logger = logging.getLogger(__name__)


def channel_options(engine_config) -> HostChannelOptions:
    """The host channel's options from the engine's (--moe-host-dispatch, -staging, -schedule,
    -activations)."""
    ec = engine_config
    return HostChannelOptions(ec.moe_host_dispatch, ec.moe_host_staging, ec.moe_host_schedule,
                              ec.moe_host_activations)


class HostCompute:
    """Invariants: built once the banks are filled (`finalize`); `experts` [MoE layers] is
    allocated once on the compute device and only added to in place."""

    channel: HostExpertChannel
    speeds: ChannelSpeeds

    def __init__(self, engine_config, model_config, widest_chunk: int):
        self.engine_config, self.model_config = engine_config, model_config
        self.widest_chunk = widest_chunk

    def finalize(self, banks: dict, device: torch.device, dtype: torch.dtype) -> None:
        ec, mc = self.engine_config, self.model_config
        # the host's cores shared among the ranks of --tensor-parallel-size, each computing its share
        threads = ec.moe_host_threads or max(1, host_kernel.default_threads() // ec.tensor_parallel_size)
        self.channel = HostExpertChannel(banks, max(ec.max_running_requests, self.widest_chunk, 1), mc.top_k,
                                         device, threads, dtype, channel_options(ec))
        self.speeds = measure_speeds(banks, self.channel, mc.top_k, device)
        if ec.moe_host_share is not None:
            self.speeds = dataclasses.replace(self.speeds, share=ec.moe_host_share)
        self.experts = torch.zeros(len(banks), dtype=torch.int64, device=device)
        logger.info("host channel: %d threads; expert bytes/s: PCIe %.1f GB/s, host kernel %.1f GB/s + %.0f us a "
                    "call; the host takes round(%.2f x misses - %.2f) of a layer's missed experts", threads,
                    self.speeds.pcie_bytes_per_s / 1e9, self.speeds.host_bytes_per_s / 1e9,
                    self.speeds.host_call_s * 1e6, self.speeds.host_share, self.speeds.host_offset)

    def tally(self, moe_layer: int, phase: str) -> torch.Tensor | None:
        """The layer's counter of decode host experts (None outside decode)."""
        return self.experts[moe_layer:moe_layer + 1] if phase == "decode" else None

    def begin(self, layer_id: int, hidden: torch.Tensor, topk_weights: torch.Tensor, host_ids: torch.Tensor) -> None:
        self.channel.begin(layer_id, hidden, topk_weights, host_ids)

    def finish(self, into: torch.Tensor | None = None) -> torch.Tensor:
        return self.channel.finish(into)

    def restart(self) -> None:
        self.experts.zero_()

    def stats(self, expert_bytes: int) -> dict:
        host = self.experts.tolist()
        return {"speeds": self.speeds.as_dict(), "threads": self.channel.threads,
                "host_kernel": host_kernel.timing() if self.channel.compiled else None,
                "host_experts": sum(host), "host_experts_per_layer": host,
                "host_bytes": sum(host) * expert_bytes, "host_stalled": self.channel.stalled()}
