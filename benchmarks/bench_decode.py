"""Decode tokens/s: `gpu`, `offload` at several cache sizes, `uva`, for a
dummy Qwen3-30B-A3B-shaped model, with the floor of each step beside it.

Floor per step = bytes of missed experts / measured pinned H2D bandwidth
               + (bytes of the distinct experts the step reads + dense weights) / measured HBM bandwidth
(dense weights: every parameter but an untied input embedding, of which a step reads a row per token).
Routing (--routing): the dummy router as it is by default (near-uniform, so the hit rate
follows the cache fraction: the machinery, not the policy), or a generated profile
(benchmarks/common.force_routing: uniform, qwen3, mixtral), the same routes for every strategy. Every configuration decodes the same prompts from
the same weights; the whole engine step is timed (scheduler, graph replay, sampling), with
the admission statistics off as the engine's default has them; each offload row runs again
with them on for its hit rate (and, with --compare-pdl, each row again without programmatic
dependent launch).

GPU only: without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from benchmarks.common import (DECODE_WARMUP_STEPS, MODEL_ROUTING, add_results_flag, add_routing_flag, command_line, force_routing,
                               free_engine_memory, gpu_main, h2d_bandwidth, hbm_bandwidth, markdown_table, report,
                               routed_section, routing_note, set_statistics, timed_decode)
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--cache-fracs", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    p.add_argument("--strategies", nargs="+", default=["gpu", "offload", "uva"])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=DECODE_WARMUP_STEPS,
                   help="untimed decode steps first: the slot cache settles (benchmarks/common.py)")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--policies", nargs="+", default=["layer_lru"], help="slot cache policies to run offload with")
    p.add_argument("--repeats", type=int, default=2,
                   help="time each row this many times and keep the fastest (runs of one engine spread by a "
                        "few percent)")
    p.add_argument("--compare-pdl", action="store_true",
                   help="time each row again without programmatic dependent launch (MOEFERRY_PDL=0)")
    add_routing_flag(p, default=MODEL_ROUTING)
    add_results_flag(p)
    return p.parse_args(argv)


def make_engine(config_dir, args, strategy, slots=None, policy="lru"):
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    ec = EngineConfig(model=config_dir, load_format="dummy", hf_overrides={"num_hidden_layers": args.layers},
                      moe_strategy=strategy, moe_cache_slots=slots, moe_collect_stats=False, moe_cache_policy=policy,
                      max_running_requests=max(args.batch), max_model_len=args.prompt_len + args.warmup + args.steps + 16,
                      disable_cuda_graph=args.disable_cuda_graph, num_tokens=(args.prompt_len + 64) * max(args.batch) * 2)
    engine = Engine(ec)
    if force_routing(engine, args.routing, args.routing_seed) is not None:
        engine.runner.recapture_graphs()  # the graphs draw the routes
    return engine


def fastest(engine, args, batch: int) -> dict:
    """timed_decode of `batch` requests, `args.repeats` times: the run with the shortest step."""
    runs = [timed_decode(engine, batch, args.prompt_len, args.warmup, args.steps, lambda e: {})
            for _ in range(max(1, args.repeats))]
    return min(runs, key=lambda run: run["step_s"])


def set_pdl(engine, on: bool) -> None:
    """Programmatic dependent launch on or off for every kernel, the decode graphs recaptured."""
    from moeferry.kernels import triton_common as common

    common.set_pdl(on)
    engine.runner.recapture_graphs()


def decode_counters(engine) -> dict:
    s = engine.runner.strategy.stats()
    if "decode" not in s:
        return {"distinct": 0, "misses": 0}
    return {k: s["decode"]["total"][k] for k in ("distinct", "misses")}


def dense_bytes(engine) -> int:
    """Bytes a decode step reads from the dense weights: every parameter (parameters() counts a
    tied embedding once) but an untied input embedding, of which a step reads a few rows."""
    model = engine.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.tie_word_embeddings:
        embed = model.model.embed_tokens.weight
        total -= embed.numel() * embed.element_size()
    return total


@gpu_main("bench_decode", parse_args)
def main(argv, args) -> int:
    h2d, hbm = h2d_bandwidth(), hbm_bandwidth()
    cfg_dir = write_config_dir(os.path.join(tempfile.mkdtemp(), "qwen3-30b-a3b"), QWEN3_30B_DIR_CONFIG)
    rows, distinct_per_step = [], {}
    experts_total = args.layers * QWEN3_30B_DIR_CONFIG["num_experts"]
    order = [s for s in ("offload", "gpu", "uva") if s in args.strategies]
    for strategy in order:
        configs = ([(f, pol) for f in sorted(args.cache_fracs, reverse=True) for pol in args.policies]
                   if strategy == "offload" else [(None, None)])
        engine = None
        for frac, policy in configs:
            slots = None if frac is None else max(QWEN3_30B_DIR_CONFIG["num_experts"], int(frac * experts_total))
            if engine is None:
                engine = make_engine(cfg_dir, args, strategy, slots, policy or "layer_lru")
            elif slots is not None:
                engine.runner.strategy.store.build_cache(slots, policy)
                engine.runner.recapture_graphs()
            ebytes = QWEN3_30B_DIR_CONFIG["moe_intermediate_size"] * QWEN3_30B_DIR_CONFIG["hidden_size"] * 3 * 2
            dbytes = dense_bytes(engine)
            timed = {b: fastest(engine, args, b) for b in args.batch}
            without_pdl = {}
            if args.compare_pdl:
                set_pdl(engine, False)
                without_pdl = {b: fastest(engine, args, b) for b in args.batch}
                set_pdl(engine, True)
            counted = {}
            if strategy == "offload":  # again with statistics: the hit rate, and what counting costs
                set_statistics(engine, True)
                counted = {b: timed_decode(engine, b, args.prompt_len, args.warmup, args.steps, decode_counters)
                           for b in args.batch}
                set_statistics(engine, False)
            for b in args.batch:
                rate, step_s = timed[b]["tok_s"], timed[b]["step_s"]
                distinct, misses = (counted[b]["distinct"], counted[b]["misses"]) if counted else (0.0, 0.0)
                if strategy == "offload":
                    distinct_per_step[b] = distinct
                d = distinct_per_step.get(b, 0.0)
                m = misses if strategy == "offload" else (d if strategy == "uva" else 0.0)
                floor = m * ebytes / h2d + ((d - m if strategy == "offload" else (0 if strategy == "uva" else d)) * ebytes
                                           + dbytes) / hbm
                hit = f"{1 - misses / distinct:.2f}" if strategy == "offload" and distinct else "-"
                label = strategy if frac is None else f"offload {int(frac * 100)}% {policy}"
                with_stats = f"{counted[b]['tok_s']:.1f}" if counted else "-"
                no_pdl = f"{without_pdl[b]['tok_s']:.1f}" if without_pdl else "-"
                # the floor counts the statistics run's misses: that run's step is the one to set against it
                floored_step_s = counted[b]["step_s"] if counted else step_s
                known = b in distinct_per_step  # gpu and uva take the distinct experts from an offload run
                rows.append([label, b, f"{rate:.1f}", no_pdl, with_stats, f"{step_s * 1e3:.2f}",
                             f"{floor * 1e3:.2f}" if known else "-",
                             f"{floored_step_s / floor:.2f}x" if known else "-", hit, f"{d:.0f}" if known else "-"])
                print(rows[-1], flush=True)
        del engine
        free_engine_memory()
    header = ["strategy", "requests", "tok/s", "tok/s without PDL", "tok/s with statistics", "ms/step", "floor ms/step", "vs floor", "hit rate", "distinct experts/step"]
    notes = (f"{args.layers} layers, {QWEN3_30B_DIR_CONFIG['num_experts']} experts, top-8, bf16, dummy weights; prompt {args.prompt_len} tokens, "
             f"{args.steps} timed steps, the fastest of {args.repeats} runs. Measured H2D {h2d / 1e9:.1f} GB/s, HBM {hbm / 1e12:.2f} TB/s "
             f"(device copy, read + write bytes). Floor: missed bytes / H2D + (resident distinct experts + dense weights) / HBM; "
             f"for uva every distinct expert crosses PCIe. Distinct experts per step are measured in the offload runs "
             f"(same prompts, same weights, greedy). tok/s and ms/step with statistics off (the engine's default); "
             f"the hit rate and distinct experts come from a second run of each offload row with --moe-collect-stats, "
             f"whose tok/s is the column 'tok/s with statistics'; 'vs floor' of an offload row is that run's step over the floor of its "
             f"own misses (a faster run without statistics may have missed less). gpu and uva rows have a floor only "
             f"when offload ran in the same call. 'without PDL': the same row timed again with programmatic "
             f"dependent launch off (--compare-pdl; '-' when not asked for). "
             + routing_note(args.routing, args.routing_seed))
    report(routed_section("decode", args.routing, MODEL_ROUTING), f"Decode tokens/s vs floor, routing {args.routing}", command_line("benchmarks.bench_decode", argv),
           markdown_table(header, rows), notes, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
