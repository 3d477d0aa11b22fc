"""The fused MoE op on the host CPU: routed experts computed from (pinned) host banks.

The arithmetic lives in host_experts.cpp (its header is the contract): bf16 tokens, bf16
weights or quantized ones (fp8, int4, mxfp4: dequantized to float32 exactly as the reference
dequantizes them), float32 dots, optional expert biases (bf16 or float32 banks) added to them,
silu or gpt-oss's clamped SwiGLU, the activation and each weighted route output rounded to
bf16, as the Triton kernel rounds them. Over int4 and mxfp4 banks a call may instead quantize
the tokens and the activated intermediate to int8 per group and take integer dots (`activations`
"int8", host_experts.cpp states its numerics; reference.int8_expert_routes is its oracle): the
weights are then read at the memory's speed rather than dequantized. It is compiled on first
use with the system C++ compiler into a cache folder keyed by the source and the compiler flags
(`library()`), and called through ctypes with raw pointers, so the same function also runs as a
CUDA host function inside a stream or a captured graph (moe/host_channel.py) with no Python and
no GIL.

`expert_routes` is the primitive: per-route outputs, routes with a negative id skipped (left
zero) so that another channel may compute them. `fused_moe` is the op's contract
(kernels/fused_moe/__init__.py) over it; tokens in another dtype than bf16, unquantized weights or
biases in another dtype, or a machine without a compiler, take the reference.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from moeferry.kernels import cpp_build
from moeferry.kernels.fused_moe import SILU, Activation, check_options, reference

__all__ = ["ACTIVATIONS", "ACTIVATIONS_PRECISIONS", "BIAS_FORMATS", "FORMATS", "INT8_ISAS", "VECTOR_ISAS",
           "HostKernelUnavailable", "MoEHostCall", "available", "compiles", "default_threads", "dequantized",
           "expert_routes", "fused_moe", "has_avx512_bf16", "int8_isa", "library", "make_call", "run", "timing"]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("host_experts.cpp")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


class HostKernelUnavailable(RuntimeError):
    """The host expert kernel could not be built (no C++ compiler, or it failed)."""


class MoEHostCall(ctypes.Structure):
    """host_experts.cpp's MoEHostCall, field for field. Holds raw pointers: the tensors they
    point into must outlive every run of the call (moe/host_channel.py keeps them)."""

    _fields_ = [("x", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("weights", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("w13", ctypes.c_void_p), ("w2", ctypes.c_void_p),
                ("act", ctypes.c_void_p), ("T", ctypes.c_int64), ("K", ctypes.c_int64),
                ("H", ctypes.c_int64), ("I", ctypes.c_int64), ("E", ctypes.c_int64),
                ("threads", ctypes.c_int32), ("use_avx512", ctypes.c_int32), ("format", ctypes.c_int32),
                ("block_n", ctypes.c_int32), ("block_k", ctypes.c_int32), ("w13_scale", ctypes.c_void_p),
                ("w2_scale", ctypes.c_void_p), ("w13_bias", ctypes.c_void_p), ("w2_bias", ctypes.c_void_p),
                ("bias_format", ctypes.c_int32), ("activation", ctypes.c_int32), ("alpha", ctypes.c_float),
                ("limit", ctypes.c_float), ("schedule", ctypes.c_int32), ("activations", ctypes.c_int32),
                ("int8_isa", ctypes.c_int32)]


# host_experts.cpp's MoEHostFormat by the weight banks' dtype: (code, values per stored
# element, the scales' dtype); the layouts are kernels/fused_moe/__init__.py's.
FORMATS = {torch.bfloat16: (0, 1, None), torch.float8_e4m3fn: (1, 1, torch.float32),
           torch.int32: (2, 8, torch.float32), torch.uint8: (3, 2, torch.uint8)}

# host_experts.cpp's MoEHostBiasFormat by the bias banks' dtype, and MoEHostActivation by name.
BIAS_FORMATS = {torch.bfloat16: 0, torch.float32: 1}
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}

# host_experts.cpp's MoEHostSchedule by name: the work units dealt in fixed blocks, or one at a
# time to whichever thread is free (a preempted thread then delays one unit, not its block).
SCHEDULES = {"static": 0, "dynamic": 1}
# Dynamic by default: the team is every core but one, so the engine's own threads and anything
# else on the host preempt its threads, and a dynamic team loses one unit to each where a static
# one waits at the barrier for the whole block (faster alone and beside busy processes in
# RESULTS.md hybrid/preemption).
DEFAULT_SCHEDULE = "dynamic"

# host_experts.cpp's MoEHostActivations by name: the precision of the tokens (and of the activated
# intermediate) in the dots of int4 and mxfp4 banks. "bf16": against the weights dequantized to
# float32, the reference's arithmetic (the exact path); "int8": quantized per token and group of
# the weights' scale group to int8, integer dots against the weights' integer values (the int8
# path, reference.int8_expert_routes). bf16 and fp8 banks have no integer weights: both names
# compute them on the exact path.
ACTIVATIONS_PRECISIONS = {"bf16": 0, "int8": 1}
DEFAULT_ACTIVATIONS = "bf16"

# host_experts.cpp's MoEHostInt8Isa by name: the int8 path's integer dots.
INT8_ISAS = {"portable": 0, "avx2": 1, "avx512_vnni": 2}


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The compiled kernel, built once per (source, compiler, flags, CPU model) and cached on
    disk; a build happens at most once per machine and source version."""
    try:
        lib = cpp_build.build(SOURCE, FLAGS, "moeferry_host_experts")
    except cpp_build.BuildUnavailable as exc:
        raise HostKernelUnavailable(f"the host expert kernel: {exc}") from None
    lib.moe_host_run.argtypes = [ctypes.c_void_p]
    lib.moe_host_run.restype = None
    lib.moe_host_has_avx512_bf16.restype = ctypes.c_int
    lib.moe_host_int8_isa.restype = ctypes.c_int
    lib.moe_host_timing.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.moe_host_timing.restype = None
    lib.moe_host_dequantize.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p]
    lib.moe_host_dequantize.restype = None
    lib.moe_host_worker_start.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.moe_host_worker_start.restype = ctypes.c_void_p
    lib.moe_host_worker_stop.argtypes = [ctypes.c_void_p]
    lib.moe_host_worker_stop.restype = None
    return lib


