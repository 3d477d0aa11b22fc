"""UVA naive vs sorted block assignment:
output tokens/s at 1, 2, 3, 4, 8 and 16 requests in flight for a dummy Qwen3-30B-A3B-shaped model.

Rows: `uva` with the naive assignment (each (token, expert) route its own block: an expert
routed to several tokens of a step crosses PCIe once per token; only where the rule allows
it, T * top_k * 4 <= E, at the padded CUDA-graph batch T; "n/a" elsewhere), `uva` sorted
(the default rule for host-resident banks: each routed expert crosses once per step), and
`offload` at a 50% cache for comparison. Beside each: the floor, distinct experts read per
step x expert bytes / measured pinned H2D bandwidth, and routes per step x expert bytes /
H2D (what the naive path reads).

Run twice: the dummy router as it is (near-uniform routing) and a skewed router (a fixed
per-expert bias, log of Zipf(s) probabilities in a random per-layer order, added to the
router logits by a forward hook, so a few experts are popular as in real models); with
`--routings qwen3 mixtral` also under generated routes with those models' published locality
(benchmarks/common.force_routing). Each
engine is built once and reused across batch sizes, paths and routings; the decode CUDA
graphs are recaptured whenever the path or the router changes.

GPU only: without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch

from benchmarks.common import (add_results_flag, command_line, force_routing, free_engine_memory, gpu_main,
                               h2d_bandwidth, markdown_table, report, routing_note, timed_decode)
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

ROUTINGS = ("uniform", "skewed")  # the dummy router as is; with a fixed Zipf bias
GENERATED = ("qwen3", "mixtral")  # generated routes with those models' locality (benchmarks/common.force_routing)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48, help="num_hidden_layers (hf_overrides)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16], help="requests in flight")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps before timing")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--routings", nargs="+", choices=[*ROUTINGS, *GENERATED], default=list(ROUTINGS))
    p.add_argument("--routing-seed", type=int, default=0, help="the generated routes' seed")
    p.add_argument("--zipf", type=float, default=1.1, help="exponent s of the skewed router's popularity")
    p.add_argument("--strategies", nargs="+", choices=["uva", "offload"], default=["uva", "offload"])
    p.add_argument("--cache-frac", type=float, default=0.5, help="offload cache, share of all experts")
    p.add_argument("--disable-cuda-graph", action="store_true")
    add_results_flag(p)
    args = p.parse_args(argv)
    if min(args.batch) < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--batch, --steps must be positive and --warmup non-negative")
    return args


# --- engines ------------------------------------------------------------------------------

def make_engine(model_dir: str, args, strategy: str, slots: int | None = None, **options):
    """One engine for every batch size: max_running_requests = the widest batch."""
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    ec = EngineConfig(model=model_dir, load_format="dummy", hf_overrides={"num_hidden_layers": args.layers},
                      moe_strategy=strategy, moe_cache_slots=slots, moe_collect_stats=True,
                      max_running_requests=max(args.batch),
                      max_model_len=args.prompt_len + args.warmup + args.steps + 16,
                      disable_cuda_graph=args.disable_cuda_graph,
                      num_tokens=(args.prompt_len + 64) * max(args.batch) * 2, **options)
    return Engine(ec)


def padded_tokens(engine, batch: int) -> int:
    """Rows the MoE kernels see at `batch` requests: the smallest captured size that fits."""
    graphs = engine.runner.graphs
    if graphs is None or not graphs.can_run(batch):
        return batch
    return next(s for s in graphs.sizes if s >= batch)


def zipf_bias(num_experts: int, s: float, seed: int) -> torch.Tensor:
    """log p[e] with p proportional to rank(e)^-s (ranks 1..E in a seeded random order); sums to 1 in p.

    Added to router logits of about unit spread (dummy: N(0, 0.02) over 2048 inputs, std ~0.9),
    top-k then follows roughly Zipf popularity: top-1 exactly if the logits were unit Gumbel."""
    ranks = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed)) + 1
    p = ranks.double().pow(-s)
    return (p / p.sum()).log().float()


def add_skew(engine, s: float) -> list:
    """Forward hooks on every MoE gate adding a fixed per-layer zipf_bias; returns the handles."""
    handles = []
    model = engine.runner.model
    for layer_id in engine.mc.moe_layer_ids:
        gate = model.moe_block(layer_id).gate
        bias = zipf_bias(engine.mc.num_experts, s, seed=layer_id).to(gate.weight.device, gate.weight.dtype)
        handles.append(gate.register_forward_hook(lambda _m, _i, out, bias=bias: out + bias))
    return handles


def routing_hooks(engine, routing: str, args) -> list:
    """The hooks `routing` needs on `engine`'s routers (removables; none for the router as is)."""
    if routing == "skewed":
        return add_skew(engine, args.zipf)
    if routing in GENERATED:
        return [force_routing(engine, routing, args.routing_seed)]
    return []


