"""The host channel: decode tokens/s of `cpu`, `offload`, `hybrid` and `gpu` at 0 / 25 /
50 / 75 / 100% of the experts on the GPU, with both channels' floors, and the host expert
kernel's GB/s at 4 / 8 / 16 threads and decode batches 1-16 against torch's bf16 matmul.

Routing is generated inside the decode graph (--routing, benchmarks/common.force_routing):
uniform by default, so the hit rate follows the cache share, or qwen3 / mixtral, those models'
published locality; the same routes for every strategy. Each row
prints its measured split of the step's distinct experts: hit (resident), copied over PCIe,
computed on the host. Floors: PCIe = copied bytes / measured H2D; host = host-computed bytes /
the host kernel's measured bytes/s; two-channel = all missed bytes / (H2D + host), the best any
split of the misses can do; host kernel ms: the kernel's own wall time per step (its calls
timed inside, as the graph's host nodes run them). llama.cpp's batch-1 figures (`--n-cpu-moe`, the CPU computes the
experts not on the GPU) were measured on the same host and shape.

GPU only: without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks.common import (DECODE_WARMUP_STEPS, add_results_flag, add_routing_flag, command_line, force_routing, free_engine_memory,
                               gpu_main, h2d_bandwidth, markdown_table, report, routed_section, routing_note, set_statistics,
                               share_slots, timed_decode)
from moeferry.kernels.fused_moe.host import DEFAULT_SCHEDULE, SCHEDULES
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

LLAMA_CPP_BATCH1 = {0.0: 74.3, 0.25: 93.9, 0.5: 134.6, 0.75: 237.7, 1.0: 596.6}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=DECODE_WARMUP_STEPS,
                   help="untimed decode steps first: the slot cache settles (benchmarks/common.py)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="runs per row, the fastest kept")
    p.add_argument("--parts", nargs="+", choices=["decode", "kernel", "big", "contention", "timeline", "preemption"],
                   default=["decode", "kernel"],
                   help="contention: the host kernel's and pinned H2D copies' GB/s alone and at once (both read "
                        "the host's DRAM); timeline: where a hybrid decode step's time goes, layer by layer "
                        "(device timestamps inside the graph, moe/timeline.py); preemption: the host kernel per "
                        "schedule, alone and beside processes busy on other cores")
    p.add_argument("--timeline-shares", type=float, nargs="+", default=[0.25, 0.75],
                   help="the `timeline` part: hybrid at these shares of the experts on the GPU")
    p.add_argument("--big-layers", type=int, default=48, help="the `big` part: hybrid at 25%% on this many layers")
    p.add_argument("--threads", type=int, nargs="+", default=[4, 8, 16], help="host kernel table")
    p.add_argument("--host-threads", type=int, default=None,
                   help="--moe-host-threads of the cpu and hybrid engines (default: the engine's, one per core "
                        "less one): fewer leave the OpenMP team headroom against other work on the host")
    p.add_argument("--dispatch", nargs="+", choices=["host_function", "mailbox"], default=["mailbox"],
                   help="cpu and hybrid rows once per host-kernel dispatch (moe/host_channel.py): a CUDA host "
                        "function on the side stream, or the mailbox worker awaited by a kernel (kernel staging)")
    p.add_argument("--staging", nargs="+", choices=["kernel", "copy"], default=["kernel"],
                   help="cpu and hybrid rows once per host-channel staging (moe/host_channel.py): kernels on "
                        "the main stream, or copy_ on the side stream")
    p.add_argument("--schedule", nargs="+", choices=list(SCHEDULES), default=[DEFAULT_SCHEDULE],
                   help="cpu and hybrid rows once per host-kernel schedule (kernels/fused_moe/host.py SCHEDULES)")
    add_routing_flag(p)
    p.add_argument("--host-share", type=lambda v: None if v == "tuned" else float(v), nargs="+", default=[None],
                   help="hybrid rows once per host share of the misses: a fixed one (--moe-host-share) or tuned "
                        "(the default)")
    p.add_argument("--prefetch", nargs="+", choices=["off", "router", "oracle"], default=["off"],
                   help="offload and hybrid rows with each lookahead: off; router (--moe-prefetch router: the next "
                        "layer's router on this layer's input, meaningful under --routing model only); oracle (the "
                        "generated routes' next layer predicted at --oracle-recall, with as many wrong experts)")
    p.add_argument("--oracle-recall", type=float, nargs="+", default=[0.8],
                   help="the oracle prefetch's recall (oracle rows once per value)")
    p.add_argument("--prefetch-programs", type=int, nargs="+", default=[0],
                   help="prefetch rows once per grid cap of the gather that copies ahead (--moe-prefetch-programs; "
                        "0: its full grid)")
    p.add_argument("--prefetch-experts", type=int, nargs="+", default=[0],
                   help="prefetch rows once per cap on a layer's predicted misses copied ahead "
                        "(--moe-prefetch-experts; 0: all)")
    p.add_argument("--miss-copy", nargs="+", choices=["gather", "dma"], default=["dma"],
                   help="offload and hybrid rows once per way of copying a layer's misses (--moe-miss-copy)")
    p.add_argument("--prefetch-copy", nargs="+", choices=["gather", "dma"], default=["dma"],
                   help="prefetch rows once per way of copying ahead (--moe-prefetch-copy; gather rows once per "
                        "--prefetch-programs)")
    p.add_argument("--quantization", choices=["int4", "fp8", "mxfp4"], default=None,
                   help="the decode rows' experts quantized at load (default bf16; no llama.cpp column then)")
    add_results_flag(p)
    return p.parse_args(argv)


def make_engine(config_dir, args, strategy, layers=None, slots=None, **options):
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    max_len = args.prompt_len + args.warmup + args.steps + 16
    if strategy in ("cpu", "hybrid") and args.host_threads:
        options.setdefault("moe_host_threads", args.host_threads)
    ec = EngineConfig(model=config_dir, load_format="dummy",
                      hf_overrides={"num_hidden_layers": layers or args.layers}, moe_strategy=strategy,
                      moe_cache_slots=slots, max_running_requests=max(args.batch), max_model_len=max_len,
                      num_tokens=(max_len + 16) * max(args.batch),
                      moe_collect_stats=strategy in ("offload", "hybrid", "cpu"),
                      quantization=getattr(args, "quantization", None), **options)
    return Engine(ec)


def step_counters(engine) -> dict:
    """Cumulative decode counts: distinct experts the slot cache saw, its misses (copied), and
    experts computed on the host."""
    s = engine.runner.strategy.stats()
    decode = s.get("decode", {}).get("total", {"distinct": 0, "misses": 0})
    kernel = s.get("host_kernel") or {"seconds": 0.0}
    prefetch = s.get("prefetch") or {}
    return {"device": decode["distinct"], "copied": decode["misses"], "host": s.get("host_experts", 0),
            "host_s": kernel["seconds"], "prefetched": prefetch.get("copied", 0), "useful": prefetch.get("useful", 0)}


def host_alone(strategy) -> float:
    """The host kernel's bytes per second right now (one token to top-k experts a call, the
    median of 7, less the fixed cost a call as the start-up figure counts it): the host's
    state beside a row, since its DRAM bandwidth varies between runs."""
    from moeferry.moe.host_speeds import host_call_time

    channel = strategy.host.channel if strategy.host is not None else None
    if channel is None or not channel.compiled:
        return 0.0
    top_k = strategy.model_config.top_k
    busy = host_call_time(strategy.banks, channel, top_k, 7) - strategy.host.speeds.host_call_s
    return top_k * strategy.expert_bytes / busy if busy > 0 else 0.0


def decode_row(engine, args, label, share, batch, expert_bytes, h2d, host_bw) -> list:
    """One row: the step timed with the statistics off (the fastest of --repeats runs), the
    split of its experts counted in one more run with them on (the counters add kernels)."""
    host_now = host_alone(engine.runner.strategy)
    set_statistics(engine, True)
    engine.runner.strategy.restart_cache()
    counted = timed_decode(engine, batch, args.prompt_len, args.warmup, args.steps, step_counters)
    set_statistics(engine, False)
    runs = []
    for _ in range(args.repeats):
        engine.runner.strategy.restart_cache()
        runs.append(timed_decode(engine, batch, args.prompt_len, args.warmup, args.steps, lambda e: {}))
    run = {**counted, **max(runs, key=lambda r: r["tok_s"])}
    hit = run["device"] - run["copied"] - run["useful"]  # a useful prefetch was a miss, moved early
    total = hit + run["copied"] + run["useful"] + run["host"]
    pcie_ms = (run["copied"] + run["prefetched"]) * expert_bytes / h2d * 1e3
    host_ms = run["host"] * expert_bytes / host_bw * 1e3 if host_bw else 0.0
    missed = run["copied"] + run["useful"] + run["host"]
    two_ms = missed * expert_bytes / (h2d + host_bw) * 1e3
    llama = LLAMA_CPP_BATCH1.get(share) if batch == 1 and not getattr(args, "quantization", None) else None
    tuner = getattr(engine.runner.strategy.split, "tuner", None)
    row = [f"{share:.0%}", batch, label, f"{run['tok_s']:.1f}", f"{run['step_s'] * 1e3:.2f}",
           f"{hit / total:.2f}" if total else "-", f"{hit:.0f} / {run['copied']:.0f} / {run['host']:.0f}",
           f"{run['prefetched']:.1f} / {run['useful']:.1f}",
           f"{pcie_ms:.2f}", f"{host_ms:.2f}", f"{run['host_s'] * 1e3:.2f}", f"{host_now / 1e9:.1f}" if host_now else "-", f"{two_ms:.2f}",
           f"{tuner.speeds.host_share:.2f}" if tuner else "-",
           f"{llama:.1f}" if llama else "-", f"{run['tok_s'] / llama:.2f}x" if llama else "-"]
    print(row, flush=True)
    return row


def host_channel_modes(args) -> list[tuple[str, str, str, float | None]]:
    """(dispatch, staging, schedule, host share or None: tuned) to run the host strategies' rows
    with: each staging under the host-function dispatch, and the mailbox (which stages by
    kernel), each under every schedule and host share asked for."""
    modes = [("host_function", staging) for staging in args.staging] if "host_function" in args.dispatch else []
    modes += [("mailbox", "kernel")] if "mailbox" in args.dispatch else []
    return [(dispatch, staging, schedule, share) for dispatch, staging in modes for schedule in args.schedule
            for share in args.host_share]


def mode_label(args, mode: tuple[str, str, str, float | None]) -> str:
    """What tells a row's host-channel mode from the others' in the table ("" when one mode runs)."""
    dispatch, staging, schedule, share = mode
    words = [] if args.host_share == [None] else [f"host share {share:g}" if share is not None else "host share tuned"]
    if len({m[:2] for m in host_channel_modes(args)}) > 1:
        words.append("mailbox" if dispatch == "mailbox" else f"{staging} staging")
    if len(args.schedule) > 1:
        words.append(f"{schedule} schedule")
    return "".join(f", {w}" for w in words)


def prefetch_note(args) -> str:
    """The line under a decode table on its prefetch rows: what was predicted, how well, and
    how the floors count prefetched copies."""
    if args.prefetch == ["off"]:
        return ""
    return (" Prefetch: " + (f"oracle: each of the next layer's routed experts predicted with probability "
                             f"{' or '.join(f'{r:g}' for r in args.oracle_recall)} (as the row says), each one "
                             "missed replaced by an expert it does not route "
                             "(moeferry/routing/profiles.py OraclePredictor); " if "oracle" in args.prefetch else "")
            + "prefetched / useful: experts copied ahead per step, and those of them the layer routed. The PCIe "
              "floor counts every copy (demand and ahead); the two-channel floor only the routed misses (copied "
              "on demand, useful prefetches, host).")


def prefetch_ways(args) -> list[tuple[str, int, int]]:
    """(copy, gather grid cap, misses cap) of each prefetch row: the gather once per grid cap,
    the copy engine once, each once per misses cap."""
    ways = ([("gather", programs) for programs in args.prefetch_programs] if "gather" in args.prefetch_copy else []) \
        + ([("dma", 0)] if "dma" in args.prefetch_copy else [])
    return [(copy, programs, cap) for copy, programs in ways for cap in args.prefetch_experts]


def prefetch_label(lookahead: str, recall: float | None) -> str:
    if lookahead == "off":
        return ""
    return ", prefetch " + (f"oracle {recall:g}" if lookahead == "oracle" else lookahead)


def decode_rows(config_dir, args, h2d) -> tuple[list[list], float]:
    rows, host_bw = [], 0.0
    plan = [("cpu", [s for s in args.shares if s == 0.0]),
            ("offload", [s for s in args.shares if 0.0 < s < 1.0]),
            ("hybrid", [s for s in args.shares if 0.0 <= s <= 1.0]),
            ("gpu", [s for s in args.shares if s == 1.0])]
    for strategy, shares in plan:
        if not shares:
            continue
        lookaheads = [(a, recall, *way) for a in (args.prefetch if strategy in ("offload", "hybrid") else ["off"])
                      for recall in (args.oracle_recall if a == "oracle" else [None])
                      for way in (prefetch_ways(args) if a != "off" else [("dma", 0, 0)])]
        modes = host_channel_modes(args) if strategy in ("cpu", "hybrid") else [None]
        misses = args.miss_copy if strategy in ("offload", "hybrid") else [None]
        for mode, miss, (lookahead, recall, copy, programs, cap) in (
                (m, c, a) for m in modes for c in misses for a in lookaheads):
            options = dict(zip(("moe_host_dispatch", "moe_host_staging", "moe_host_schedule"), mode[:3] if mode else ()))
            if miss is not None:
                options["moe_miss_copy"] = miss
            if mode and mode[3] is not None and strategy == "hybrid":
                options["moe_host_share"] = mode[3]
            if lookahead != "off":
                options.update(moe_prefetch_copy=copy, moe_prefetch_programs=programs, moe_prefetch_experts=cap)
            engine = make_engine(config_dir, args, strategy, moe_prefetch="off" if lookahead == "off" else "router",
                                 **options)
            forced = force_routing(engine, args.routing, args.routing_seed,
                                   oracle_recall=recall)
            s = engine.runner.strategy
            if lookahead == "oracle":
                s.prefetch.predict_from(forced.predictions)
            host_bw = s.host.speeds.host_bytes_per_s if s.host is not None else host_bw
            for share in shares:
                if strategy in ("offload", "hybrid"):
                    s.store.build_cache(share_slots(engine, share))
                engine.runner.recapture_graphs()  # the graphs bake in the router hooks and the pool
                label = "hybrid, one layer of slots" if strategy == "hybrid" and share == 0.0 else strategy
                label += mode_label(args, mode) if mode else ""
                label += f", misses by {miss}" if miss is not None and len(args.miss_copy) > 1 else ""
                label += prefetch_label(lookahead, recall) + (f", gather on {programs} programs" if programs else "")
                label += ", gather" if copy == "gather" and len(args.prefetch_copy) > 1 else ""
                label += f", at most {cap} a layer" if cap else ""
                for batch in args.batch:
                    rows.append(decode_row(engine, args, label, share, batch, s.expert_bytes, h2d, host_bw))
            del engine, s
            free_engine_memory()
    return rows, host_bw


TIMELINE_SPANS = ("split routes", "stage, post", "admit, copy misses", "GPU experts", "wait for host, unstage", "combine")


def split_floors(distinct: float, misses: float, expert_bytes: int, pcie_bytes_per_s: float,
                 host_bytes_per_s: float) -> tuple[float, float]:
    """The two channels' microseconds a layer at their floors (bytes over each one's bandwidth
    alone, no fixed costs, no contention): with whole experts, a layer's misses ~
    Binomial(distinct, misses / distinct) (uniform routing), each layer's split at the count
    that ends both channels soonest; and with experts divisible, the misses at the summed rate."""
    from math import comb

    t_copy, t_host = expert_bytes / pcie_bytes_per_s * 1e6, expert_bytes / host_bytes_per_s * 1e6
    n_max = max(1, round(distinct))
    q = min(1.0, misses / n_max)
    whole = sum(comb(n_max, n) * q ** n * (1 - q) ** (n_max - n) *
                min(max((n - h) * t_copy, h * t_host) for h in range(n + 1)) for n in range(n_max + 1))
    return whole, misses * expert_bytes / (pcie_bytes_per_s + host_bytes_per_s) * 1e6  # the decode rows' two-channel floor


def timeline_rows(config_dir, args, h2d: float) -> list[list]:
    """Per hybrid row: the mean microseconds a decode layer spends from each stamped point to
    the next (moe/timeline.py HYBRID_POINTS, named by TIMELINE_SPANS), between layers
    (attention, router, norms), over all MoE layers, and the host kernel's own time a layer."""
    from moeferry.moe.timeline import HYBRID_POINTS

    engine = make_engine(config_dir, args, "hybrid", moe_timeline=True)
    force_routing(engine, args.routing, args.routing_seed)
    s = engine.runner.strategy
    layers = len(s.moe_layer_of)
    rows = []
    for share in args.timeline_shares:
        s.store.build_cache(share_slots(engine, share))
        engine.runner.recapture_graphs()  # the graphs hold the pool's pointers
        for batch in args.batch:
            s.restart_cache()
            first = []

            def counters(engine):  # before the timed steps: forget the prefill's and warm-up's stamps
                if not first:
                    s.timeline.reset()
                    first.append(True)
                return step_counters(engine)

            host_now = host_alone(s)
            run = timed_decode(engine, batch, args.prompt_len, args.warmup, args.steps, counters)
            summary = s.timeline.summary()
            spans = dict(zip(TIMELINE_SPANS, (summary[f"{a} -> {b}"] for a, b in zip(HYBRID_POINTS, HYBRID_POINTS[1:]))))
            step_us, host_us = run["step_s"] * 1e6 / layers, run["host_s"] * 1e6 / layers
            floors = split_floors((run["device"] + run["host"]) / layers, (run["copied"] + run["host"]) / layers,
                                  s.expert_bytes, h2d, host_now) if host_now else None
            # The layer at a floor: its other spans as measured (its GPU experts after the copies, as
            # the design runs them), the two channels at their floor.
            rest_us = step_us - spans["admit, copy misses"] - spans["wait for host, unstage"]
            rows.append([f"{share:.0%}", batch, f"{run['tok_s']:.1f}", f"{step_us:.0f}",
                         *(f"{v:.1f}" for v in spans.values()), f"{summary['between layers']:.1f}",
                         f"{host_us:.1f}", f"{host_now / 1e9:.1f}" if host_now else "-",
                         f"{run['host'] / layers:.2f}", f"{run['copied'] / layers:.2f}",
                         *((f"{rest_us + f:.0f}" for f in floors) if floors else ("-", "-")), summary["steps"]])
            print(rows[-1], flush=True)
    del engine, s
    free_engine_memory()
    return rows


