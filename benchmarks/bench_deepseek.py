"""DeepSeek-V3 shapes: decode tokens/s of a dummy model cut to a few layers, and the MLA decode
attention kernel against its floor.

Section deepseek/decode: DeepSeek-V3's config (tests.support.fixtures.DEEPSEEK_V3_DIR_CONFIG:
hidden 7168, 128 heads, MLA rank 512 + rope 64, 256 routed experts of 2048 rows, top-8 of 8
groups, one shared expert) with ``--layers`` layers of which the first ``--dense-layers`` are
dense (--hf-overrides num_hidden_layers, first_k_dense_replace), bf16, dummy weights; ``gpu``
and ``offload`` with ``--cache-fracs`` of the routed experts resident. Each row is the fastest
of ``--repeats`` runs of whole engine steps; the floor and the hit rate are bench_decode's (an
offload row runs again with statistics on). The dummy router routes near-uniformly.

Section deepseek/mla: the Triton MLA decode kernel (128 heads, rank 512, rope 64, bf16, page
16) at ``--mla-batches`` requests and ``--mla-contexts`` tokens, every request at the full
context, pages scattered at random; captured in one CUDA graph over enough input copies that
consecutive calls miss the L2; time per call is the best replay. Floor = the latent bytes a
call must read (B * context * 576 * 2) / 4.3 TB/s of HBM.

GPU only: without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile

import torch

from benchmarks.common import (DECODE_WARMUP_STEPS, MODEL_ROUTING, add_results_flag, add_routing_flag, command_line,
                               force_routing, free_engine_memory, gpu_main, h2d_bandwidth, hbm_bandwidth,
                               markdown_table, report, routed_section, routing_note, set_statistics, timed_decode)
from tests.support.fixtures import DEEPSEEK_V3_DIR_CONFIG, write_config_dir

HEADS, RANK, ROPE, PAGE_SIZE = 128, 512, 64, 16
HBM_BYTES_PER_S = 4.3e12
L2_FLUSH_BYTES = 256 << 20


def add_decode_flags(p, layers: int) -> None:
    """The flags of `decode_rows` (this benchmark's and bench_gpt_oss's decode sections)."""
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--cache-fracs", type=float, nargs="+", default=[0.25, 1.0])
    p.add_argument("--strategies", nargs="+", choices=["gpu", "offload", "hybrid"], default=["gpu", "offload"],
                   help="offload and hybrid run at every --cache-fracs")
    p.add_argument("--quantization", choices=["fp8", "int4", "mxfp4"], default=None,
                   help="the routed experts quantized at load (default bf16)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=DECODE_WARMUP_STEPS,
                   help="decode steps before timing (a slot cache settles from its start-up fill)")
    p.add_argument("--repeats", type=int, default=2)
    add_routing_flag(p, default=MODEL_ROUTING)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", nargs="+", choices=["decode", "mla"], default=["decode", "mla"])
    add_decode_flags(p, layers=5)
    p.add_argument("--dense-layers", type=int, default=1, help="first_k_dense_replace of the cut model")
    p.add_argument("--mla-batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--mla-contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--iters", type=int, default=20, help="MLA calls captured in one graph (at least one per copy)")
    p.add_argument("--with-reference", action="store_true", help="time the torch reference of the MLA kernel too")
    add_results_flag(p)
    args = p.parse_args(argv)
    if args.dense_layers >= args.layers or args.steps < 1:
        p.error("--dense-layers must leave a MoE layer, and --steps must be positive")
    return args


# ---- decode tokens/s -----------------------------------------------------------------------

def make_engine(config_dir: str, args, strategy: str, slots: int | None, device_type: str = "cuda",
                overrides: dict | None = None):
    """A dummy engine of the config cut by `overrides` (default: --layers, --dense-layers)."""
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    overrides = overrides or {"num_hidden_layers": args.layers, "first_k_dense_replace": args.dense_layers}
    context = args.prompt_len + args.warmup + args.steps + 16
    ec = EngineConfig(model=config_dir, load_format="dummy", hf_overrides=overrides, moe_strategy=strategy,
                      moe_cache_slots=slots, moe_collect_stats=False, quantization=args.quantization,
                      max_running_requests=max(args.batch),
                      max_model_len=context, num_tokens=(args.prompt_len + 64) * max(args.batch) * 2,
                      device=device_type)
    engine = Engine(ec)
    if force_routing(engine, args.routing, args.routing_seed) is not None:
        engine.runner.recapture_graphs()  # the decode graphs draw the routes
    return engine


def cache_slots(frac: float, moe_layers: int, experts: int) -> int:
    """Slots for `frac` of the routed experts, never fewer than one layer's (the planner's minimum)."""
    return max(experts, int(frac * moe_layers * experts))


def decode_rows(config_dir: str, cfg: dict, args, h2d: float, hbm: float, device_type: str = "cuda", *,
                overrides: dict | None = None) -> list[list]:
    """The decode section's rows for the model of `config_dir` (its config.json `cfg`), cut by
    `overrides` (make_engine's default: --layers with --dense-layers dense); bench_gpt_oss's
    section too. A hybrid row has no floor or hit rate here (its misses split between two
    channels: bench_hybrid's table has both)."""
    from benchmarks.bench_decode import decode_counters, dense_bytes

    experts = cfg.get("n_routed_experts") or cfg["num_local_experts"]
    moe_layers = args.layers - getattr(args, "dense_layers", 0)
    rows, distinct_per_step = [], {}
    fracs = sorted(args.cache_fracs, reverse=True)
    plans = [(s, f) for s in ("offload", "hybrid") if s in args.strategies for f in fracs]
    plans += [("gpu", None)] if "gpu" in args.strategies else []
    for strategy, frac in plans:
        slots = None if frac is None else cache_slots(frac, moe_layers, experts)
        engine = make_engine(config_dir, args, strategy, slots, device_type, overrides)
        dense, expert_bytes = dense_bytes(engine), engine.runner.strategy.expert_bytes
        for b in args.batch:
            timed = min((timed_decode(engine, b, args.prompt_len, args.warmup, args.steps, lambda e: {})
                         for _ in range(max(1, args.repeats))), key=lambda run: run["step_s"])
            hit, misses = "-", 0.0
            if strategy == "offload":
                set_statistics(engine, True)
                counted = timed_decode(engine, b, args.prompt_len, args.warmup, args.steps, decode_counters)
                set_statistics(engine, False)
                distinct_per_step[b], misses = counted["distinct"], counted["misses"]
                hit = f"{1 - misses / counted['distinct']:.2f}" if counted["distinct"] else "-"
            d = distinct_per_step.get(b) if strategy != "hybrid" else None
            floor = None if d is None else misses * expert_bytes / h2d + ((d - misses) * expert_bytes + dense) / hbm
            label = strategy if frac is None else f"{strategy} {int(frac * 100)}% ({slots} slots)"
            rows.append([label, b, f"{timed['tok_s']:.1f}", f"{timed['step_s'] * 1e3:.2f}",
                         "-" if floor is None else f"{floor * 1e3:.3g}",
                         "-" if floor is None else f"{timed['step_s'] / floor:.2f}x", hit,
                         "-" if d is None else f"{d:.0f}"])
            print(rows[-1], flush=True)
        del engine
        free_engine_memory()
    return rows


# ---- MLA decode attention ------------------------------------------------------------------

def mla_inputs(batch: int, context: int, device: str = "cuda"):
    """q [B, 128, 576], a latent cache of the batch's pages in random order, table, lengths."""
    pages_per_req = -(-context // PAGE_SIZE)
    num_pages = batch * pages_per_req
    cache = torch.randn((num_pages + 1) * PAGE_SIZE, 1, RANK + ROPE, dtype=torch.bfloat16, device=device)
    table = torch.randperm(num_pages, device=device).int().view(batch, pages_per_req)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, RANK + ROPE, dtype=torch.bfloat16, device=device)
    return q, cache, table, seq_lens


def latent_bytes(batch: int, context: int) -> int:
    return batch * context * (RANK + ROPE) * 2


def seconds_per_call(fn, iters: int, repeats: int) -> float:
    from benchmarks.bench_attention import seconds_per_call as timed

    return timed(fn, iters, repeats)


def mla_rows(args) -> list[list]:
    from moeferry.kernels.mla import reference
    from moeferry.kernels.mla import triton as triton_mla

    rows = []
    for batch in args.mla_batches:
        for context in args.mla_contexts:
            nbytes = latent_bytes(batch, context)
            copies = -(-L2_FLUSH_BYTES // nbytes)
            calls = [(*mla_inputs(batch, context), PAGE_SIZE, 192 ** -0.5, RANK) for _ in range(copies)]
            iters = max(args.iters, copies)

            def each_copy(fn):
                turn = itertools.cycle(calls)
                return lambda: fn(*next(turn))

            t = seconds_per_call(each_copy(triton_mla.mla_decode_attention), iters, 5)
            ref = seconds_per_call(each_copy(reference.mla_decode_attention), iters, 3) if args.with_reference else None
            floor = nbytes / HBM_BYTES_PER_S
            config = triton_mla.select_config(batch, HEADS, RANK, context)
            _, splits = triton_mla.launch_shape(batch, HEADS, RANK, context, config, calls[0][0].device)
            rows.append([batch, context, f"{nbytes / 2**20:.1f}", splits, "-" if ref is None else f"{ref * 1e6:.1f}",
                         f"{t * 1e6:.1f}", f"{floor * 1e6:.1f}", f"{floor / t:.0%}"])
            print(rows[-1], flush=True)
            del calls
            torch.cuda.empty_cache()
    return rows


@gpu_main("bench_deepseek", parse_args)
def main(argv, args) -> int:
    command = command_line("benchmarks.bench_deepseek", argv)
    if "decode" in args.sections:
        h2d, hbm = h2d_bandwidth(), hbm_bandwidth()
        cfg_dir = write_config_dir(os.path.join(tempfile.mkdtemp(), "deepseek-v3"), DEEPSEEK_V3_DIR_CONFIG)
        rows = decode_rows(cfg_dir, DEEPSEEK_V3_DIR_CONFIG, args, h2d, hbm)
        header = ["strategy", "requests", "tok/s", "ms/step", "floor ms/step", "vs floor", "hit rate",
                  "distinct experts/step"]
        notes = (f"DeepSeek-V3 shapes cut to {args.layers} layers ({args.dense_layers} dense, "
                 f"{args.layers - args.dense_layers} MoE of 256 experts, 88 MB each in bf16), dummy weights, "
                 f"prompt {args.prompt_len} tokens, {args.warmup} warm-up + {args.steps} timed steps, the fastest of "
                 f"{args.repeats} runs. "
                 f"Measured H2D {h2d / 1e9:.1f} GB/s, HBM {hbm / 1e12:.2f} TB/s. Floor: missed bytes / H2D + "
                 "(resident distinct experts + dense weights) / HBM, with the misses and distinct experts of the "
                 "offload run with statistics (a gpu row takes the distinct experts of the offload rows). "
                 + routing_note(args.routing, args.routing_seed))
        report(routed_section("deepseek/decode", args.routing, MODEL_ROUTING), "DeepSeek-V3-shaped decode tokens/s vs floor", command,
               markdown_table(header, rows), notes, args.results)
    if "mla" in args.sections:
        header = ["B", "context", "latent MiB", "splits", "reference µs", "Triton µs", "floor µs", "% of floor"]
        report("deepseek/mla", "MLA decode attention, DeepSeek-V3 shapes (128 heads, rank 512 + rope 64, bf16, "
               "page 16)", command, markdown_table(header, mla_rows(args)),
               "Every request at the full context, pages scattered at random; time per call in a CUDA graph, the "
               "best replay. Floor: latent bytes read (B x context x 576 x 2) / 4.3 TB/s.", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
