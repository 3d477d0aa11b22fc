"""Expert-cache policies on a trained model's routing, and the routing simulator against the
engine: the built-in model (moeferry-tiny-moe, trained on Austen: 6 MoE layers x 32 experts,
top-4) serves a fixed workload, and every cache size and policy is both simulated from the
recorded trace and measured on the offload engine.

Workload: `--requests` requests, each prompt the first words of a held-out paragraph
(tests/data/austen_heldout.txt: text the model never trained on), sampled as the model's
generation_config.json says (temperature 0.7, top_p 0.9), request i seeded with i, `--max-tokens`
each, `--concurrency` running at a time (continuous batching, the rest queued).

1. record: the workload under `gpu` with --moe-record-routing: the trace, and its decode steps'
   times (every expert resident: compute alone).
2. simulate: the trace replayed through the slot cache's reference admission
   (routing/simulate.py) at each cache fraction and policy: decode hit rate, bytes copied, and
   the predicted decode tok/s = decode tokens / (gpu decode time + missed bytes / pinned H2D
   bandwidth measured here).
3. measure: the same workload under `offload` at each size and policy, also recorded, with
   --moe-collect-stats; after graph capture the cache restarts from its warm start
   (MoEStrategy.restart_cache), the state the simulation starts from. Measured: the
   engine's decode hit rate and its decode tok/s (decode tokens over the recorded decode
   steps' times). "same routes": the offload run's trace holds exactly the gpu trace's ids
   (same tokens, so same routing): then simulated and measured hit rates must be equal.

GPU only: without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

import numpy as np

from benchmarks.common import add_results_flag, command_line, free_engine_memory, gpu_main, markdown_table, report

POLICIES = ("lru", "lrfu", "layer_lru")
HELD_OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "austen_heldout.txt"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="requests running at a time")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompt-words", type=int, default=12, help="words of each held-out paragraph in its prompt")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75], help="cache, share of all experts")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    add_results_flag(p)
    return p.parse_args(argv)


def prompts(n: int, words: int) -> list[str]:
    """The first `words` words of the first `n` held-out paragraphs of at least 2 x `words` words."""
    paragraphs = [p for p in HELD_OUT.read_text().splitlines() if len(p.split()) >= 2 * words]
    return [" ".join(p.split()[:words]) for p in paragraphs[:n]]


def run_workload(strategy: str, concurrency: int, args, trace: str, slots: int | None = None, policy: str = "lru"):
    """The workload on one engine; returns (the engine's MoE statistics, output tokens)."""
    from moeferry.config import EngineConfig
    from moeferry.default_model import DEFAULT_MODEL_NAME
    from moeferry.engine.engine import Engine
    from moeferry.sampling import SamplingParams

    options = dict(moe_cache_slots=slots, moe_cache_policy=policy, moe_collect_stats=True) if slots else {}
    engine = Engine(EngineConfig(model=DEFAULT_MODEL_NAME, moe_strategy=strategy, max_running_requests=concurrency,
                                 moe_record_routing=trace, **options))
    if slots:
        engine.runner.strategy.restart_cache()
    texts = prompts(args.requests, args.prompt_words)
    for i, text in enumerate(texts):
        engine.add_request(text, SamplingParams(temperature=0.7, top_p=0.9, seed=i, max_tokens=args.max_tokens,
                                                ignore_eos=True))
    while engine.has_work:
        engine.step()
    stats = engine.runner.strategy.stats()
    engine.runner.recorder.close()
    del engine
    free_engine_memory()
    return stats


def same_routes(a, b) -> bool:
    steps_a, steps_b = a.steps, b.steps
    return len(steps_a) == len(steps_b) and all(
        x.phase == y.phase and np.array_equal(x.ids, y.ids) for x, y in zip(steps_a, steps_b))


def measure_concurrency(concurrency: int, args, work: str, bandwidth: float) -> list[list]:
    from moeferry.routing.simulate import simulate
    from moeferry.routing.trace import RoutingTrace

    gpu_trace_path = os.path.join(work, f"gpu-{concurrency}.trace")
    run_workload("gpu", concurrency, args, gpu_trace_path)
    trace = RoutingTrace.read(gpu_trace_path)
    total = trace.header.num_moe_layers * trace.header.num_experts
    rows = []
    for fraction in args.fractions:
        slots = int(fraction * total)
        for policy in args.policies:
            sim = simulate(trace, slots, policy)
            path = os.path.join(work, f"offload-{concurrency}-{slots}-{policy}.trace")
            stats = run_workload("offload", concurrency, args, path, slots, policy)
            measured = RoutingTrace.read(path)
            decode = stats["decode"]["total"]
            measured_hit = 1.0 - decode["misses"] / decode["distinct"]
            measured_s = sum(s.step_ms for s in measured.steps if s.phase == "decode") / 1e3
            rows.append([concurrency, f"{100 * fraction:.0f}% ({slots})", policy, f"{sim.hit_rate('decode'):.3f}",
                         f"{measured_hit:.3f}", f"{abs(sim.hit_rate('decode') - measured_hit):.3f}",
                         "yes" if same_routes(trace, measured) else "no",
                         f"{sim.decode_bytes / sim.decode_tokens / 1e3:.1f}",
                         f"{sim.predicted_tok_s(bandwidth, sim.decode_ms / 1e3):.0f}",
                         f"{sim.decode_tokens / measured_s:.0f}", f"{sim.decode_tokens / (sim.decode_ms / 1e3):.0f}"])
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


@gpu_main("bench_routing", parse_args)
def main(argv, args) -> int:
    from moeferry.routing.simulate import measure_h2d

    bandwidth = measure_h2d()
    with tempfile.TemporaryDirectory() as work:
        rows = [row for c in args.concurrency for row in measure_concurrency(c, args, work, bandwidth)]
    header = ["requests at a time", "cache (slots)", "policy", "simulated decode hit", "measured decode hit", "|diff|",
              "same routes", "KB copied / decode token", "predicted decode tok/s", "measured decode tok/s",
              "gpu decode tok/s"]
    notes = (f"Routing: the trained built-in model (moeferry-tiny-moe) on {args.requests} held-out Austen prompts, "
             f"sampled (temperature 0.7, top_p 0.9, seeded), {args.max_tokens} tokens each. Simulated: the gpu run's "
             f"trace through the reference admission; measured: the offload engine's own statistics. Predicted "
             f"tok/s: the gpu run's decode time + missed bytes / {bandwidth / 1e9:.1f} GB/s (pinned H2D measured "
             f"here). An expert of this model is 48 KiB, so copies are a small part of its step time; the "
             f"figures that carry over to large models are the hit rates.")
    report("routing", "Cache policies on trained routing; the simulator against the engine",
           command_line("benchmarks.bench_routing", argv), markdown_table(header, rows), notes, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
