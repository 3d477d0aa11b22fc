"""Admission statistics of the slot cache: device counters, read only when asked.

Two buckets, decode and prefill (demand-loaded prefill chunks must not distort the decode
figures). Per layer: admission calls (a wide call counts once), distinct experts, misses;
bytes copied are misses times the bytes of one expert. Decode also keeps ``decode_freq[L,
E]``, one count per route. The kernels add to the counters on the device; ``snapshot()``
is the only place that syncs, and returns plain Python for the JSON/Prometheus endpoints.
"""
from __future__ import annotations

import torch

from moeferry.kernels.admission import AdmissionCounters

PHASES = ("decode", "prefill")


def _counters(num_layers: int, num_experts: int, device, with_freq: bool) -> AdmissionCounters:
    def zeros(*shape):
        return torch.zeros(shape, dtype=torch.int64, device=device)

    freq = zeros(num_layers, num_experts) if with_freq else None
    return AdmissionCounters(zeros(num_layers), zeros(num_layers), zeros(num_layers), freq)


class MoEStats:
    """Counters per phase and layer, int64 device tensors allocated once and only ever added
    to in place (graph-safe). Invariant: ``misses <= distinct`` and ``decode_freq[l].sum()``
    is the number of valid routes admitted into layer l during decode. ``expert_bytes`` (one
    expert's bytes over all its banks) is a host int set by whoever owns the banks."""

    def __init__(self, num_layers: int, num_experts: int, device, expert_bytes: int = 0):
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.expert_bytes = expert_bytes
        self.decode = _counters(num_layers, num_experts, device, with_freq=True)
        self.prefill = _counters(num_layers, num_experts, device, with_freq=False)

    @property
    def decode_freq(self) -> torch.Tensor:
        return self.decode.freq

    def bucket(self, phase: str) -> AdmissionCounters:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        return self.decode if phase == "decode" else self.prefill

    def reset(self) -> None:
        for bucket in (self.decode, self.prefill):
            for counter in bucket:
                if counter is not None:
                    counter.zero_()

    def snapshot(self) -> dict:
        """Plain-Python view (one device sync): totals and per-layer lists per phase."""
        return {"expert_bytes": self.expert_bytes,
                **{phase: self._bucket_snapshot(self.bucket(phase)) for phase in PHASES}}

    def _bucket_snapshot(self, bucket: AdmissionCounters) -> dict:
        calls, distinct, misses = (c.tolist() for c in bucket[:3])
        per_layer = {
            "calls": calls,
            "distinct": distinct,
            "misses": misses,
            "bytes_copied": [m * self.expert_bytes for m in misses],
        }
        snap = {
            "total": {key: sum(values) for key, values in per_layer.items()},
            "per_layer": per_layer,
        }
        total = snap["total"]
        total["hit_rate"] = 1.0 - total["misses"] / total["distinct"] if total["distinct"] else 0.0
        if bucket.freq is not None:
            snap["freq"] = bucket.freq.tolist()
        return snap
