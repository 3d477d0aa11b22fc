"""Where a decode step's device time goes: decode steps under torch.profiler, a row per
strategy, lookahead and statistics setting, the kernels grouped by name, and the step's device
time split by what runs at once: copies (the slot cache's gather of host rows, any memcpy) and
compute (every other kernel), each one's busy time, the time both run together and the time
nothing runs (the device idle: launches, waits on the host). A step whose copies and compute
never overlap pays their sum; a lookahead that works shows as overlap.

The engine is bench_hybrid's (12-layer Qwen3-30B-A3B shape, or --shape gpt-oss: gpt-oss-20b's,
dummy weights) under generated routes (--routing; gpt-oss: --routing model, its own router), the
cache at --share of the experts, with or without --moe-prefetch (oracle: the generated routes'
next layer at --oracle-recall).

GPU only: without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import tempfile

import torch

from benchmarks.common import (DECODE_WARMUP_STEPS, MODEL_ROUTING, add_results_flag, add_routing_flag, command_line, force_routing, free_engine_memory, gpu_main,
                               markdown_table, report, routing_note, share_slots, start_decode, timed_decode)
from tests.support.fixtures import GPT_OSS_20B_DIR_CONFIG, QWEN3_30B_DIR_CONFIG, write_config_dir

# --shape: the model named and its config.json (dummy weights)
MODELS = {"qwen3": ("Qwen3-30B-A3B", QWEN3_30B_DIR_CONFIG), "gpt-oss": ("gpt-oss-20b", GPT_OSS_20B_DIR_CONFIG)}
COPY_KERNELS = ("gather_rows", "memcpy", "Memcpy")
DEFAULT_SHARE = 0.25
WAIT_KERNELS = ("wait_done",)  # a kernel spinning on a host worker's done word (copy engine, host experts)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", nargs="+", choices=["gpu", "offload", "hybrid", "uva"], default=["gpu", "offload"])
    p.add_argument("--share", type=float, default=DEFAULT_SHARE,
                   help="offload and hybrid: the experts on the GPU (another share: a section of its own)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--shape", choices=sorted(MODELS), default="qwen3", help="the model's config (dummy weights)")
    p.add_argument("--quantization", choices=["int4", "fp8", "mxfp4"], default=None,
                   help="the experts' format (bf16 without)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--host-threads", type=int, default=None,
                   help="hybrid: --moe-host-threads (default: the engine's; fewer leave the copy engine's worker a core)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=DECODE_WARMUP_STEPS,
                   help="untimed decode steps first: the slot cache settles (benchmarks/common.py)")
    p.add_argument("--steps", type=int, default=8, help="decode steps profiled (and timed without the profiler)")
    p.add_argument("--prefetch", nargs="+", choices=["off", "router", "oracle"], default=["off"],
                   help="offload and hybrid rows with each lookahead (oracle: at --oracle-recall)")
    p.add_argument("--oracle-recall", type=float, default=1.0)
    p.add_argument("--stats", nargs="+", choices=["on", "off"], default=["off"],
                   help="rows with the admission and prefetch statistics on, off or both")
    p.add_argument("--eager", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--async-scheduling", nargs="+", choices=["on", "off"], default=["on"],
                   help="rows with each step launched before the previous one's tokens are read (on), or not")
    p.add_argument("--top", type=int, default=12, help="kernels listed a row, by time a step")
    p.add_argument("--trace-dir", default=None, help="also write each row's Chrome trace here (gzipped JSON)")
    add_routing_flag(p, default="qwen3")
    add_results_flag(p)
    args = p.parse_args(argv)
    if args.shape != "qwen3" and args.routing != MODEL_ROUTING:
        p.error(f"--shape {args.shape} routes by its own router: --routing {MODEL_ROUTING}")
    return args


def device_events(trace: dict) -> list[dict]:
    """The trace's device work: complete events of the kernel, memcpy and memset categories."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in kinds]


def is_copy(event: dict) -> bool:
    return event.get("cat") == "gpu_memcpy" or any(k in event["name"] for k in COPY_KERNELS)


def is_wait(event: dict) -> bool:
    return any(k in event["name"] for k in WAIT_KERNELS)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted disjoint intervals covering the same time as `intervals`."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def covered(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time covered by both of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def effective_spans(events: list[dict]) -> list[tuple[float, float]]:
    """Each event's span from when it could run: under programmatic dependent launch a kernel
    starts early and waits for the one before it on its stream, so its start is taken as the
    later of its own and that kernel's end (events in the order given)."""
    spans = [(0.0, 0.0)] * len(events)
    last_end: dict = {}
    for i in sorted(range(len(events)), key=lambda i: float(events[i]["ts"])):
        e = events[i]
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        stream = e.get("tid")
        start = min(end, max(start, last_end.get(stream, start)))
        last_end[stream] = max(end, last_end.get(stream, end))
        spans[i] = (start, end)
    return spans


