"""Admission cost per call of the slot cache's admission kernel.

Top-10 over 512 experts, a 2,100-slot cache, 48 MoE layers: one decode step's 48
admissions (one per layer) are captured in one CUDA graph and replayed 40 times.
Microseconds per admission at each width, all hits and with about 10% misses, without the
statistics counters (the engine's default) and with them (``--moe-collect-stats``: calls,
misses, and an atomic add per route into the decode histogram).

Routes: each layer draws from a window of ``slots // layers`` (43) of its experts, so every
layer's working set fits the cache together. "hits": the window is fixed and pre-admitted.
"misses": the window slides by a tenth of its width at each replay, so each call meets
new experts; the measured miss rate is printed. Each replay is preceded by a copy of that
replay's routes into the graph's static input; the copies are timed alone and subtracted.
The copies of the missed experts are not part of this figure (bench_copy.py measures them).

GPU only: without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import (add_results_flag, command_line, elapsed_us, gpu_main, markdown_table,
                               report)

REQUESTS = (1, 4, 8, 12, 13, 16, 24, 32, 48, 128, 256, 410)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=list(REQUESTS))
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=512)
    p.add_argument("--slots", type=int, default=2100)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--replays", type=int, default=40)
    p.add_argument("--policy", choices=("lru", "lrfu", "layer_lru"), default="lru")
    p.add_argument("--miss-share", type=float, default=0.1)
    add_results_flag(p)
    return p.parse_args(argv)


def route_variants(args, requests, shift, count):
    """Routes [count, layers, requests * top_k] int64, variant v drawing from each layer's
    window slid by v * shift, and the layers' first windows [layers, window]."""
    window = min(args.experts, args.slots // args.layers)
    routes = torch.empty(count, args.layers, requests * args.top_k, dtype=torch.long)
    first_windows = torch.empty(args.layers, window, dtype=torch.long)
    for layer in range(args.layers):
        perm = torch.randperm(args.experts)
        first_windows[layer] = perm[:window]
        for v in range(count):
            members = perm[(v * shift + torch.arange(window)) % args.experts]
            routes[v, layer] = members[torch.randint(window, (requests * args.top_k,))]
    return routes.cuda(), first_windows.cuda()


def decode_totals(cache) -> dict | None:
    return cache.stats.snapshot()["decode"]["total"] if cache.stats else None


def measure(args, requests: int, with_misses: bool, stats: bool,
            before_timing=None, tuning=None) -> tuple[float, float]:
    """(microseconds per admission, miss rate; NaN without ``stats``, the counters), the kernel
    run with ``tuning`` (an AdmissionTuning; default its defaults). ``before_timing``, when
    given, is called once the graph is warm, before the timed replays."""
    from moeferry.kernels.admission import AdmissionTuning
    from moeferry.moe.slot_cache import SlotCache

    width = requests * args.top_k
    cache = SlotCache(args.layers, args.experts, args.slots, device="cuda", eviction_policy=args.policy,
                      max_routes=max(width, 4096), collect_stats=stats, tuning=tuning or AdmissionTuning())
    window = min(args.experts, args.slots // args.layers)
    shift = max(1, round(args.miss_share * window)) if with_misses else 0
    warm = 4
    variants, first_windows = route_variants(args, requests, shift, warm + args.replays)
    static = variants[0].clone()
    for layer in range(args.layers):  # every window fits: all hits while windows stay put
        cache.admit(layer, first_windows[layer])
        cache.admit(layer, static[layer].view(requests, args.top_k))  # compiles this width
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(args.layers):
            cache.admit(layer, static[layer].view(requests, args.top_k))
    for v in range(1, warm):
        static.copy_(variants[v])
        graph.replay()
    before = decode_totals(cache)
    if before_timing is not None:
        before_timing()

    def replays():
        for v in range(warm, warm + args.replays):
            static.copy_(variants[v])
            graph.replay()

    def copies_only():
        for v in range(warm, warm + args.replays):
            static.copy_(variants[v])

    total = elapsed_us(replays)
    after = decode_totals(cache)
    copies = elapsed_us(copies_only)
    per_call_us = (total - copies) / (args.replays * args.layers)
    if not stats:
        return per_call_us, float("nan")
    misses = after["misses"] - before["misses"]
    distinct = after["distinct"] - before["distinct"]
    return per_call_us, misses / max(distinct, 1)


def table(args, rows) -> str:
    header = ["requests", "routes", "all hits (us)", "with misses (us)", "all hits, statistics (us)",
              "with misses, statistics (us)", "miss rate"]
    return markdown_table(header, [[requests, requests * args.top_k, *(f"{t:.2f}" for t in times), f"{miss_rate:.1%}"]
                                   for requests, times, miss_rate in rows])


@gpu_main("bench_admission", parse_args)
def main(argv, args) -> int:
    torch.manual_seed(0)
    rows = []
    for requests in args.requests:
        measured = [measure(args, requests, with_misses, stats)
                    for stats in (False, True) for with_misses in (False, True)]
        times, miss_rate = [us for us, _ in measured], measured[-1][1]
        rows.append((requests, times, miss_rate))
        print(f"requests {requests}: {times[0]:.2f} / {times[1]:.2f} us all hits / with "
              f"{miss_rate:.1%} misses, {times[2]:.2f} / {times[3]:.2f} us with statistics",
              file=sys.stderr)
    report(f"admission/{args.policy}", f"Admission, policy {args.policy}",
           command_line("benchmarks.bench_admission", argv), table(args, rows),
           (f"Top-{args.top_k} over {args.experts} experts, {args.slots} slots, {args.layers} admissions per "
            f"graph, {args.replays} replays; microseconds per admission. Routes: each layer draws from a window "
            f"of its experts that fits the cache; with misses, the window slides by {args.miss_share:.0%} of its "
            f"width each replay (the miss rate is measured with statistics)."), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
