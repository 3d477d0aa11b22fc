"""Decode-sized linear layers: the skinny Triton kernel against F.linear (cuBLAS), GPU only.

Qwen3-30B-A3B's per-layer projections, bf16 (fused qkv 5120 x 2048, o_proj 2048 x 4096, router
gate 128 x 2048) and its lm_head (151936 x 2048), at 1 to 16 rows. Each figure is one
call's time: CALLS calls (48, a decode step's layers) captured in one CUDA graph, the graph
replayed ``--replays`` times, the total divided by calls x replays. Consecutive calls read
distinct weights, so none is still in the 60 MB L2 when read: 48 copies of a weight, or more
for small ones (the router: at least FLUSH_BYTES between two reads of one copy, so more calls
per graph), fewer for the lm_head (MAX_BYTES of copies, read in turn). The floor is the bytes
a call must move (weight, x, y) over the H200's 4.3 TB/s of HBM.

``--sweep`` times the kernel's tile configurations (LinearConfig: the CUDA-core or the
tensor-core path, tiles, warps, stages) per weight shape and row count (``--sweep-rows``) and
prints the best few beside select_config's choice.

    python -m benchmarks.bench_linear [--rows 1 2 4 8 16] [--shapes qkv o_proj router lm_head]
                                      [--sweep [--sweep-rows 1 16]] [--results FILE...]

GPU only: without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import add_results_flag, command_line, gpu_main, replay_us, report
from moeferry.engine.cuda_graph import capture

SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048), "lm_head": (151936, 2048)}
ROWS = (1, 2, 4, 8, 16)
CALLS = 48
FLUSH_BYTES = 256 << 20  # > 4x the L2 between two reads of one weight copy
MAX_BYTES = 4 << 30  # of weight copies per shape
HBM_BYTES_PER_S = 4.3e12
DTYPE = torch.bfloat16


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also rank the kernel's tile configurations")
    p.add_argument("--sweep-rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--sweep-log", help="append every configuration's time to this file")
    p.add_argument("--top", type=int, default=5, help="configurations shown per shape by --sweep")
    add_results_flag(p)
    return p.parse_args(argv)


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    nbytes = n * k * DTYPE.itemsize
    count = max(math.ceil(FLUSH_BYTES / nbytes), min(CALLS, MAX_BYTES // nbytes), 2)
    g = torch.Generator(device="cuda").manual_seed(n + k)
    return [(torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(DTYPE) for _ in range(count)]


def us_per_call(fn, x: torch.Tensor, weights: list[torch.Tensor], replays: int) -> float:
    """fn(x, weight) over max(CALLS, len(weights)) calls in one CUDA graph, weights in turn."""
    calls = max(CALLS, len(weights))

    def step():
        for i in range(calls):
            fn(x, weights[i % len(weights)])

    graph, _ = capture(step)
    graph.replay()
    return replay_us(graph, replays) / calls


def call_bytes(m: int, n: int, k: int) -> int:
    return (n * k + m * k + m * n) * DTYPE.itemsize


def describe(config) -> str:
    kind = "dot" if config.tensor_cores else f"fma{config.block_m}"
    return f"{kind} {config.block_n}/{config.block_k}/{config.num_warps}w/{config.num_stages}s"


def compare(args) -> str:
    from moeferry.kernels.linear import triton as skinny

    lines = [("| layer | N x K | rows | MiB | floor µs | cuBLAS µs | Triton µs | cuBLAS / Triton | Triton GB/s "
              "| % of 4.3 TB/s | tiles (path BN/BK/warps/stages) |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = weight_copies(n, k)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            nbytes = call_bytes(m, n, k)
            cublas = us_per_call(F.linear, x, weights, args.replays)
            triton_us = us_per_call(skinny.linear, x, weights, args.replays)
            lines.append(f"| {name} | {n} x {k} | {m} | {n * k * 2 / 2**20:.1f} | "
                         f"{nbytes / HBM_BYTES_PER_S * 1e6:.2f} | {cublas:.2f} | {triton_us:.2f} | "
                         f"{cublas / triton_us:.2f}x | {nbytes / triton_us / 1e3:.0f} | "
                         f"{nbytes / (triton_us * 1e-6) / HBM_BYTES_PER_S:.0%} | "
                         f"{describe(skinny.select_config(m, n, k))} |")
            print(lines[-1], file=sys.stderr, flush=True)
        del weights
        torch.cuda.empty_cache()
    return "\n".join(lines) + "\n"


def candidate_configs(m: int, k: int):
    """Tiles worth timing at m rows: CUDA cores (at most 64 fp32 partial sums a thread), and
    tensor cores from 2 rows."""
    from moeferry.kernels.linear.triton import LinearConfig

    block_m = min(16, 1 << (m - 1).bit_length())
    for bn, bk, warps in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (4, 8)):
        if bk <= k and block_m * bn * bk <= 64 * 32 * warps:
            yield LinearConfig(block_m, bn, bk, warps, 1)
    if m >= 2:
        for bn, bk, stages in itertools.product((16, 32, 64), (128, 256), (3, 4)):
            yield LinearConfig(16, bn, bk, 4, stages, tensor_cores=True)


def sweep(args) -> str:
    from triton.runtime.errors import OutOfResources

    from moeferry.kernels.linear import triton as skinny

    lines = ["| layer | rows | tiles (path BN/BK/warps/stages) | µs | chosen |", "|---|---:|---|---:|---|"]
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = weight_copies(n, k)
        for m in args.sweep_rows:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            chosen = skinny.select_config(m, n, k)
            results = []
            for config in {chosen, *candidate_configs(m, k)}:
                fn = functools.partial(skinny.linear, config=config)
                try:
                    torch.testing.assert_close(fn(x, weights[0]), F.linear(x, weights[0]), rtol=2e-2, atol=2e-2)
                    results.append((us_per_call(fn, x, weights, args.replays), config))
                except (AssertionError, OutOfResources) as e:  # wrong, or too big for an SM: not a candidate
                    print(f"{name} {m} {describe(config)}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
            results.sort(key=lambda r: r[0])
            shown = results[:args.top] + [r for r in results[args.top:] if r[1] == chosen]
            for t, config in shown:
                lines.append(f"| {name} | {m} | {describe(config)} | {t:.2f} | {'yes' if config == chosen else ''} |")
            print("\n".join(lines[-len(shown):]), file=sys.stderr, flush=True)
            if args.sweep_log:
                with open(args.sweep_log, "a") as f:
                    f.writelines(f"{name} {m} {describe(c)} {t:.3f}\n" for t, c in results)
        del weights
        torch.cuda.empty_cache()
    return "\n".join(lines) + "\n"


@gpu_main("bench_linear", parse_args)
def main(argv, args) -> int:
    torch.manual_seed(0)
    command = command_line("benchmarks.bench_linear", argv)
    report("linear", "Skinny linear vs cuBLAS, Qwen3-30B-A3B shapes, bf16", command, compare(args),
           f"{CALLS} calls with distinct weights per CUDA graph (none still in L2), {args.replays} replays; "
           "floor: the bytes a call moves over 4.3 TB/s.", args.results)
    if args.sweep:
        report("linear/sweep", f"Skinny linear tile sweep, bf16: µs per call, best {args.top} per shape and row "
               "count, and select_config's", command, sweep(args), results=args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