def big_rows(config_dir, args, h2d) -> list[list]:
    engine = make_engine(config_dir, args, "hybrid", layers=args.big_layers)
    force_routing(engine, args.routing, args.routing_seed)
    s = engine.runner.strategy
    s.store.build_cache(share_slots(engine, 0.25))
    engine.runner.recapture_graphs()
    host_gib = sum(b.w13.nbytes + b.w2.nbytes for b in s.banks.values()) / 2**30
    rows = []
    for batch in args.batch:
        row = decode_row(engine, args, f"hybrid, {args.big_layers} layers", 0.25, batch, s.expert_bytes, h2d,
                         s.host.speeds.host_bytes_per_s)
        rows.append(row[:BIG_COLUMNS] + [f"{host_gib:.1f}"])
    del engine, s
    free_engine_memory()
    return rows


def expert_layer(gen: torch.Generator | None = None, pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of Qwen3-30B-A3B experts, bf16 N(0, 0.02): w13 [128, 1536, 2048] and w2
    [128, 2048, 768], 1.2 GB (beyond any L3), pinned when asked (as the host store is)."""
    cfg = QWEN3_30B_DIR_CONFIG
    hidden, inter, experts = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
    w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
    return (w13.pin_memory(), w2.pin_memory()) if pinned else (w13, w2)


def kernel_rows(args) -> list[list]:
    """GB/s of expert weights: the host kernel against torch bf16 F.linear per expert, one
    layer's 128 Qwen3-30B-A3B experts (1.2 GB, beyond the L3) under uniform top-8 routing."""
    from moeferry.kernels.fused_moe import host

    gen = torch.Generator().manual_seed(0)
    w13, w2 = expert_layer(gen)
    experts, hidden, top_k = w13.shape[0], w2.shape[1], 8
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in (1, 2, 4, 8, 16):
            calls = [torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(batch)]).int()
                     for _ in range(12)]
            x = torch.randn(batch, hidden, generator=gen).bfloat16()
            weights = torch.full((batch, top_k), 1.0 / top_k)
            distinct = sum(len(torch.unique(ids)) for ids in calls[2:])

            def ours():
                for ids in calls[2:]:
                    host.expert_routes(x, w13, w2, weights, ids, threads=threads)

            def torch_linear():
                for ids in calls[2:]:
                    for e in torch.unique(ids).tolist():
                        rows_e = (ids == e).any(dim=1)
                        gate, up = F.linear(x[rows_e], w13[e]).chunk(2, dim=-1)
                        F.linear(F.silu(gate) * up, w2[e])

            figures = []
            for fn in (ours, torch_linear):
                fn()
                start = time.perf_counter()
                fn()
                figures.append(distinct * expert_bytes / (time.perf_counter() - start) / 1e9)
            rows.append([threads, batch, f"{distinct / 10:.1f}", f"{figures[0]:.1f}", f"{figures[1]:.1f}",
                         f"{figures[0] / figures[1]:.2f}x"])
            print(rows[-1], flush=True)
    torch.set_num_threads(os.cpu_count() or 1)
    return rows