# --- measuring ----------------------------------------------------------------------------

def counters(engine) -> dict:
    """Cumulative decode counters, summed over layers: expert reads over PCIe (uva; distinct
    experts for offload), routes (uva only) and misses (offload only)."""
    s = engine.runner.strategy.stats()
    if s["strategy"] == "uva":
        return {"reads": s["expert_reads"], "routes": s["routes"], "misses": 0}
    total = s["decode"]["total"]
    return {"reads": total["distinct"], "routes": 0, "misses": total["misses"]}


def measure(engine, batch: int, args) -> dict:
    """Tokens/s over `steps` decode steps of `batch` requests, with the per-step counters of
    exactly those steps (benchmarks.common.timed_decode)."""
    return timed_decode(engine, batch, args.prompt_len, args.warmup, args.steps, counters)


def run_uva(engine, args, routing: str, stale: bool) -> list[dict]:
    """The engine's path (its --moe-uva-block-assignment) at every batch size; naive only where
    the rule allows it at the padded size. Recaptures first if the graphs are `stale` (router
    hooks added since they were captured)."""
    from moeferry.kernels.fused_moe.triton import naive_allowed

    mc = engine.mc
    if stale:
        engine.runner.recapture_graphs()  # graphs bake in the router hooks
    path = "naive" if engine.ec.moe_uva_block_assignment == "naive" else "sorted"
    records = []
    for b in args.batch:
        rec = {"routing": routing, "strategy": f"uva {path}", "requests": b}
        if path == "naive" and not naive_allowed(padded_tokens(engine, b), mc.top_k, mc.num_experts):
            records.append(rec)  # n/a
            continue
        records.append({**rec, **measure(engine, b, args)})
        print(records[-1], flush=True)
    return records


def run_offload(engine, args, routing: str, stale: bool) -> list[dict]:
    if stale:
        engine.runner.recapture_graphs()  # graphs bake in the router hooks
    records = []
    for b in args.batch:
        records.append({"routing": routing, "strategy": f"offload {int(args.cache_frac * 100)}%", "requests": b,
                        **measure(engine, b, args)})
        print(records[-1], flush=True)
    return records


def run(model_dir: str, args) -> tuple[list[dict], int]:
    """Every record for every strategy and routing, and the bytes of one expert.
    Device-agnostic: on the CPU it runs the same logic through the reference kernels."""
    from moeferry.config import ModelConfig

    mc = ModelConfig.from_dir(model_dir, {"num_hidden_layers": args.layers})
    records, expert_bytes = [], 0
    runs = [(name, assignment) for name in args.strategies
            for assignment in (("auto", "naive") if name == "uva" else (None,))]
    for name, assignment in runs:
        slots = None
        if name == "offload":
            slots = max(mc.num_experts, int(args.cache_frac * len(mc.moe_layer_ids) * mc.num_experts))
        options = {"moe_uva_block_assignment": assignment} if assignment else {}
        engine = make_engine(model_dir, args, name, slots, **options)
        expert_bytes = engine.runner.strategy.expert_bytes
        hooked = False  # the graphs hold router hooks
        for routing in args.routings:
            handles = routing_hooks(engine, routing, args)
            records += (run_uva if name == "uva" else run_offload)(engine, args, routing, hooked or bool(handles))
            for handle in handles:
                handle.remove()
            hooked = bool(handles)
        del engine
        free_engine_memory()
    return records, expert_bytes