def timing() -> dict:
    """Every call so far in this process: count, total and longest wall time in seconds; the
    distinct experts the calls computed (`experts`, summed over calls); and the calls that
    computed any (`working_calls`, `working_seconds`: the others return without waking the
    threads, so they pay no fixed cost)."""
    values = (ctypes.c_int64 * 6)()
    library().moe_host_timing(values)
    return {"calls": values[0], "seconds": values[1] / 1e9, "longest_s": values[2] / 1e9, "experts": values[3],
            "working_calls": values[4], "working_seconds": values[5] / 1e9}


def available() -> bool:
    """Whether the kernel builds and loads here."""
    try:
        library()
    except HostKernelUnavailable:
        return False
    return True


def default_threads() -> int:
    """torch's intra-op thread count when moeferry loaded (threads.HOST_THREADS: one per
    physical core unless the user set it; the engine's own steps run with fewer), less one
    above two cores: the thread that launches and waits for the GPU's work keeps a core, so a
    descheduled worker never holds up a kernel's barrier."""
    from moeferry.threads import HOST_THREADS

    threads = HOST_THREADS
    return threads - 1 if threads > 2 else threads


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


# The vector paths by name: "auto" takes the best this CPU has for each arithmetic; a named one
# runs the arithmetic that has it on it (AVX512-BF16: the exact path's dots; AVX2 and
# AVX512-VNNI: the int8 path's) and the other on its portable loop (tests).
VECTOR_ISAS = ("auto", "avx512_bf16", "avx512_vnni", "avx2", "portable")


def has_avx512_bf16() -> bool:
    return bool(library().moe_host_has_avx512_bf16())


def int8_isa() -> str:
    """The best vector path of the int8 dots this CPU has (a name of `INT8_ISAS`)."""
    code = library().moe_host_int8_isa()
    return next(name for name, value in INT8_ISAS.items() if value == code)


