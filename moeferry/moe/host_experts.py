"""The host channel: routed experts computed by the CPU from the pinned host banks, beside the
PCIe link (the `cpu` and `hybrid` strategies, moe/hybrid.py).

On a GPU, one layer's host work runs beside the GPU's own experts. By default (`dispatch =
"mailbox"`) a worker thread of the kernel's library polls a mailbox in pinned memory, and two
one-program kernels on the main stream post the layer's call and, before unstaging, wait
until the worker has published it done (kernels/host_mailbox). The graph holds kernels only,
on one stream; the GPU's own experts run between the post and the wait while the host
computes:

    main stream   ... router -> stage -> post -> admit, copy misses, fused_moe -> wait done -> unstage -> combine
    worker thread                        |<-------- host kernel -------->|

Staging is one small Triton kernel each way (kernels/host_staging) that writes the inputs into
the pinned buffers and reads the route outputs back over PCIe, on the main stream.

`dispatch = "host_function"` runs the kernel as a CUDA host function on a side stream forked
from the main one instead (graph capture records it as a host node), with no Python and no
GIL; the join waits for the slower branch:

    main stream   ... router -> stage x, ids, weights -> [fork] -- admit, copy misses, fused_moe -> [join] -> unstage -> combine
    side stream                                              host kernel (CUDA host function)

(`staging = "copy"`, with the host function only, stages with `copy_` on the side stream
instead, for benchmarks to compare.) Either way the step stays one CUDA graph. On a CPU-only
machine the kernel simply runs in place.

Which routes of a step go to the host is decided on the device, inside the graph
(kernels/route_split): the misses of the slot cache, a share of them set by the two channels'
measured speeds (`ChannelSpeeds`), the host's kept current during decode (`SplitTuner`).
"""
from __future__ import annotations

import ctypes
import logging
import time
import weakref
from dataclasses import dataclass, replace

import torch

from moeferry.errors import ConfigError
from moeferry.kernels.fused_moe import host as host_kernel
from moeferry.kernels.fused_moe import reference
from moeferry.kernels import host_mailbox
from moeferry.kernels.host_staging import staged_copy
from moeferry.kernels.route_split import split_values

logger = logging.getLogger(__name__)


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


class _CudaHostFunctions:
    """cuLaunchHostFunc from the driver library: enqueues a C function on a stream (captured
    into a graph as a host node while the stream captures)."""

    def __init__(self):
        self.driver = ctypes.CDLL("libcuda.so.1")
        self.driver.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.driver.cuLaunchHostFunc.restype = ctypes.c_int
        self.run_fn = ctypes.cast(host_kernel.library().moe_host_run, ctypes.c_void_p).value

    def launch(self, stream: torch.cuda.Stream, call: host_kernel.MoEHostCall) -> None:
        rc = self.driver.cuLaunchHostFunc(stream.cuda_stream, self.run_fn, ctypes.addressof(call))
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc failed with CUDA error {rc}")


class _Mailbox:
    """The pinned mailbox, the device counter and the call table of one mailbox worker
    (kernels/host_mailbox, host_experts.cpp). The memory is allocated with the channel (never
    while a graph captures); the worker thread starts with the first call entered. Invariant: a
    call's table entry is written before any request names it, and the calls it points to
    outlive the worker (the channel holds them)."""

    CAPACITY = 1 << 16

    def __init__(self, device: torch.device):
        self.box = torch.zeros(host_mailbox.MAILBOX_WORDS, dtype=torch.int64, pin_memory=True)
        self.counter = torch.zeros(2, dtype=torch.int64, device=device)
        self.table = (ctypes.c_void_p * self.CAPACITY)()
        self.index: dict[int, int] = {}  # id of a call record -> its table entry
        self._stop = None  # the worker's finalizer, once it runs

    def entry(self, call: host_kernel.MoEHostCall) -> int:
        """The table entry of `call`, filled on first use (the worker started with the first)."""
        if self._stop is None:
            library = host_kernel.library()
            handle = library.moe_host_worker_start(self.box.data_ptr(), self.table, self.CAPACITY)
            self._stop = weakref.finalize(self, library.moe_host_worker_stop, handle)
        key = id(call)
        if key not in self.index:
            if len(self.index) == self.CAPACITY:
                raise RuntimeError(f"host channel: more than {self.CAPACITY} distinct host kernel calls")
            self.table[len(self.index)] = ctypes.addressof(call)
            self.index[key] = len(self.index)
        return self.index[key]

    def stalled(self) -> bool:
        """Whether a wait gave up (the worker never finished a request): reads the device."""
        return bool(self.counter[host_mailbox.STALLED].item())


