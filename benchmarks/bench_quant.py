"""Decode tokens/s per expert format: `offload` with 25 / 50 / 75 / 100% of
the experts resident, unquantized (bf16) against block FP8, int4 W4A16 and MXFP4
(`--quantization fp8`, `int4`, `mxfp4`), at batch 1 and 4, a dummy Qwen3-30B-A3B-shaped model cut to 12 layers, routing `--routing` (default
uniform, drawn inside the decode graph: the hit rate follows the resident share; qwen3 and
mixtral: generated with those models' published locality, benchmarks/common.force_routing).

Every format runs the same shares of its experts, so the rows of one share hit alike and differ
by the bytes a miss copies and the kernel reads. Beside each row: the hit rate and the PCIe floor
of its misses (missed experts x bytes per expert / measured pinned H2D bandwidth, per step), from
a second run of the row with the admission statistics on. The second table: bytes per expert
(scales included) and the experts `--cache-gb` GiB of slots hold in each format.
GPU only: without CUDA it says so and exits 0 (`run` and `table_rows` work on the CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from benchmarks.common import (DECODE_WARMUP_STEPS, add_results_flag, add_routing_flag, command_line, force_routing, free_engine_memory,
                               gpu_main, h2d_bandwidth, markdown_table, pivot, report, routed_section, routing_note,
                               set_statistics, timed_decode, unforce_routing)
from moeferry.moe.formats import QUANTIZATIONS
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

UNQUANTIZED = "bf16"  # the --formats name of the checkpoint's own dtype (float32 on a CPU run)
HEADER = ["format", "resident", "requests", "tok/s", "vs bf16", "ms/step", "PCIe floor ms/step", "hit rate",
          "slots", "MiB/expert"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0],
                   help="fractions of every expert the slot cache holds")
    p.add_argument("--formats", nargs="+", default=[UNQUANTIZED, *QUANTIZATIONS], choices=[UNQUANTIZED, *QUANTIZATIONS])
    p.add_argument("--cache-gb", type=float, default=8.0, help="the budget of the experts-per-format table")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=DECODE_WARMUP_STEPS,
                   help="untimed decode steps first: the slot cache settles (benchmarks/common.py)")
    p.add_argument("--repeats", type=int, default=2, help="time each row this many times and keep the fastest")
    p.add_argument("--strategy", choices=["offload", "hybrid"], default="offload",
                   help="hybrid: the host computes a measured share of the misses (section quant/hybrid)")
    add_routing_flag(p)
    add_results_flag(p)
    args = p.parse_args(argv)
    if args.steps < 1 or args.layers < 1 or not all(0 < s <= 1 for s in args.shares):
        p.error("--steps and --layers must be positive, --shares in (0, 1]")
    return args


def make_engine(config_dir, args, fmt: str, slots: int):
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    max_len = args.prompt_len + args.warmup + args.steps + 16
    ec = EngineConfig(model=config_dir, load_format="dummy", hf_overrides={"num_hidden_layers": args.layers},
                      moe_strategy=args.strategy, moe_cache_slots=slots, quantization=None if fmt == UNQUANTIZED else fmt,
                      max_running_requests=max(args.batch), max_model_len=max_len,
                      num_tokens=(max_len + 16) * max(args.batch))
    return Engine(ec)


def _misses(engine) -> dict:
    total = engine.runner.strategy.stats()["decode"]["total"]
    return {"distinct": total["distinct"], "misses": total["misses"]}


def run(config_dir: str, args) -> list[dict]:
    """One record per (format, share, batch): tok/s and step time (statistics off, the fastest
    of the repeats), then misses and distinct experts per step (a run with statistics on)."""
    from moeferry.moe.slot_cache import slots_for_gb

    num_experts = _num_experts(config_dir)
    total = args.layers * num_experts
    records = []
    for fmt in args.formats:
        shares = sorted(args.shares, reverse=True)
        engine = make_engine(config_dir, args, fmt, max(num_experts, int(shares[0] * total)))
        forced = force_routing(engine, args.routing, args.routing_seed)
        strategy = engine.runner.strategy
        for share in shares:
            slots = max(num_experts, int(share * total))
            strategy.store.build_cache(slots)
            engine.runner.recapture_graphs()  # the graphs bake in the pool and the routes' draw
            for batch in args.batch:
                runs = [timed_decode(engine, batch, args.prompt_len, args.warmup, args.steps, lambda e: {})
                        for _ in range(max(1, args.repeats))]
                best = min(runs, key=lambda r: r["step_s"])
                set_statistics(engine, True)
                counted = timed_decode(engine, batch, args.prompt_len, args.warmup, args.steps, _misses)
                set_statistics(engine, False)
                records.append({"format": fmt, "described": strategy.format_description(), "share": share,
                                "batch": batch, "tok_s": best["tok_s"], "step_s": best["step_s"],
                                "misses": counted["misses"], "distinct": counted["distinct"], "slots": slots,
                                "expert_bytes": strategy.expert_bytes,
                                "experts_in_budget": slots_for_gb(args.cache_gb, strategy.expert_bytes)})
                print(records[-1], flush=True)
        unforce_routing(forced)
        del engine, strategy
        free_engine_memory()
    return records


def _num_experts(config_dir: str) -> int:
    import json

    with open(os.path.join(config_dir, "config.json")) as f:
        return json.load(f)["num_experts"]


def table_rows(records: list[dict], h2d: float) -> list[list]:
    """The decode table: a row per record, its tok/s against the unquantized row of the same
    share and batch, the PCIe floor of its misses."""
    base = {(r["share"], r["batch"]): r["tok_s"] for r in records if r["format"] == UNQUANTIZED}
    rows = []
    for r in records:
        ref = base.get((r["share"], r["batch"]))
        floor_ms = r["misses"] * r["expert_bytes"] / h2d * 1e3
        hit = 1 - r["misses"] / r["distinct"] if r["distinct"] else 0.0
        rows.append([r["described"], f"{r['share']:.0%}", r["batch"], f"{r['tok_s']:.1f}",
                     f"{r['tok_s'] / ref:.2f}x" if ref else "-", f"{r['step_s'] * 1e3:.2f}", f"{floor_ms:.2f}",
                     f"{hit:.2f}", r["slots"], f"{r['expert_bytes'] / 2**20:.3f}"])
    return rows


def wide_rows(rows: list[list]) -> tuple[list[str], list[list]]:
    """`table_rows` regrouped a row per (format, share): each per-batch cell the batches' values
    joined by " / " (the header says which batches); slots and bytes once."""
    groups, batches = pivot(rows, key=lambda r: (r[0], r[1]), across=lambda r: r[2])
    header = ["format", "resident", *(f"{name} ({' / '.join(map(str, batches))} requests)" for name in HEADER[3:8]),
              *HEADER[8:]]
    wide = []
    for (described, share), by_batch in groups.items():
        cells = [" / ".join(str(by_batch[b][i]) if b in by_batch else "-" for b in batches) for i in range(3, 8)]
        first = next(iter(by_batch.values()))
        wide.append([described, share, *cells, *first[8:]])
    return header, wide


def budget_rows(records: list[dict], cache_gb: float) -> list[list]:
    """Per format: bytes per expert and the experts `cache_gb` GiB of slots hold."""
    seen = {}
    for r in records:
        seen.setdefault(r["format"], [r["described"], r["expert_bytes"], r["experts_in_budget"]])
    return [[d, b, n] for d, b, n in seen.values()]


@gpu_main("bench_quant", parse_args)
def main(argv, args) -> int:
    h2d = h2d_bandwidth()
    cfg_dir = write_config_dir(os.path.join(tempfile.mkdtemp(), "qwen3-30b-a3b"), QWEN3_30B_DIR_CONFIG)
    records = run(cfg_dir, args)
    body = markdown_table(*wide_rows(table_rows(records, h2d)))
    budget = "; ".join(f"{d} {b} ({n})" for d, b, n in budget_rows(records, args.cache_gb))
    notes = (f"{args.strategy}, {args.layers} layers of Qwen3-30B-A3B ({QWEN3_30B_DIR_CONFIG['num_experts']} experts, top-8), "
             f"dummy weights (fp8, int4, mxfp4: drawn in bf16, then quantized at load); "
             f"prompt {args.prompt_len} tokens, {args.steps} timed steps, the fastest of {args.repeats} runs, "
             f"statistics off. 'vs bf16': tok/s over the bf16 row of the same share and batch. Hit rate and PCIe "
             f"floor (misses x bytes/expert / {h2d / 1e9:.1f} GB/s measured H2D, per step; under hybrid the misses "
             f"copied, not those the host computed) from a second run with statistics on. Target: fp8 >= 1.8x and int4 >= 3x bf16 below 100%, no slower at 100% "
             f"(mxfp4 moves int4's bytes per expert). Bytes per expert (experts in {args.cache_gb:g} GiB): {budget}. "
             + routing_note(args.routing, args.routing_seed))
    hybrid = args.strategy == "hybrid"
    report(routed_section("quant/hybrid" if hybrid else "quant", args.routing), "Decode tokens/s per expert format" + (", hybrid" if hybrid else "")
           + f", routing {args.routing}",
           command_line("benchmarks.bench_quant", argv), body, notes, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
