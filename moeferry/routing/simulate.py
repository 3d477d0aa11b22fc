"""The expert cache simulator: a routing trace replayed through the slot cache's own admission
(a SlotCache on the CPU with impl="reference", the oracle the Triton kernel matches bit for
bit), so its hits and misses are those an offload engine with that cache and policy counts for
the same routes.

Replay (`simulate`): a SlotCache of the trace's layers and experts and `num_slots` slots, warm
as the engine builds it (SlotCache.fill: the first layers' experts, in layer order); then each
step in order, each MoE layer in order, `admit(layer, ids, phase)`. Every decode step is
admitted. A prefill step is admitted when the recording engine admitted it (its demand flag:
offload's demand prefill), or, given `prefill_demand_tokens=N`, when it has at most N tokens
(--moe-prefill-demand-tokens N; 0: every prefill streams; "auto" is not simulated). A streamed
prefill never touches the engine's cache, so it is skipped here too.

With a `HostSplit` (`--host-share`, `hybrid`): each decode layer's routes first go through the
hybrid strategy's own route split (kernels/route_split, its reference), the host taking that
share of the misses (no fixed cost: --moe-host-share's rule); only the device's routes are
admitted. The host's experts are counted, and timed by the channel model below.

Prediction (`moeferry routing simulate`; a model, not a measurement):

    decode time            = compute time + channel time
    channel time           = per decode layer call that copies: its missed bytes / H2D bandwidth
                             + the copy's fixed cost a call (--copy-call-us); hybrid: below
    predicted decode tok/s = decode tokens / decode time
    channels ms per step   = channel time / decode steps

Compute time: --step-ms x decode steps when given; else, for a trace recorded under the `gpu`
strategy (every expert resident, so no copies inside its times), the sum of its decode steps'
recorded wall-clock times (forward, sampling and the read of the tokens; not the scheduler's or
detokeniser's host time); else none, and no prediction is printed. Copies are taken as not
overlapping compute (an offload layer copies its misses after its router and before its GEMM,
inside the step), and the admission's own microseconds per layer are left out. A copy's fixed
cost is the wait around a layer's DMA copies (the worker's notice and first driver call before
the first copy, the done word after the last: DEFAULT_COPY_CALL_US, measured). A hybrid row's
channel time is, per decode layer, the longer of its two channels: its copies as above, and its
host experts' bytes over the host kernel's bandwidth (--host-gbps) plus the host's fixed cost
of a call (--host-call-us) where it took any; the model the split balances (moe/host_speeds.py).
H2D bandwidth: --h2d-gbps; else a pinned host-to-device copy measured here when torch sees a
CUDA GPU; else DEFAULT_H2D_GBPS, the pinned H2D copy_ of the H200 and H100 hosts over PCIe 5
(benchmarks/RESULTS.md, `copy`). The engine copies its misses by DMA at that speed by default
(--moe-miss-copy dma); the gather kernel may trail it, so for a gather the copy time is a
lower bound.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from moeferry.kernels.route_split import split_routes, split_values
from moeferry.moe.slot_cache import slots_for_gb
from moeferry.moe.slot_cache import DEFAULT_MAX_ROUTES, SlotCache
from moeferry.routing.trace import RoutingTrace, TraceHeader, TraceStep

logger = logging.getLogger(__name__)

DEFAULT_H2D_GBPS = 55.0  # GB/s (1e9 bytes/s): pinned H2D copy_ on the hosts of benchmarks/RESULTS.md
# us a decode layer call that copies any expert: the wait's latency around its DMA copies on an H100
# host (`bench_profile --share 0.75` at 4383775: 30 us before a wait's first copy, 4 after its last;
# the run now in RESULTS decode-profile/at-75 gave 13 and 4)
DEFAULT_COPY_CALL_US = 34.0
DEFAULT_HOST_GBPS = 116.6  # the host kernel's start-up figure on an H100 host (RESULTS, hybrid/decode/qwen3)
_GIB = 2**30


class SimulationError(ValueError):
    """A simulation the trace cannot answer (a cache under one layer's experts, ...)."""


@dataclass(frozen=True)
class HostSpeed:
    """The host kernel's bandwidth over expert bytes and its fixed cost a call, for a hybrid
    row's channel time."""

    gbps: float = DEFAULT_HOST_GBPS
    call_us: float = 0.0


@dataclass(frozen=True)
class HostSplit:
    """The hybrid strategy's split, replayed: the host's share of a layer's misses
    (--moe-host-share)."""

    share: float

    @property
    def label(self) -> str:
        return f"hybrid {self.share:g}"


@dataclass(frozen=True)
class SimResult:
    """One replay's counts. `decode` and `prefill` have the shape of the engine's statistics
    (MoEStats.snapshot()'s buckets: "total" and "per_layer" calls, distinct, misses,
    bytes_copied); `decode_tokens` counts live tokens (padding rows a graph added are admitted
    but produce nothing); `decode_ms` sums the decode steps' recorded times (None where any
    was not timed)."""

    num_slots: int
    policy: str
    expert_bytes: int
    decode: dict
    prefill: dict
    decode_steps: int
    decode_tokens: int
    decode_ms: float | None
    layer_calls: np.ndarray  # each decode layer call's (copied, host) experts, int64 [calls, 2]

    @property
    def host_experts(self) -> int:
        """Decode experts the host computed (0 without a HostSplit)."""
        return int(self.layer_calls[:, 1].sum())

    def hit_rate(self, phase: str) -> float | None:
        """1 - misses / distinct experts admitted (the engine's definition); None if none."""
        total = (self.decode if phase == "decode" else self.prefill)["total"]
        return 1.0 - total["misses"] / total["distinct"] if total["distinct"] else None

    @property
    def decode_bytes(self) -> int:
        return self.decode["total"]["bytes_copied"]

    def channel_seconds(self, h2d_bytes_per_s: float, host: HostSpeed | None = None,
                        copy_call_us: float = DEFAULT_COPY_CALL_US) -> float:
        """The decode's time in its expert channels: the sum over layer calls of their copies'
        time and fixed cost, or under a split of the longer channel (see the module)."""
        host = host or HostSpeed()
        copied, on_host = self.layer_calls[:, 0], self.layer_calls[:, 1]
        copy_s = copied * self.expert_bytes / h2d_bytes_per_s + (copied > 0) * copy_call_us * 1e-6
        host_s = on_host * self.expert_bytes / (host.gbps * 1e9) + (on_host > 0) * host.call_us * 1e-6
        return float(np.maximum(copy_s, host_s).sum())

    def predicted_tok_s(self, h2d_bytes_per_s: float, compute_seconds: float, host: HostSpeed | None = None,
                        copy_call_us: float = DEFAULT_COPY_CALL_US) -> float:
        return self.decode_tokens / (compute_seconds + self.channel_seconds(h2d_bytes_per_s, host, copy_call_us))


def admits(step: TraceStep, prefill_demand_tokens: int | None) -> bool:
    """Whether the replay admits `step` (see the module)."""
    if step.phase == "decode":
        return True
    if prefill_demand_tokens is None:
        return step.demand
    return 0 < step.num_tokens <= prefill_demand_tokens


def simulate(trace: RoutingTrace, num_slots: int, policy: str, *, lrfu_decay: float = 0.5,
             prefill_demand_tokens: int | None = None, host: HostSplit | None = None) -> SimResult:
    """Replay `trace` through a slot cache of `num_slots` slots under `policy`, with `host`'s
    split of the decode misses when given (see the module)."""
    h = trace.header
    if num_slots < h.num_experts:
        raise SimulationError(f"a cache of {num_slots} slots holds fewer than one layer's {h.num_experts} experts")
    widest = max((s.rows * h.top_k for s in trace.steps), default=0)
    cache = SlotCache(h.num_moe_layers, h.num_experts, num_slots, device="cpu", eviction_policy=policy,
                      lrfu_decay=lrfu_decay, max_routes=max(DEFAULT_MAX_ROUTES, widest), collect_stats=True,
                      expert_bytes=h.expert_bytes, impl="reference")
    cache.fill([[] for _ in range(h.num_moe_layers)], [])
    split = None if host is None else split_values(host.share)
    rotation, calls = torch.zeros(1, dtype=torch.int64), []
    for step in trace.steps:
        if admits(step, prefill_demand_tokens):
            ids = torch.from_numpy(step.ids.astype(np.int32))
            splitting = split is not None and step.phase == "decode"
            for layer in range(h.num_moe_layers):
                routes = ids[layer]
                if splitting:
                    _, routes, on_host, _ = split_routes(routes, cache.slot_of[layer], split, rotation,
                                                         impl="reference")
                cache.admit(layer, routes, step.phase)
                if step.phase == "decode":
                    calls.append((int(cache.plan_count), int(on_host) if splitting else 0))
    snap = cache.stats.snapshot()
    decode = [s for s in trace.steps if s.phase == "decode"]
    timed = all(s.timed for s in decode)
    return SimResult(num_slots, policy, h.expert_bytes, snap["decode"], snap["prefill"], len(decode),
                     sum(s.num_tokens for s in decode), sum(s.step_ms for s in decode) if timed else None,
                     np.array(calls, dtype=np.int64).reshape(-1, 2))


# ---- cache sizes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheSize:
    """A cache size as asked (`label`) and the slots it gives."""

    label: str
    slots: int


def cache_sizes(header: TraceHeader, gb=(), slots=(), fractions=()) -> list[CacheSize]:
    """The slots of each size asked: GiB as the engine's --moe-cache-gb converts them, slot
    counts, or fractions of every expert; SimulationError for one under a layer's experts."""
    total = header.num_moe_layers * header.num_experts
    sizes = ([CacheSize(f"--cache-gb {g:g}", slots_for_gb(g, header.expert_bytes)) for g in gb]
             + [CacheSize(f"--cache-slots {n}", n) for n in slots]
             + [CacheSize(f"--cache-fraction {f:g}", int(f * total)) for f in fractions])
    for size in sizes:
        if size.slots < header.num_experts:
            layer_gib = header.num_experts * header.expert_bytes / _GIB
            raise SimulationError(f"{size.label} holds {size.slots} experts, fewer than one layer's "
                                  f"{header.num_experts} (one layer needs {layer_gib:.3g} GiB)")
    return sizes


# ---- the prediction's two inputs --------------------------------------------------------------
def h2d_bandwidth(gbps: float | None) -> tuple[float, str]:
    """(bytes/s, where the figure came from): given, measured on this GPU, or the default."""
    if gbps is not None:
        return gbps * 1e9, "--h2d-gbps"
    if torch.cuda.is_available():
        return measure_h2d(), f"measured here ({torch.cuda.get_device_name()}, pinned host-to-device copy)"
    return DEFAULT_H2D_GBPS * 1e9, "default: pinned H2D copy_ measured on an H200, benchmarks/RESULTS.md; no GPU here"


def measure_h2d(nbytes: int = 256 << 20, iters: int = 5) -> float:
    """Pinned host-to-device copy bandwidth of the current GPU, bytes/s (one warm-up copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return nbytes * iters / (start.elapsed_time(end) / 1e3)


def compute_seconds(header: TraceHeader, result: SimResult, step_ms: float | None) -> tuple[float | None, str]:
    """(compute time of the trace's decode, where it came from), or (None, why there is none)."""
    if step_ms is not None:
        return result.decode_steps * step_ms / 1e3, f"--step-ms {step_ms:g} per decode step"
    if header.strategy == "gpu" and result.decode_ms is not None:
        return result.decode_ms / 1e3, (f"the trace's own decode step times (recorded under gpu on "
                                        f"{header.device or 'an unnamed device'})")
    return None, (f"none: the trace was recorded under {header.strategy or 'an unknown strategy'}, whose step "
                  f"times hold its own copies; give --step-ms (a gpu decode step's time) for a prediction")


# ---- the table --------------------------------------------------------------------------------
def report(trace: RoutingTrace, sizes: list[CacheSize], policies: list[str], *, h2d: tuple[float, str],
           step_ms: float | None = None, lrfu_decay: float = 0.5, prefill_demand_tokens: int | None = None,
           hosts: list[HostSplit | None] = (None,), host_speed: HostSpeed = HostSpeed(),
           copy_call_us: float = DEFAULT_COPY_CALL_US, results: list | None = None) -> str:
    """The table `moeferry routing simulate` prints: one row per (cache size, policy, host
    split: None for offload); each (CacheSize, policy, SimResult) of an offload row is also
    appended to `results` when given (for --plot). A hybrid row's channel time: the longer
    channel of each layer, the host at `host_speed`."""
    h, bandwidth = trace.header, h2d[0]
    rows, compute_note = [], None
    for size in sorted(sizes, key=lambda s: s.slots):
        for policy in policies:
            for host in hosts:
                start = time.perf_counter()
                result = simulate(trace, size.slots, policy, lrfu_decay=lrfu_decay,
                                  prefill_demand_tokens=prefill_demand_tokens, host=host)
                logger.info("simulated %s under %s in %.1fs", size.label, policy, time.perf_counter() - start)
                compute, compute_note = compute_seconds(h, result, step_ms)
                rows.append(_row(h, size, result, bandwidth, compute, host, host_speed, copy_call_us))
                if results is not None and host is None:
                    results.append((size, policy, result))
    header = ["cache", "slots", "GiB", "% experts", "policy", "split", "decode hit", "prefill hit",
              "experts/decode step copied / host", "MB copied/decode token", "channels ms/step",
              "predicted decode tok/s"]
    hybrid = any(host is not None for host in hosts)
    host_line = [f"host kernel: {host_speed.gbps:g} GB/s, {host_speed.call_us:g} us a call"] if hybrid else []
    return "\n".join([_summary(trace), f"H2D bandwidth: {bandwidth / 1e9:.1f} GB/s ({h2d[1]}), "
                      f"{copy_call_us:g} us a layer call that copies", *host_line,
                      f"compute time: {compute_note}", "", _markdown(header, rows)])


def _row(h: TraceHeader, size: CacheSize, result: SimResult, bandwidth: float, compute: float | None,
         host: HostSplit | None, host_speed: HostSpeed, copy_call_us: float) -> list[str]:
    total = h.num_moe_layers * h.num_experts
    steps, tokens = result.decode_steps, result.decode_tokens
    per_step = (f"{result.decode['total']['misses'] / steps:.1f} / {result.host_experts / steps:.1f}"
                if steps else "-")
    return [size.label, str(size.slots), f"{size.slots * h.expert_bytes / _GIB:.2f}", f"{100 * size.slots / total:.1f}",
            result.policy, "offload" if host is None else host.label, _rate(result.hit_rate("decode")),
            _rate(result.hit_rate("prefill")), per_step,
            f"{result.decode_bytes / tokens / 1e6:.2f}" if tokens else "-",
            f"{result.channel_seconds(bandwidth, host_speed, copy_call_us) * 1e3 / steps:.3f}" if steps else "-",
            f"{result.predicted_tok_s(bandwidth, compute, host_speed, copy_call_us):.1f}"
            if compute is not None and tokens else "-"]


def _rate(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def _summary(trace: RoutingTrace) -> str:
    h, steps = trace.header, trace.steps
    decode = [s for s in steps if s.phase == "decode"]
    prefill = [s for s in steps if s.phase == "prefill"]
    return (f"trace: {h.model or 'unnamed model'} ({h.dtype}), {h.num_moe_layers} MoE layers x {h.num_experts} "
            f"experts, top-{h.top_k}, {h.expert_bytes / 2**20:.2f} MiB per expert; recorded under {h.strategy} on "
            f"{h.device}{', decode in CUDA graphs' if h.cuda_graph else ''}\n"
            f"steps: {len(decode)} decode ({sum(s.num_tokens for s in decode)} tokens), {len(prefill)} prefill "
            f"({sum(s.num_tokens for s in prefill)} tokens, {sum(s.demand for s in prefill)} through the cache)"
            f"{'; the file ended inside a step, dropped' if trace.truncated else ''}")


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