# --- the table ----------------------------------------------------------------------------

HEADER = ["strategy", "requests", "tok/s", "ms/step", "distinct experts/step", "floor ms", "vs floor",
          "routes/step", "routes x bytes ms", "offload misses/step", "misses x bytes ms", "sorted vs naive"]


def table_rows(records: list[dict], routing: str, expert_bytes: int, h2d: float) -> list[list]:
    """Rows of one routing. Distinct experts per step come from the sorted run of the same batch
    (on the naive path the counters see one read per route); the floor is distinct x bytes / H2D."""
    order = {"uva naive": 0, "uva sorted": 1}
    mine = sorted((r for r in records if r["routing"] == routing),
                  key=lambda r: (order.get(r["strategy"], 2), r["requests"]))
    distinct = {r["requests"]: r["reads"] for r in mine if r["strategy"] == "uva sorted" and "reads" in r}
    naive = {r["requests"]: r["tok_s"] for r in mine if r["strategy"] == "uva naive" and "tok_s" in r}

    def ms(count):
        return f"{count * expert_bytes / h2d * 1e3:.1f}"

    rows = []
    for r in mine:
        b = r["requests"]
        if "tok_s" not in r:
            rows.append([r["strategy"], b] + ["n/a"] * (len(HEADER) - 2))
            continue
        is_offload = r["strategy"].startswith("offload")
        d = r["reads"] if is_offload else distinct.get(b, math.nan)
        floor = d * expert_bytes / h2d
        routes = r["routes"] if r["routes"] else math.nan
        speedup = f"{r['tok_s'] / naive[b]:.2f}x" if r["strategy"] == "uva sorted" and b in naive else "-"
        rows.append([r["strategy"], b, f"{r['tok_s']:.1f}", f"{r['step_s'] * 1e3:.1f}", f"{d:.0f}", ms(d),
                     f"{r['step_s'] / floor:.2f}x" if floor > 0 else "-",
                     "-" if is_offload else f"{routes:.0f}", "-" if is_offload else ms(routes),
                     f"{r['misses']:.0f}" if is_offload else "-", ms(r["misses"]) if is_offload else "-", speedup])
    return rows


def notes(args, h2d: float, expert_bytes: int, routing: str) -> str:
    router = ("dummy router as is (near-uniform)" if routing == "uniform" else
              f"dummy router + fixed per-expert bias log Zipf(s={args.zipf}) (skewed)" if routing == "skewed" else
              routing_note(routing, args.routing_seed).rstrip("."))
    return (f"{args.layers} layers, 128 experts, top-8, bf16, dummy weights, {router}; prompt {args.prompt_len} "
            f"tokens, {args.warmup} warm-up + {args.steps} timed decode steps per batch size. Expert "
            f"{expert_bytes / 1e6:.2f} MB; measured pinned H2D {h2d / 1e9:.1f} GB/s. Floor = distinct experts read per "
            f"step (measured on the sorted path, all layers, padded graph rows included) x expert bytes / H2D; "
            f"routes x bytes is what the naive path reads (an expert shared by n tokens crosses n times). Naive is "
            f"n/a where T x 8 x 4 > 128 at the padded batch T. Offload: {int(args.cache_frac * 100)}% cache, its own "
            f"distinct experts and misses per step; only misses cross PCIe.")


@gpu_main("bench_uva", parse_args)
def main(argv, args) -> int:
    h2d = h2d_bandwidth()
    free_engine_memory()
    model_dir = write_config_dir(os.path.join(tempfile.mkdtemp(), "qwen3-30b-a3b"), QWEN3_30B_DIR_CONFIG)
    t0 = time.perf_counter()
    records, expert_bytes = run(model_dir, args)
    for routing in args.routings:
        report(f"uva/{routing}", f"UVA naive vs sorted block assignment, {routing} routing",
               command_line("benchmarks.bench_uva", argv),
               markdown_table(HEADER, table_rows(records, routing, expert_bytes, h2d)),
               notes(args, h2d, expert_bytes, routing), args.results)
    print(f"bench_uva: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
