"""Miss-copy bandwidth: the gather kernel reading pinned host memory vs
the measured pinned host-to-device bandwidth of torch's copy_.

Rows are Qwen3-30B-A3B expert banks: w13 [1536, 2048] bf16 (6 MiB) and w2 [2048, 768] bf16
(3 MiB). For 8 to 64 misses the gather copies that many rows chosen at random from a
64-expert host bank into random slots; the reference bandwidth is one copy_ of the same
number of bytes. The two alternate (``--rounds`` times ``--iters`` calls of each) and the
medians are compared: the link's speed drifts by a few percent between measurements, so a
ratio of two separate runs says as much about the drift as about the kernel. GPU only:
without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks.common import (add_results_flag, command_line, gpu_main, h2d_bandwidth, pinned_h2d_copy,
                               report, us_per_call)

BANKS = {"w13 6 MiB": (1536, 2048), "w2 3 MiB": (2048, 768)}
MISSES = (8, 16, 32, 64)
H2D_SIZES_MIB = (3, 6, 48, 192, 384)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--misses", type=int, nargs="+", default=list(MISSES))
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=7,
                   help="gather and copy_ alternate this many times; the medians are reported")
    p.add_argument("--programs-per-sm", type=int, help="the gather's grid (default: GatherTuning's)")
    add_results_flag(p)
    return p.parse_args(argv)


def gather_case(row_shape, experts: int, misses: int, tuning=None):
    """(gather, copy_) callables over the same bytes: ``misses`` rows chosen at random from an
    ``experts``-row pinned bank gathered into random slots (the gather run with ``tuning``, a
    GatherTuning), and one copy_ of as many bytes."""
    from moeferry.kernels.gather_copy import GatherTuning, gather_copy

    tuning = tuning or GatherTuning()

    host = torch.empty((experts, *row_shape), dtype=torch.bfloat16).pin_memory()
    slots = torch.empty((max(experts, misses), *row_shape), dtype=torch.bfloat16, device="cuda")
    plan_src = torch.randperm(experts)[:misses].int().cuda()
    plan_dst = torch.randperm(slots.shape[0])[:misses].int().cuda()
    count = torch.tensor([misses], dtype=torch.int32, device="cuda")
    nbytes = misses * host[0].numel() * host.element_size()
    return (lambda: gather_copy([host], [slots], plan_src, plan_dst, count, tuning=tuning, impl="triton"),
            pinned_h2d_copy(nbytes), nbytes)


def gather_vs_copy(row_shape, experts: int, misses: int, iters: int, rounds: int, tuning=None):
    """(gather GB/s, copy_ GB/s): the medians over ``rounds`` rounds, each timing ``iters``
    gathers and then ``iters`` copy_ of the same bytes, so both see the same link state."""
    gather, copy, nbytes = gather_case(row_shape, experts, misses, tuning)
    gather_us, copy_us = [], []
    for _ in range(rounds):
        gather_us.append(us_per_call(gather, iters))
        copy_us.append(us_per_call(copy, iters))
    return nbytes / statistics.median(gather_us) / 1e3, nbytes / statistics.median(copy_us) / 1e3


@gpu_main("bench_copy", parse_args)
def main(argv, args) -> int:
    from moeferry.kernels.gather_copy import GatherTuning

    tuning = GatherTuning(**({"programs_per_sm": args.programs_per_sm} if args.programs_per_sm else {}))
    h2d = [f"{h2d_bandwidth(mib << 20, args.iters) / 1e9:.1f}" for mib in H2D_SIZES_MIB]
    lines = [f"Pinned H2D copy_, GB/s at {' / '.join(map(str, H2D_SIZES_MIB))} MiB: {' / '.join(h2d)}.", "",
             f"#### Miss gather from pinned memory (programs per SM: {tuning.programs_per_sm})", "",
             "| bank | misses | MiB | gather GB/s | copy_ GB/s (same bytes) | % of H2D |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, shape in BANKS.items():
        args.experts = max(args.experts, max(args.misses))
        for misses in args.misses:
            nbytes = misses * shape[0] * shape[1] * 2
            gather, h2d = gather_vs_copy(shape, args.experts, misses, args.iters, args.rounds, tuning)
            lines.append(f"| {name} | {misses} | {nbytes >> 20} | {gather:.1f} | {h2d:.1f} "
                         f"| {gather / h2d:.0%} |")
    report("copy", "Miss-copy bandwidth: pinned H2D copy_ and the miss gather",
           command_line("benchmarks.bench_copy", argv), "\n".join(lines),
           f"The gather and a copy_ of the same bytes alternate, {args.rounds} rounds of {args.iters} calls each; "
           f"medians.", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
