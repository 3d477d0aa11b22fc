"""Copies beside compute: a decode layer's GPU work timed alone and while expert copies from
pinned host memory run on another stream, for each way of copying: the slot cache's gather
kernel (SM loads over PCIe) at several grid sizes, and the copy engine (one copy_ per expert
row, DMA). A lookahead pays only if the next layer's copies leave this layer's compute its
speed: this measures whether they do, and what the copy keeps of its bandwidth.

Compute: fused_moe of one token over 8 of 128 resident Qwen3-30B-A3B experts (bf16), and a
2048 -> 5120 bf16 linear (cuBLAS; the attention's qkv projection), each captured as a CUDA graph
of back-to-back calls (as a decode step runs them: no host launch time in the figure). Copies:
16 experts' w13 and w2 rows (151 MB) from a pinned bank into device slots. Each figure is the
median of --rounds runs; the compute graph holds as many calls as fit in half the copy.

GPU only: without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from benchmarks.common import add_results_flag, command_line, gpu_main, markdown_table, report

H, I, E, TOP_K = 2048, 768, 128, 8
COPIED = 16


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", type=int, nargs="+", default=[0, 32, 8],
                   help="gather grid caps to run (0: the default grid, one program per SM)")
    p.add_argument("--rounds", type=int, default=5)
    add_results_flag(p)
    return p.parse_args(argv)


def compute_cases() -> dict:
    """name -> callable: the layer's GPU work, on resident weights."""
    from moeferry.kernels.fused_moe import fused_moe

    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn((E, 2 * I, H), device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn((E, H, I), device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn((1, H), device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.randperm(E, device="cuda", generator=gen)[:TOP_K].view(1, TOP_K).int()
    weights = torch.full((1, TOP_K), 1.0 / TOP_K, device="cuda")
    qkv = torch.randn((5120, H), device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    return {"fused_moe": lambda: fused_moe(x, w13, w2, weights, ids, num_routed_experts=E),
            "linear 2048->5120": lambda: F.linear(x, qkv)}


def copy_cases(programs: list[int]) -> tuple[dict, int]:
    """name -> callable copying COPIED experts' rows host -> device; and the bytes each copies."""
    from moeferry.kernels.gather_copy import GatherTuning, gather_copy

    host = [torch.empty((2 * COPIED, 2 * I, H), dtype=torch.bfloat16).pin_memory(),
            torch.empty((2 * COPIED, H, I), dtype=torch.bfloat16).pin_memory()]
    slots = [torch.empty((COPIED, 2 * I, H), dtype=torch.bfloat16, device="cuda"),
             torch.empty((COPIED, H, I), dtype=torch.bfloat16, device="cuda")]
    src = torch.randperm(2 * COPIED)[:COPIED]
    plan_src, plan_dst = src.int().cuda(), torch.randperm(COPIED).int().cuda()
    count = torch.tensor([COPIED], dtype=torch.int32, device="cuda")
    nbytes = sum(b[0].numel() * b.element_size() for b in host) * COPIED

    def gather(cap: int):
        tuning = GatherTuning(max_programs=cap)
        return lambda: gather_copy(host, slots, plan_src, plan_dst, count, tuning=tuning, impl="triton")

    pairs = list(zip(src.tolist(), plan_dst.tolist()))

    def copy_engine():
        for e, slot in pairs:
            for h, d in zip(host, slots):
                d[slot].copy_(h[e], non_blocking=True)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = {f"gather, {cap or sms} programs": gather(cap) for cap in programs}
    cases["copy engine (copy_ per row)"] = copy_engine
    return cases, nbytes


def graphed(fn, reps: int) -> torch.cuda.CUDAGraph:
    """`reps` back-to-back calls of `fn` captured as one graph (after an eager warm-up)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def time_side_by_side(compute: torch.cuda.CUDAGraph | None, reps: int, copy) -> tuple[float, float]:
    """(µs per compute call, µs of the copy) with the copy and the compute graph's replay
    queued at once on two streams; either may be None (timed alone)."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    copy_start, copy_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    side.wait_stream(main)
    if copy is not None:
        with torch.cuda.stream(side):
            copy_start.record()
            copy()
            copy_end.record()
    start.record()
    if compute is not None:
        compute.replay()
    end.record()
    torch.cuda.synchronize()
    compute_us = start.elapsed_time(end) * 1e3 / reps if compute is not None else 0.0
    copy_us = copy_start.elapsed_time(copy_end) * 1e3 if copy is not None else 0.0
    return compute_us, copy_us


def median_pair(compute, reps: int, copy, rounds: int) -> tuple[float, float]:
    runs = [time_side_by_side(compute, reps, copy) for _ in range(rounds)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


@gpu_main("bench_overlap", parse_args)
def main(argv, args) -> int:
    computes = compute_cases()
    copies, nbytes = copy_cases(args.programs)
    for fn in [*computes.values(), *copies.values()]:  # compile, warm
        fn()
        fn()
    torch.cuda.synchronize()
    probe = {name: graphed(fn, 20) for name, fn in computes.items()}
    alone_compute = {name: median_pair(graph, 20, None, args.rounds)[0] for name, graph in probe.items()}
    rows = []
    for copy_name, copy in copies.items():
        copy_alone = median_pair(None, 1, copy, args.rounds)[1]
        row = [copy_name, f"{nbytes / copy_alone / 1e3:.1f}"]
        for name, fn in computes.items():
            reps = max(1, int(0.5 * copy_alone / alone_compute[name]))
            beside, copy_beside = median_pair(graphed(fn, reps), reps, copy, args.rounds)
            row += [f"{nbytes / copy_beside / 1e3:.1f}", f"{alone_compute[name]:.1f}", f"{beside:.1f}",
                    f"{beside / alone_compute[name]:.2f}x"]
        rows.append(row)
        print(row, flush=True)
    header = ["copy", "copy GB/s alone"]
    for name in computes:
        header += [f"copy GB/s beside {name}", f"{name} µs alone", f"{name} µs beside the copy", "slowdown"]
    notes = (f"{COPIED} Qwen3-30B-A3B experts' w13 and w2 rows ({nbytes / 1e6:.0f} MB) from pinned memory into device "
             "slots on a side stream, while the main stream replays a graph of the compute's calls for about half "
             f"the copy's time; medians of {args.rounds} runs. fused_moe: one token, top-8 of 128 resident bf16 experts. "
             "linear: one token through a 2048 x 5120 bf16 weight (cuBLAS).")
    report("copy/beside-compute", "Copies beside compute", command_line("benchmarks.bench_overlap", argv),
           markdown_table(header, rows), notes, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