def _isa_codes(vector_isa: str) -> tuple[int, int]:
    """(use_avx512, int8_isa) of the call for a name of `VECTOR_ISAS`."""
    if vector_isa not in VECTOR_ISAS:
        raise ValueError(f"vector_isa {vector_isa!r} not in {VECTOR_ISAS}")
    if vector_isa == "avx512_bf16" and not has_avx512_bf16():
        raise HostKernelUnavailable("this CPU has no AVX512-BF16")
    if vector_isa in INT8_ISAS and INT8_ISAS[vector_isa] > INT8_ISAS[int8_isa()]:
        raise HostKernelUnavailable(f"this CPU has no {vector_isa.upper().replace('_', '-')}")
    if vector_isa == "auto":
        return int(has_avx512_bf16()), INT8_ISAS[int8_isa()]
    return int(vector_isa == "avx512_bf16"), INT8_ISAS.get(vector_isa, 0)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def make_call(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
              w13: torch.Tensor, w2: torch.Tensor, act: torch.Tensor, threads: int,
              vector_isa: str = "auto", w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block_shape: tuple[int, int] | None = None, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, activation: Activation = SILU,
              schedule: str = DEFAULT_SCHEDULE, activations: str = DEFAULT_ACTIVATIONS) -> MoEHostCall:
    """The call over these CPU tensors (see host_experts.cpp): hidden [T, H] bf16, ids [T, K]
    int32, weights [T, K] float32, out [T, K, H] bf16, w13 [E, 2I, H], w2 [E, H, I] bf16, act
    scratch [>= T * K, I] bf16; all contiguous. Quantized banks (the dtype says the format,
    `FORMATS`) come with their scales and block_shape, in fused_moe's layout: w13 [E, 2I,
    ceil(H / pack)], w2 [E, H, ceil(I / pack)], w13_scale [E, 2 ceil(I / bn), ceil(H / bk)], w2_scale
    [E, ceil(H / bn), ceil(I / bk)]. Expert biases (gpt-oss), both or neither, in one dtype of
    `BIAS_FORMATS`: w13_bias [E, 2I] (gate's, then up's), w2_bias [E, H]; `activation` silu or
    the clamped SwiGLU with its alpha and limit (ExpertBanks.kernel_args() fits here as it fits
    fused_moe). Checks shapes, dtypes and placement once.
    `vector_isa`: auto (AVX512-BF16 where the CPU has it), or one named path (tests).
    `schedule`: how the work units are dealt to the threads (`SCHEDULES`); the outputs are
    the same bits either way, each unit being computed whole by one thread.
    `activations`: the tokens' precision in the dots of int4 and mxfp4 banks
    (`ACTIVATIONS_PRECISIONS`: bf16, the exact path, or int8)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"host expert call: schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if activations not in ACTIVATIONS_PRECISIONS:
        raise ValueError(f"host expert call: activations {activations!r} is not one of "
                         f"{', '.join(ACTIVATIONS_PRECISIONS)}")
    if w13.dtype not in FORMATS:
        raise ValueError(f"host expert call: weights of {w13.dtype} are not a format the kernel reads "
                         f"({', '.join(map(str, FORMATS))})")
    code, pack, scale_dtype = FORMATS[w13.dtype]
    if (scale_dtype is None) != (block_shape is None) or (w13_scale is None) != (block_shape is None):
        raise ValueError(f"host expert call: {w13.dtype} weights {'take' if scale_dtype else 'take no'} "
                         "w13_scale, w2_scale and block_shape")
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = ids.shape[1]
    expected = {"hidden": (hidden, torch.bfloat16, (num_tokens, hidden_size)),
                "ids": (ids, torch.int32, (num_tokens, top_k)),
                "weights": (weights, torch.float32, (num_tokens, top_k)),
                "out": (out, torch.bfloat16, (num_tokens, top_k, hidden_size)),
                "w13": (w13, w13.dtype, (num_experts, 2 * inter, _ceil(hidden_size, pack))),
                "w2": (w2, w13.dtype, (num_experts, hidden_size, _ceil(inter, pack)))}
    bn, bk = block_shape or (1, 1)
    if block_shape is not None:
        if code == 3 and bn != 1:
            raise ValueError(f"host expert call: mxfp4 scales are per row (block_shape (1, bk)), got {block_shape}")
        expected["w13_scale"] = (w13_scale, scale_dtype, (num_experts, 2 * _ceil(inter, bn), _ceil(hidden_size, bk)))
        expected["w2_scale"] = (w2_scale, scale_dtype, (num_experts, _ceil(hidden_size, bn), _ceil(inter, bk)))
    if (w13_bias is None) != (w2_bias is None):
        raise ValueError("host expert call: w13_bias and w2_bias come together or not at all")
    if w13_bias is not None:
        if w13_bias.dtype not in BIAS_FORMATS:
            raise ValueError(f"host expert call: biases of {w13_bias.dtype} are not a dtype the kernel reads "
                             f"({', '.join(map(str, BIAS_FORMATS))})")
        expected["w13_bias"] = (w13_bias, w13_bias.dtype, (num_experts, 2 * inter))
        expected["w2_bias"] = (w2_bias, w13_bias.dtype, (num_experts, hidden_size))
    for name, (t, dtype, shape) in expected.items():
        if t.device.type != "cpu" or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"host expert call: {name} must be a contiguous CPU {dtype} {list(shape)}, got "
                             f"{t.device.type} {t.dtype} {list(t.shape)}")
    if act.dtype != torch.bfloat16 or act.numel() < num_tokens * top_k * inter or not act.is_contiguous():
        raise ValueError(f"host expert call: act scratch must hold {num_tokens * top_k} x {inter} bf16")
    if threads < 1:
        raise ValueError(f"host expert call: threads must be >= 1, got {threads}")
    scales = (0, 0) if block_shape is None else (_ptr(w13_scale), _ptr(w2_scale))
    biases = (0, 0, 0) if w13_bias is None else (_ptr(w13_bias), _ptr(w2_bias), BIAS_FORMATS[w13_bias.dtype])
    use_avx512, int8 = _isa_codes(vector_isa)
    return MoEHostCall(_ptr(hidden), _ptr(ids), _ptr(weights), _ptr(out), _ptr(w13), _ptr(w2), _ptr(act),
                       num_tokens, top_k, hidden_size, inter, num_experts, threads, use_avx512,
                       code, bn, bk, *scales, *biases, ACTIVATIONS[activation.name], activation.alpha,
                       activation.limit, SCHEDULES[schedule], ACTIVATIONS_PRECISIONS[activations], int8)


def dequantized(call: MoEHostCall, bank: int, expert: int) -> torch.Tensor:
    """float32 w13 [2I, H] (bank 0) or w2 [H, I] (bank 1) of expert `expert` of a quantized
    call, as the kernel dequantizes its rows for the dots."""
    if call.format == 0 or bank not in (0, 1) or not 0 <= expert < call.E:
        raise ValueError(f"dequantized: a quantized call's bank 0 or 1 and expert < {call.E}")
    rows, cols = (2 * call.I, call.H) if bank == 0 else (call.H, call.I)
    out = torch.empty(rows, cols, dtype=torch.float32)
    library().moe_host_dequantize(ctypes.byref(call), bank, expert, 0, rows, _ptr(out))
    return out


def run(call: MoEHostCall) -> None:
    """Run a call now, on this thread (the GIL is released while it runs)."""
    library().moe_host_run(ctypes.byref(call))


def expert_routes(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, threads: int | None = None, vector_isa: str = "auto",
                  w13_scale=None, w2_scale=None, block_shape=None, w13_bias=None, w2_bias=None,
                  activation: Activation = SILU, schedule: str = DEFAULT_SCHEDULE,
                  activations: str = DEFAULT_ACTIVATIONS) -> torch.Tensor:
    """The weighted per-route outputs [T, K, H] bf16 of the routes whose id is >= 0; routes
    with a negative id are zero (another channel computes them). `activations`: make_call's."""
    num_tokens, top_k = topk_ids.shape
    hidden = hidden.contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.float().contiguous()
    out = torch.empty(num_tokens, top_k, hidden.shape[1], dtype=torch.bfloat16)
    act = torch.empty(num_tokens * top_k, w13.shape[1] // 2, dtype=torch.bfloat16)
    run(make_call(hidden, ids, weights, out, w13, w2, act, threads or default_threads(), vector_isa,
                  w13_scale, w2_scale, block_shape, w13_bias, w2_bias, activation, schedule, activations))
    return out


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, *, num_routed_experts=None, block_assignment="auto",
              out=None, sum_routes=True, w13_scale=None, w2_scale=None, block_shape=None, w13_bias=None,
              w2_bias=None, activation=SILU) -> torch.Tensor:
    """The op's contract on the host: bf16 tokens over bf16 or quantized banks, with or without
    expert biases, silu or the clamped SwiGLU, through the compiled kernel; other dtypes and a
    machine that cannot build it through the reference.
    sum_routes=False gives the bf16 route outputs [T, K, H], as the Triton kernel does."""
    check_options(block_assignment, out, sum_routes, (w13_scale, w2_scale), block_shape, (w13_bias, w2_bias))
    bias_dtype = None if w13_bias is None else w13_bias.dtype
    if not (compiles(hidden.dtype, w13.dtype, bias_dtype, activation) and available()):
        return reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids, num_routed_experts=num_routed_experts,
                                   block_assignment=block_assignment, out=out, sum_routes=sum_routes,
                                   w13_scale=w13_scale, w2_scale=w2_scale, block_shape=block_shape,
                                   w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)
    routes = expert_routes(hidden, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale,
                           block_shape=block_shape, w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)
    if not sum_routes:
        return routes
    total = reference.sum_route_partials(routes)
    if out is None:
        return total.to(hidden.dtype)
    out.copy_(total)
    return out


def compiles(dtype: torch.dtype, weight_dtype: torch.dtype, bias_dtype: torch.dtype | None = None,
             activation: Activation = SILU) -> bool:
    """Whether the compiled kernel computes these experts: bf16 tokens, weights in one of
    `FORMATS`, no biases or biases in one of `BIAS_FORMATS`, an activation of `ACTIVATIONS`
    (silu, gpt-oss's clamped SwiGLU); `available` says whether it builds here."""
    return (dtype == torch.bfloat16 and weight_dtype in FORMATS and (bias_dtype is None or bias_dtype in BIAS_FORMATS)
            and activation.name in ACTIVATIONS)