def copy_wait_edges(spans: list[tuple[float, float]], events: list[dict]) -> tuple[int, float, float]:
    """Of every waiting kernel that copies overlap (the copy engine's): how many, the time from
    its start to its first copy's (the worker seeing the request, its driver calls, the DMA's
    start) and from its last copy's end to its own end (the done word's write and the GPU's poll),
    summed. Both are latency on top of the copies themselves."""
    copies = sorted(s for s, e in zip(spans, events) if is_copy(e))
    count, lead, tail = 0, 0.0, 0.0
    for (start, end), e in zip(spans, events):
        if not is_wait(e):
            continue
        inside = [(s, t) for s, t in copies if s < end and t > start]
        if inside:
            count += 1
            lead += max(0.0, inside[0][0] - start)
            tail += max(0.0, end - max(t for _, t in inside))
    return count, lead, tail


def step_summary(events: list[dict], steps: int) -> dict:
    """Microseconds a step, over the events' effective spans (`effective_spans`): the window
    from the first device event to the last, busy (anything running), copy, compute and waiting
    busy (a kernel spinning on a host worker is neither copy nor compute), copy and compute's
    overlap, idle; and per kernel name its calls and time a step, largest first."""
    if not events:
        return {"window": 0.0, "busy": 0.0, "copy": 0.0, "compute": 0.0, "waiting": 0.0, "overlap": 0.0, "idle": 0.0,
                "copy_waits": 0.0, "wait_lead": 0.0, "wait_tail": 0.0, "kernels": []}
    spans = effective_spans(events)
    copies = union([s for s, e in zip(spans, events) if is_copy(e)])
    compute = union([s for s, e in zip(spans, events) if not is_copy(e) and not is_wait(e)])
    waiting = union([s for s, e in zip(spans, events) if is_wait(e)])
    window = max(end for _, end in spans) - min(start for start, _ in spans)
    busy = covered(union(spans))
    by_name: dict[str, list[float]] = {}
    for (start, end), e in zip(spans, events):
        calls_time = by_name.setdefault(e["name"], [0, 0.0])
        calls_time[0] += 1
        calls_time[1] += end - start
    copy_waits, lead, tail = copy_wait_edges(spans, events)
    kernels = sorted(((name, n / steps, t / steps) for name, (n, t) in by_name.items()), key=lambda k: -k[2])
    return {"window": window / steps, "busy": busy / steps, "copy": covered(copies) / steps,
            "compute": covered(compute) / steps, "waiting": covered(waiting) / steps, "overlap": intersection(copies, compute) / steps,
            "idle": (window - busy) / steps, "copy_waits": copy_waits / steps, "wait_lead": lead / steps,
            "wait_tail": tail / steps, "kernels": kernels}


def make_engine(config_dir, args, strategy: str, prefetch: str, stats: str, sched: str):
    """bench_hybrid's engine under `strategy`, the routes forced, the cache at --share, the
    statistics, the lookahead and the async scheduling as the row has them, graphs captured."""
    from benchmarks.bench_hybrid import make_engine as hybrid_engine

    engine_args = argparse.Namespace(prompt_len=args.prompt_len, warmup=args.warmup, steps=args.steps,
                                     batch=[args.batch], layers=args.layers, host_threads=args.host_threads,
                                     quantization=args.quantization)
    engine = hybrid_engine(config_dir, engine_args, strategy, moe_prefetch="off" if prefetch == "off" else "router",
                           disable_cuda_graph=args.eager, async_scheduling=sched == "on")
    s = engine.runner.strategy
    if s.store.admits:
        s.store.build_cache(share_slots(engine, args.share))
    s.set_statistics(stats == "on")
    forced = force_routing(engine, args.routing, args.routing_seed,
                           oracle_recall=args.oracle_recall if prefetch == "oracle" else None)
    if prefetch == "oracle":
        s.prefetch.predict_from(forced.predictions)
    engine.runner.recapture_graphs()
    s.restart_cache()
    return engine