class HostExpertChannel:
    """Computes routes of a MoE layer on the host CPU.

    Invariants: the staging buffers (pinned on a GPU) and the per-(layer, tokens) call records
    are allocated once and never reallocated or freed while the strategy lives, because a
    captured graph's host nodes hold their addresses; one layer's host work is joined back
    into the main stream (`finish`) before the next layer's begins, so the buffers are never
    shared by two calls in flight. Routes not given to the host come back as zeros.
    `staging` (a class default an instance may override before its graphs are captured):
    "kernel" stages through kernels/host_staging on the main stream, "copy" through `copy_` on
    the side stream (module docstring). `dispatch` (likewise): "mailbox" runs the kernel through
    the mailbox worker (kernel staging only), "host_function" as a CUDA host function on the
    side stream. `schedule` (likewise): how the kernel deals its work units to its threads.
    `dtype` is the model's compute dtype: the kernel computes a bf16 model's experts, their banks
    bf16 or quantized (fp8, int4, mxfp4), with or without biases, silu or gpt-oss's clamped
    SwiGLU; on a GPU nothing else runs here.
    """

    staging = "kernel"
    dispatch = "mailbox"  # the faster of the two in RESULTS hybrid/decode (bench_hybrid --dispatch)
    schedule = host_kernel.DEFAULT_SCHEDULE  # kernels/fused_moe/host.py SCHEDULES; `set_schedule` changes it

    def __init__(self, banks: dict, max_tokens: int, top_k: int, device: torch.device, threads: int,
                 dtype: torch.dtype = torch.bfloat16):
        sample = next(iter(banks.values()))
        bias_dtype = None if sample.w13_bias is None else sample.w13_bias.dtype
        self.compiled = host_kernel.compiles(dtype, sample.w13.dtype, bias_dtype, sample.activation)
        if not self.compiled and device.type == "cuda":
            raise ConfigError(f"the host expert kernel computes bfloat16 experts, not {dtype}: "
                              "use --dtype bfloat16 with --moe-strategy cpu or hybrid")
        self.banks = banks
        self.max_tokens, self.top_k = max_tokens, top_k
        self.hidden, self.inter = sample.w2.shape[1], sample.w13.shape[1] // 2
        self.device, self.threads = device, threads
        on_gpu = device.type == "cuda"
        self.x = torch.empty(max_tokens, self.hidden, dtype=torch.bfloat16, pin_memory=on_gpu)
        self.ids = torch.empty(max_tokens, top_k, dtype=torch.int32, pin_memory=on_gpu)
        self.weights = torch.empty(max_tokens, top_k, dtype=torch.float32, pin_memory=on_gpu)
        self.out = torch.empty(max_tokens, top_k, self.hidden, dtype=torch.bfloat16, pin_memory=on_gpu)
        self.act = torch.empty(max_tokens * top_k, self.inter, dtype=torch.bfloat16)
        self.calls: dict[tuple[int, int], host_kernel.MoEHostCall] = {}
        self._inflight: tuple = ()  # the current call's inputs and result, held until `finish`
        if on_gpu:
            self.out_device = torch.empty_like(self.out, device=device)
            self.side = torch.cuda.Stream(device)
            self.functions = _CudaHostFunctions()
            self.mailbox = _Mailbox(device)

    def _call(self, layer_id: int, num_tokens: int) -> host_kernel.MoEHostCall:
        key = (layer_id, num_tokens)
        if key not in self.calls:
            bank = self.banks[layer_id]
            self.calls[key] = host_kernel.make_call(
                self.x[:num_tokens], self.ids[:num_tokens], self.weights[:num_tokens], self.out[:num_tokens],
                bank.w13, bank.w2, self.act, self.threads, schedule=self.schedule, **bank.kernel_args())
        return self.calls[key]

    def set_schedule(self, schedule: str) -> None:
        """Deal the kernel's work units by `schedule` from the next call on: the call records are
        changed in place, so graphs already captured (whose host work runs these records) follow."""
        if schedule not in host_kernel.SCHEDULES:
            raise ValueError(f"host channel: schedule {schedule!r} is not one of {', '.join(host_kernel.SCHEDULES)}")
        self.schedule = schedule
        for call in self.calls.values():
            call.schedule = host_kernel.SCHEDULES[schedule]

    def begin(self, layer_id: int, hidden: torch.Tensor, topk_weights: torch.Tensor, host_ids: torch.Tensor) -> None:
        """Start computing the routes whose `host_ids` entry is an expert id (>= 0; -1 elsewhere)
        for hidden [T, H]; on a GPU this returns at once, the work running on the side stream."""
        num_tokens = hidden.shape[0]
        if num_tokens > self.max_tokens:
            raise ValueError(f"host channel: {num_tokens} tokens in one call, buffers for {self.max_tokens}")
        if self.device.type != "cuda":
            self._inflight = (self._run_here(layer_id, hidden, topk_weights, host_ids),)
            return
        # The side stream reads the inputs after this returns: holding them until `finish` joins
        # it keeps the caching allocator from handing their memory to the main stream meanwhile.
        self._inflight = (self.out_device[:num_tokens], hidden, topk_weights, host_ids)
        call = self._call(layer_id, num_tokens)
        staged = self.staging == "kernel"
        if self.dispatch == "mailbox" and not staged:
            raise ValueError("the host channel's mailbox dispatch stages by kernel only")
        if staged:
            staged_copy([(hidden.contiguous(), self.x[:num_tokens]), (host_ids.contiguous(), self.ids[:num_tokens]),
                         (topk_weights.contiguous(), self.weights[:num_tokens])])
        if self.dispatch == "mailbox":
            host_mailbox.post_request(self.mailbox.box, self.mailbox.counter, self.mailbox.entry(call))
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            if not staged:
                self.x[:num_tokens].copy_(hidden, non_blocking=True)
                self.ids[:num_tokens].copy_(host_ids, non_blocking=True)
                self.weights[:num_tokens].copy_(topk_weights, non_blocking=True)
            self.functions.launch(self.side, call)
            if not staged:
                self.out_device[:num_tokens].copy_(self.out[:num_tokens], non_blocking=True)

    def _run_here(self, layer_id, hidden, topk_weights, host_ids) -> torch.Tensor:
        """A CPU-only machine: the kernel in place (a bf16 model's experts, in any format it reads),
        else the reference over the host's routes (a float32 model in tests), zeros at the
        others as the kernel leaves them."""
        num_tokens = hidden.shape[0]
        if self.compiled:
            self.x[:num_tokens].copy_(hidden)
            self.ids[:num_tokens].copy_(host_ids)
            self.weights[:num_tokens].copy_(topk_weights)
            host_kernel.run(self._call(layer_id, num_tokens))
            return self.out[:num_tokens]
        bank, on_host = self.banks[layer_id], host_ids >= 0
        routes = reference.fused_moe(hidden, bank.w13, bank.w2, torch.where(on_host, topk_weights, 0.0),
                                     host_ids.clamp(min=0), sum_routes=False, **bank.kernel_args())
        return torch.where(on_host.unsqueeze(-1), routes, 0.0)

    def stalled(self) -> bool:
        """Whether a mailbox wait ever gave up on the host kernel (never on a CPU-only machine)."""
        return self.device.type == "cuda" and self.mailbox.stalled()

    def finish(self) -> torch.Tensor:
        """The last `begin`'s host routes' weighted outputs [T, K, H] on the compute device (bf16
        from the kernel; zeros at the other routes), joined into the current stream. Read it
        before the next `begin`."""
        routes = self._inflight[0]
        if self.device.type == "cuda":
            if self.dispatch == "mailbox":
                host_mailbox.wait_done(self.mailbox.box, self.mailbox.counter)
            else:
                torch.cuda.current_stream(self.device).wait_stream(self.side)
            if self.staging == "kernel":
                staged_copy([(self.out[:routes.shape[0]], routes)])
        self._inflight = ()
        return routes


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
                                     schedule=channel.schedule, **bank.kernel_args())
        start = time.perf_counter()
        host_kernel.run(call)
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])  # the first run starts the threads
    return times[len(times) // 2]
