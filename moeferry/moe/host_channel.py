"""The host channel: routed experts computed by the CPU from the pinned host banks, beside the
PCIe link: the transport of the `cpu` and `hybrid` strategies' host compute (their speeds:
moe/host_speeds.py; which routes it takes: moe/split_policy.py).

On a GPU, one layer's host work runs beside the GPU's own experts. By default (dispatch
"mailbox") a worker thread of the kernel's library polls a mailbox in pinned memory, and two
one-program kernels on the main stream post the layer's call and, before unstaging, wait
until the worker has published it done (kernels/host_mailbox). The graph holds kernels only,
on one stream; the GPU's own experts run between the post and the wait while the host
computes:

    main stream   ... router -> stage, post -> admit, copy misses, fused_moe -> wait done -> unstage -> combine
    worker thread                         |<-------- host kernel -------->|

Staging writes the inputs into the pinned buffers and reads the host's route outputs back over
PCIe, on the main stream: for a few tokens the post kernel stages the inputs itself before it
posts (kernels/host_mailbox), else a small Triton kernel does (kernels/host_staging), which also
brings the outputs back. A layer that gives the host no route (most of them once the slot cache
holds a model's hot experts) posts no request: the post kernel reads the routes on the device,
stages nothing, and neither the worker nor the wait does anything.

Dispatch "host_function" runs the kernel as a CUDA host function on a side stream forked
from the main one instead (graph capture records it as a host node), with no Python and no
GIL; the join waits for the slower branch:

    main stream   ... router -> stage x, ids, weights -> [fork] -- admit, copy misses, fused_moe -> [join] -> unstage -> combine
    side stream                                              host kernel (CUDA host function)

(Staging "copy", with the host function only, stages with `copy_` on the side stream
instead, for benchmarks to compare.) Either way the step stays one CUDA graph. On a CPU-only
machine the kernel simply runs in place.
The options (`HostChannelOptions`) come from the engine's developer options
(--moe-host-dispatch, --moe-host-staging, --moe-host-schedule).
"""
from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import torch

from moeferry.errors import ConfigError
from moeferry.kernels.fused_moe import host as host_kernel
from moeferry.kernels.fused_moe import fused_moe
from moeferry.kernels import host_mailbox
from moeferry.kernels.host_staging import staged_copy, staged_routes


DISPATCHES = ("mailbox", "host_function")
# The most hidden-state elements a mailbox post stages itself (one program: four tokens of
# Qwen3-30B-A3B's; more take kernels/host_staging's launch of many programs first).
POST_STAGED_ELEMENTS = 8192
STAGINGS = ("kernel", "copy")