@dataclasses.dataclass
class HostKernelBench:
    """Host kernel calls over one layer of Qwen3-30B-A3B experts (bf16, random, pinned on a GPU
    machine: 1.2 GB), one token routed to 8 of them a call, 16 calls covering all 128.
    Invariant: the calls hold raw pointers into `tensors`; hold this object while any runs."""

    tensors: dict
    calls: list
    expert_bytes: int
    top_k: int = 8

    def host_step(self, i: int) -> None:
        """Run the i-th call (cycling), `top_k` experts' weights read."""
        from moeferry.kernels.fused_moe import host

        host.run(self.calls[i % len(self.calls)])


def host_kernel_calls(threads: int, schedule: str = DEFAULT_SCHEDULE) -> HostKernelBench:
    from moeferry.kernels.fused_moe import host

    w13, w2 = expert_layer(pinned=torch.cuda.is_available())  # plain memory on a CPU-only machine
    experts, hidden, inter, top_k = w13.shape[0], w2.shape[1], w2.shape[2], 8
    t = dict(w13=w13, w2=w2, x=torch.randn(1, hidden).bfloat16(), weights=torch.full((1, top_k), 1.0 / top_k),
             out=torch.empty(1, top_k, hidden, dtype=torch.bfloat16), act=torch.empty(top_k, inter, dtype=torch.bfloat16),
             ids=[(torch.arange(top_k, dtype=torch.int32) + i * top_k).reshape(1, top_k) % experts
                  for i in range(experts // top_k)])
    calls = [host.make_call(t["x"], ids, t["weights"], t["out"], w13, w2, t["act"], threads, schedule=schedule)
             for ids in t["ids"]]
    return HostKernelBench(t, calls, (w13[0].numel() + w2[0].numel()) * 2, top_k)


def preemption_rows(args, seconds: float = 1.0) -> list[list]:
    """The host kernel with the engine's default thread count (one per core less one), per
    schedule, alone and beside 1 and 2 processes that each spin on a core: other work the OS
    must fit in, as on a host that also serves something else. A static team waits at every
    barrier for its slowest thread; a dynamic one deals its units to whichever thread is free.
    GB/s of expert weights over `seconds` after a quarter second untimed."""
    import subprocess
    import sys

    from moeferry.kernels.fused_moe import host

    threads = host.default_threads()
    rows = []
    for schedule in host.SCHEDULES:
        bench = host_kernel_calls(threads, schedule)  # held while its calls run
        host_channel = timed_channel(bench.host_step, bench.top_k * bench.expert_bytes, "host")
        for busy in (0, 1, 2):
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                run_together([host_channel], 0.25)  # untimed
                gb_per_s = run_together([host_channel], seconds)["host"]
            finally:
                for p in spinners:
                    p.kill()
                    p.wait()
            rows.append([schedule, threads, busy, f"{gb_per_s:.1f}"])
            print(rows[-1], flush=True)
    return rows


def timed_channel(step, step_bytes: int, key: str):
    """A channel's loop for `run_together`: `step(i)` moves `step_bytes` (the i-th call's
    experts) until stopped, timed from `go`; its GB/s under `key`."""
    def run(stop, result, go):
        done = 0
        go.wait()
        start = time.perf_counter()
        while not stop.is_set():
            step(done)
            done += 1
        result[key] = done * step_bytes / (time.perf_counter() - start) / 1e9
    return run


def run_together(channels, duration: float) -> dict:
    """Run `channels` (timed_channel loops) on threads at once for `duration` seconds (the host
    kernel through ctypes runs without the GIL); their figures."""
    import threading

    stop, result, go = threading.Event(), {}, threading.Event()
    workers = [threading.Thread(target=fn, args=(stop, result, go)) for fn in channels]
    for w in workers:
        w.start()
    go.set()
    time.sleep(duration)
    stop.set()
    for w in workers:
        w.join()
    return result


def contention_rows(args, seconds: float = 2.0) -> list[list]:
    """Both channels read the host's DRAM: GB/s of the host kernel (one token on 8 experts a
    call, over 1.2 GB of experts, 16 threads or --threads' largest) and of pinned H2D copies of
    whole experts, each alone for `seconds`, then both at once (the kernel on a Python thread,
    which ctypes runs without the GIL), then the host kernel alone again: a second figure that
    tells a drift (warm-up, clock) from contention. Each run times only after a quarter second
    untimed."""
    threads = max(args.threads)
    bench = host_kernel_calls(threads)  # held to the end: the calls point into its tensors
    expert_bytes, top_k = bench.expert_bytes, bench.top_k
    w13, w2 = bench.tensors["w13"], bench.tensors["w2"]
    experts = w13.shape[0]
    slots13, slots2 = (torch.empty_like(w[:top_k], device="cuda") for w in (w13, w2))

    def copy_step(i: int) -> None:
        first = (i * top_k) % experts
        slots13.copy_(w13[first:first + top_k], non_blocking=True)
        slots2.copy_(w2[first:first + top_k], non_blocking=True)
        torch.cuda.synchronize()

    step_bytes = top_k * expert_bytes
    host_channel = timed_channel(bench.host_step, step_bytes, "host")
    copy_channel = timed_channel(copy_step, step_bytes, "pcie")

    rows = []
    for label, channels in (("host kernel alone", [host_channel]), ("H2D copies alone", [copy_channel]),
                            ("both at once", [host_channel, copy_channel]),
                            ("host kernel alone, again", [host_channel])):
        run_together(channels, 0.25)  # untimed
        result = run_together(channels, seconds)
        host_gb, pcie_gb = result.get("host"), result.get("pcie")
        rows.append([label, threads, f"{host_gb:.1f}" if host_gb else "-", f"{pcie_gb:.1f}" if pcie_gb else "-",
                     f"{(host_gb or 0) + (pcie_gb or 0):.1f}"])
        print(rows[-1], flush=True)
    return rows


DECODE_HEADER = ["experts on GPU", "requests", "strategy", "tok/s", "ms/step", "hit rate",
                 "experts/step hit / copied / host", "prefetched / useful per step", "PCIe floor ms", "host floor ms", "host kernel ms",
                 "host alone GB/s before",
                 "two-channel floor ms", "host share at the end",
                 "llama.cpp tok/s", "vs llama.cpp"]
BIG_COLUMNS = DECODE_HEADER.index("llama.cpp tok/s")  # the `big` rows: no llama.cpp figure at 48 layers


@gpu_main("bench_hybrid", parse_args)
def main(argv, args) -> int:
    config_dir = write_config_dir(os.path.join(tempfile.mkdtemp(), "qwen3-30b-a3b"), QWEN3_30B_DIR_CONFIG)
    h2d = h2d_bandwidth()
    command = command_line("benchmarks.bench_hybrid", argv)
    if "kernel" in args.parts:
        body = markdown_table(["threads", "requests", "distinct experts/call", "host kernel GB/s", "torch bf16 GB/s",
                               "ratio"], kernel_rows(args))
        report("hybrid/host-kernel", "Host expert kernel GB/s", command, body,
               f"One layer's {QWEN3_30B_DIR_CONFIG['num_experts']} Qwen3-30B-A3B experts (bf16, 9.44 MB each), "
               "uniform top-8 routing, 10 timed calls after 2 untimed; GB/s of distinct expert weights read. torch: "
               "F.linear per routed expert over its tokens, torch's own threads set to the same count.",
               args.results)
    host_bw = 0.0
    if "decode" in args.parts:
        rows, host_bw = decode_rows(config_dir, args, h2d)
        prefetch = args.prefetch != ["off"]
        report(routed_section("hybrid/decode", args.routing) + ("/prefetch" if prefetch else "")
               + ("/host-share" if args.host_share != [None] else "")
               + ("/miss-copy" if args.miss_copy != ["dma"] else "")
               + (f"/{args.quantization}" if args.quantization else ""),
               f"Decode with {'the lookahead prefetch' if prefetch else 'the host channel'}, routing {args.routing}"
               + (f", {args.quantization} experts" if args.quantization else ""),
               command,
               markdown_table(DECODE_HEADER, rows),
               f"{args.layers} layers, 128 experts, top-8, {args.quantization or 'bf16'} experts, dummy weights; prompt {args.prompt_len}, {args.warmup} warm-up + {args.steps} timed "
               f"steps, cache restarted warm before each run, timed with the statistics off (the fastest of "
               f"{args.repeats}), the split from one more run with them on. Measured H2D {h2d / 1e9:.1f} GB/s, host kernel "
               f"{host_bw / 1e9:.1f} GB/s (the strategy's start-up measurement, one token per expert). "
               + routing_note(args.routing, args.routing_seed) + prefetch_note(args),
               args.results)
    if "contention" in args.parts:
        rows = contention_rows(args)
        report("hybrid/contention", "The two channels on one host DRAM", command,
               markdown_table(["run", "threads", "host kernel GB/s", "H2D GB/s", "sum GB/s"], rows),
               "Qwen3-30B-A3B experts (9.44 MB each, bf16, pinned): the host kernel on one token routed to 8 "
               "experts a call, cycling over 128; H2D copies of 8 whole experts at a time into device slots; "
               "each run 2 s timed after 0.25 s untimed: alone, both at once, then the host kernel alone again. "
               "The two-channel floor assumes the sum of the alone figures.",
               args.results)
    if "preemption" in args.parts:
        rows = preemption_rows(args)
        report("hybrid/preemption", "The host kernel beside other work on the host", command,
               markdown_table(["schedule", "threads", "busy processes", "host kernel GB/s"], rows),
               "One token routed to 8 of 128 Qwen3-30B-A3B experts a call (bf16, 9.44 MB each), the engine's "
               "default thread count, each schedule alone and beside 1 and 2 processes spinning on a core each; "
               "1 s timed after 0.25 s untimed (kernels/fused_moe/host.py SCHEDULES).",
               args.results)
    if "timeline" in args.parts:
        rows = timeline_rows(config_dir, args, h2d)
        report(routed_section("hybrid/timeline", args.routing), "Where a hybrid decode layer's time goes", command,
               markdown_table(["experts on GPU", "requests", "tok/s", "step us / layer",
                               *(f"{span} us" for span in TIMELINE_SPANS), "between layers us",
                               "host kernel us / layer", "host alone GB/s before", "host experts / layer",
                               "copied experts / layer", "floor us / layer, whole experts",
                               "floor us / layer, experts divisible", "steps"], rows),
               f"{args.layers} layers, routing {args.routing}, bf16, the mailbox dispatch; device timestamps (%globaltimer, "
               "kernels/timestamps) at seven points of each MoE layer inside the decode graph, means over the timed "
               "steps. The spans follow the GPU's stream: 'wait for host' is how long the GPU stood waiting for "
               "the host's routes after its own experts; the host kernel's time is measured inside its calls. "
               "The floors (split_floors): the layer with its other spans as measured and its misses split at "
               "best between the channels at their bandwidths alone (H2D at start-up, the host kernel's just "
               "before the row), whole experts per channel (the design's) or divisible ones.",
               args.results)
    if "big" in args.parts:
        rows = big_rows(config_dir, args, h2d)
        report("hybrid/big", "Hybrid on the full-depth model", command,
               markdown_table(DECODE_HEADER[:BIG_COLUMNS] + ["pinned host GiB"], rows),
               "The full 48-layer Qwen3-30B-A3B shape at 25% of the experts on the GPU: the host store holds "
               "every expert once (the pinned GiB column), the only copy the host channel and PCIe both read.",
               args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