def profile_decode(engine, args, trace_path: str | None) -> tuple[list[dict], float]:
    """The device events of `args.steps` decode steps of `args.batch` requests, and the wall
    time a step (µs) of as many steps timed without the profiler just before."""
    wall = timed_decode(engine, args.batch, args.prompt_len, args.warmup, args.steps, lambda e: {})["step_s"] * 1e6
    start_decode(engine, args.batch, args.prompt_len, args.warmup, args.steps)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_work:
        engine.step()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.remove(path)
    if trace_path:
        with gzip.open(trace_path, "wt") as f:
            json.dump(trace, f)
    return device_events(trace), wall


def short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def variants(args) -> list[tuple[str, str, str, str]]:
    """(strategy, prefetch, statistics, async scheduling) of every row: a lookahead only over a
    slot cache, the statistics only where a strategy keeps them."""
    rows = []
    for strategy in args.strategies:
        cached = strategy in ("offload", "hybrid")
        for prefetch in (args.prefetch if cached else ["off"]):
            for stats in (args.stats if cached else ["off"]):
                rows += [(strategy, prefetch, stats, sched) for sched in args.async_scheduling]
    return rows


def label(args, strategy: str, prefetch: str, stats: str, sched: str) -> str:
    text = strategy + (f" {args.share:.0%}" if strategy in ("offload", "hybrid") else "")
    if prefetch != "off":
        text += ", prefetch " + (f"oracle {args.oracle_recall:g}" if prefetch == "oracle" else prefetch)
    return text + (", statistics on" if stats == "on" else "") + (", async off" if sched == "off" else "")


@gpu_main("bench_profile", parse_args)
def main(argv, args) -> int:
    model, config = MODELS[args.shape]
    config_dir = tempfile.mkdtemp()
    write_config_dir(config_dir, config)
    rows = []
    for row in variants(args):
        engine = make_engine(config_dir, args, *row)
        name = label(args, *row)
        trace = os.path.join(args.trace_dir, name.replace(" ", "_").replace(",", "").replace("%", "") + ".json.gz") \
            if args.trace_dir else None
        events, wall = profile_decode(engine, args, trace)
        s = step_summary(events, args.steps)
        rows.append([name, f"{wall:.0f}", f"{s['window']:.0f}", f"{s['busy']:.0f}", f"{s['copy']:.0f}",
                     f"{s['compute']:.0f}", f"{s['waiting']:.0f}", f"{s['overlap']:.0f}", f"{s['idle']:.0f}",
                     f"{s['copy_waits']:.1f} / {s['wait_lead']:.0f} / {s['wait_tail']:.0f}"])
        print(f"{name}:\n" + markdown_table(["kernel", "calls a step", "µs a step"],
                                             [[short(n), f"{c:.1f}", f"{t:.1f}"] for n, c, t in s["kernels"][:args.top]])
              + "\n", flush=True)
        del engine
        free_engine_memory()
    body = markdown_table(["row", "wall µs a step", "device window", "busy", "copy", "compute", "waiting",
                           "copy ∥ compute", "idle", "copy waits: count / before / after copies"], rows)
    notes = (f"{args.layers} layers of the {model} shape, {args.quantization or 'bf16'} experts, dummy weights, "
             f"batch {args.batch}, "
             f"{'eager' if args.eager else 'CUDA graphs'}; {args.steps} decode steps under torch.profiler, µs a step. "
             "Wall: the same steps timed without the profiler. Each kernel counted from when it could run (a kernel "
             "launched early under programmatic dependent launch waits for the one before it on its stream). Device "
             "window: first device event to last, the host's time between steps included; busy: anything running; "
             "copy: the slot cache's gather kernel and memcpys; waiting: kernels spinning on a host worker's done "
             "word (the copy engine's copies, the host's experts); compute: every other kernel; copy ∥ compute: "
             "both at once; idle: nothing; copy waits: waiting kernels with copies under them, a step, and their "
             "time before the first copy starts (the worker seeing the request, its driver calls) and after the "
             "last one ends (the done word's write, the GPU's poll). Async scheduling on unless a row says off "
             "(each step launched before the host reads the previous one's tokens). "
             + (f"Hybrid's host kernel on {args.host_threads} threads. " if args.host_threads else "")
             + routing_note(args.routing, args.routing_seed))
    section = "decode-profile" + ("" if args.shape == "qwen3" else f"/{args.shape}") + \
        ("" if args.share == DEFAULT_SHARE else f"/at-{round(args.share * 100)}")
    report(section, f"Where a decode step's device time goes, routing {args.routing}",
           command_line("benchmarks.bench_profile", argv), body, notes, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
