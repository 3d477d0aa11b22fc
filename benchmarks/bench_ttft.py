"""TTFT vs prompt length: a dummy
Qwen3-30B-A3B-shaped model, `offload` with the cache at 25% of the experts, demand
thresholds 0 (always stream), 256, 512, 1024, 4096 and auto.

For each threshold and prompt length: one request decodes in the background (the decode
working set); its hit rate is measured over a few steps before the prompt arrives and again
right after the prompt's prefill; TTFT is the wall time from adding the prompt to its first
token (the step also decodes the background request). The floor is the bytes the prefill
must move over the link / measured H2D: every expert for a streamed chunk, the chunk's
missing experts for a demand chunk.

GPU only: without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from benchmarks.common import (MODEL_ROUTING, add_results_flag, add_routing_flag, command_line, force_routing,
                               free_engine_memory,
                               gpu_main, h2d_bandwidth, markdown_table, pivot, report, routed_section, routing_note)
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

LENGTHS = (87, 117, 151, 230, 387, 718, 1324, 4096)
THRESHOLDS = ("0", "256", "512", "1024", "4096", "auto")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--cache-frac", type=float, default=0.25)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--thresholds", nargs="+", default=list(THRESHOLDS))
    p.add_argument("--hit-steps", type=int, default=4)
    add_routing_flag(p, default=MODEL_ROUTING)
    add_results_flag(p)
    return p.parse_args(argv)


def decode_hit_rate(engine, steps: int) -> float:
    """Hit rate of the decode admissions over the next `steps` engine steps."""
    before = engine.runner.strategy.stats()["decode"]["total"]
    for _ in range(steps):
        engine.step()
    after = engine.runner.strategy.stats()["decode"]["total"]
    distinct = after["distinct"] - before["distinct"]
    return 1.0 - (after["misses"] - before["misses"]) / distinct if distinct else 0.0


def prefill_bytes(engine, before) -> int:
    s = engine.runner.strategy.stats()
    copied = (s["prefill"]["total"]["misses"] - before["prefill"]["total"]["misses"]) * s["expert_bytes"]
    return copied + s["prefill_streamed_bytes"] - before["prefill_streamed_bytes"]


def measure(engine, length: int, args, gen) -> tuple[float, float, float, int]:
    from moeferry.sampling import SamplingParams

    vocab = engine.mc.vocab_size
    background = engine.add_request(torch.randint(vocab, (16,), generator=gen).tolist(),
                                    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while background.in_prefill:
        engine.step()
    decode_hit_rate(engine, 4)  # settle the working set
    hit_before = decode_hit_rate(engine, args.hit_steps)
    stats_before = engine.runner.strategy.stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prompt = engine.add_request(torch.randint(vocab, (length,), generator=gen).tolist(),
                                SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while not prompt.output_ids:
        engine.step()
    ttft = time.perf_counter() - t0
    moved = prefill_bytes(engine, stats_before)
    engine.abort(prompt)
    hit_after = decode_hit_rate(engine, args.hit_steps)
    engine.abort(background)
    return ttft, hit_before, hit_after, moved


@gpu_main("bench_ttft", parse_args)
def main(argv, args) -> int:
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    h2d = h2d_bandwidth()
    cfg_dir = write_config_dir(os.path.join(tempfile.mkdtemp(), "qwen3-30b-a3b"), QWEN3_30B_DIR_CONFIG)
    slots = int(args.cache_frac * args.layers * QWEN3_30B_DIR_CONFIG["num_experts"])
    longest = max(args.lengths)
    rows = []
    for threshold in args.thresholds:
        ec = EngineConfig(model=cfg_dir, load_format="dummy", hf_overrides={"num_hidden_layers": args.layers},
                          moe_strategy="offload", moe_cache_slots=slots, moe_collect_stats=True,
                          moe_prefill_demand_tokens=threshold, max_running_requests=4, max_prefill_tokens=longest,
                          max_model_len=longest + 64, num_tokens=2 * (longest + 64) + 4096,
                          enable_prefix_caching=False)  # each threshold runs the same prompts: all would be hits
        engine = Engine(ec)
        if force_routing(engine, args.routing, args.routing_seed) is not None:
            engine.runner.recapture_graphs()  # the decode graphs draw the routes
        for length in args.lengths:
            gen = torch.Generator().manual_seed(length)
            ttft, hit_before, hit_after, moved = measure(engine, length, args, gen)
            floor = moved / h2d
            rows.append([threshold, length, f"{ttft:.3f}", f"{floor:.3f}", f"{moved / 2**30:.2f}",
                         f"{hit_before:.2f}", f"{hit_after:.2f}"])
            print(rows[-1], flush=True)
        del engine
        free_engine_memory()
    groups, thresholds = pivot(rows, key=lambda r: r[1], across=lambda r: r[0])
    last = thresholds[-1]
    header = ["prompt tokens", *(f"TTFT s, threshold {t}" for t in thresholds), f"floor s ({last})",
              f"GiB moved ({last})"]
    table = [[length, *(g[t][2] if t in g else "-" for t in thresholds), g[last][3], g[last][4]]
             for length, g in groups.items()]
    hits = [float(r[i]) for r in rows for i in (5, 6)]
    streamed = max(rows, key=lambda r: float(r[4]))
    notes = (f"{args.layers} layers, 128 experts, top-8, bf16 dummy weights; offload cache {slots} slots "
             f"({args.cache_frac:.0%} of experts); measured H2D {h2d / 1e9:.1f} GB/s. One background request decodes "
             f"throughout; its decode hit rate over {args.hit_steps} steps before and right after each prompt's "
             f"prefill stayed within {min(hits):.2f}-{max(hits):.2f}. Floor: bytes moved / H2D (a streamed chunk "
             f"moves {streamed[4]} GiB, floor {streamed[3]} s). " + routing_note(args.routing, args.routing_seed))
    report(routed_section("ttft", args.routing, MODEL_ROUTING), "TTFT vs prompt length by demand threshold", command_line("benchmarks.bench_ttft", argv),
           markdown_table(header, table), notes, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