@dataclass(frozen=True)
class HostChannelOptions:
    """How the channel runs the host kernel (module docstring): `dispatch` "mailbox" (a worker
    thread polling pinned memory; kernel staging only) or "host_function" (a CUDA host function
    on a side stream); `staging` "kernel" (kernels/host_staging on the main stream) or "copy"
    (`copy_` on the side stream); `schedule`, how the kernel deals its work units to its
    threads (kernels/fused_moe/host.py SCHEDULES); `activations`, the tokens' precision in the
    dots of int4 and mxfp4 banks: "bf16" (the exact path) or "int8" (quantized per group,
    integer dots; kernels/fused_moe/host.py ACTIVATIONS_PRECISIONS)."""

    dispatch: str = "mailbox"
    staging: str = "kernel"
    schedule: str = host_kernel.DEFAULT_SCHEDULE
    activations: str = host_kernel.DEFAULT_ACTIVATIONS

    def __post_init__(self):
        if self.dispatch not in DISPATCHES:
            raise ConfigError(f"--moe-host-dispatch {self.dispatch!r}: choose one of {', '.join(DISPATCHES)}")
        if self.staging not in STAGINGS:
            raise ConfigError(f"--moe-host-staging {self.staging!r}: choose one of {', '.join(STAGINGS)}")
        if self.schedule not in host_kernel.SCHEDULES:
            raise ConfigError(f"--moe-host-schedule {self.schedule!r}: choose one of {', '.join(host_kernel.SCHEDULES)}")
        if self.activations not in host_kernel.ACTIVATIONS_PRECISIONS:
            raise ConfigError(f"--moe-host-activations {self.activations!r}: choose one of "
                              f"{', '.join(host_kernel.ACTIVATIONS_PRECISIONS)}")
        if self.dispatch == "mailbox" and self.staging != "kernel":
            raise ConfigError("--moe-host-dispatch mailbox stages by kernel only: use --moe-host-staging kernel")


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
        self.counter = torch.zeros(host_mailbox.COUNTER_WORDS, dtype=torch.int64, device=device)
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
    `options`: how the kernel runs (`HostChannelOptions`).
    `dtype` is the model's compute dtype: the kernel computes a bf16 model's experts, their banks
    bf16 or quantized (fp8, int4, mxfp4), with or without biases, silu or gpt-oss's clamped
    SwiGLU; on a GPU nothing else runs here.
    """

    def __init__(self, banks: dict, max_tokens: int, top_k: int, device: torch.device, threads: int,
                 dtype: torch.dtype = torch.bfloat16, options: HostChannelOptions = HostChannelOptions()):
        sample = next(iter(banks.values()))
        bias_dtype = None if sample.w13_bias is None else sample.w13_bias.dtype
        self.compiled = host_kernel.compiles(dtype, sample.w13.dtype, bias_dtype, sample.activation)
        if not self.compiled and device.type == "cuda":
            raise ConfigError(f"the host expert kernel computes bfloat16 experts, not {dtype}: "
                              "use --dtype bfloat16 with --moe-strategy cpu or hybrid")
        self.banks = banks
        self.max_tokens, self.top_k = max_tokens, top_k
        self.hidden, self.inter = sample.w2.shape[1], sample.w13.shape[1] // 2
        self.device, self.threads, self.options = device, threads, options
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
                bank.w13, bank.w2, self.act, self.threads, schedule=self.options.schedule,
                activations=self.options.activations, **bank.kernel_args())
        return self.calls[key]

    def begin(self, layer_id: int, hidden: torch.Tensor, topk_weights: torch.Tensor, host_ids: torch.Tensor) -> None:
        """Start computing the routes whose `host_ids` entry is an expert id (>= 0; -1 elsewhere)
        for hidden [T, H]; on a GPU this returns at once, the work running on the side stream."""
        num_tokens = hidden.shape[0]
        if num_tokens > self.max_tokens:
            raise ValueError(f"host channel: {num_tokens} tokens in one call, buffers for {self.max_tokens}")
        if self.device.type != "cuda":
            self._inflight = (self._run_here(layer_id, hidden, topk_weights, host_ids), host_ids)
            return
        # The side stream reads the inputs after this returns: holding them until `finish` joins
        # it keeps the caching allocator from handing their memory to the main stream meanwhile.
        host_ids = host_ids.contiguous()
        self._inflight = (self.out_device[:num_tokens], hidden, topk_weights, host_ids)
        call = self._call(layer_id, num_tokens)
        inputs = [(hidden.contiguous(), self.x[:num_tokens]), (host_ids, self.ids[:num_tokens]),
                  (topk_weights.contiguous(), self.weights[:num_tokens])]
        if self.options.dispatch == "mailbox":
            # a layer whose routes all stay on the device posts nothing, stages nothing and waits
            # for nothing; a few tokens' inputs are staged by the posting launch itself
            in_post = hidden.numel() <= POST_STAGED_ELEMENTS
            if not in_post:
                staged_copy(inputs)
            host_mailbox.post_request(self.mailbox.box, self.mailbox.counter, self.mailbox.entry(call), host_ids,
                                      stage=inputs if in_post else ())
            return
        staged = self.options.staging == "kernel"
        if staged:
            staged_copy(inputs)
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
        routes = fused_moe(hidden, bank.w13, bank.w2, torch.where(on_host, topk_weights, 0.0), host_ids.clamp(min=0),
                           num_routed_experts=bank.num_experts, sum_routes=False, **bank.kernel_args())
        return torch.where(on_host.unsqueeze(-1), routes, 0.0)

    def stalled(self) -> bool:
        """Whether a mailbox wait ever gave up on the host kernel (never on a CPU-only machine)."""
        return self.device.type == "cuda" and self.mailbox.stalled()

    def finish(self, into: torch.Tensor | None = None) -> torch.Tensor:
        """The last `begin`'s host routes' weighted outputs [T, K, H] on the compute device (bf16
        from the kernel), joined into the current stream: zeros at the other routes, or with
        `into` (the device's routes [T, K, H], contiguous) merged into it, its own rows at the
        other routes, and `into` returned. Read it before the next `begin`."""
        routes, host_ids = self._inflight[0], self._inflight[-1]
        merged = False
        if self.device.type == "cuda":
            if self.options.dispatch == "mailbox":
                host_mailbox.wait_done(self.mailbox.box, self.mailbox.counter)
            else:
                torch.cuda.current_stream(self.device).wait_stream(self.side)
            if self.options.staging == "kernel":  # the host's routes alone cross PCIe, into `into` when given
                rows = routes.shape[0] * self.top_k
                merged = into is not None and into.dtype == routes.dtype and into.is_contiguous()
                staged_routes(self.out[:routes.shape[0]].view(rows, self.hidden),
                              (into if merged else routes).view(rows, self.hidden), host_ids.view(rows), keep=merged)
        self._inflight = ()
        if merged:
            return into
        if into is None:
            return routes
        return torch.where((host_ids >= 0).unsqueeze(-1), routes.to(into.dtype), into)
