"""Is offload's slower first configuration in bench_decode a matter of the configuration or of the
time since the engine was built? One offload engine (48 layers, cache of every expert), 1
request: timed runs one after another; then (--steps) the decode graphs recaptured, the cache
rebuilt at the same size, at 50%, at 100% again; each run printed with the seconds since the
engine was built.
--recapture-at-start recaptures once before any forward (no prefill has run then, as at start-
up); --strategy gpu asks the same of the `gpu` strategy (cache steps skipped).
  python3 scripts/probe_first_config.py [--runs 8] [--steps recapture same 50 100]
                                        [--recapture-at-start] [--strategy gpu|offload] [--layers 48]"""
import argparse
import os
import tempfile
import time

from benchmarks import bench_decode
from benchmarks.common import QWEN3_30B_DIR_CONFIG, timed_decode, write_config_dir


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--steps", nargs="+", default=["50", "100"], choices=["recapture", "same", "50", "100"])
    p.add_argument("--recapture-at-start", action="store_true")
    p.add_argument("--strategy", choices=["offload", "gpu"], default="offload")
    p.add_argument("--layers", type=int, default=48)
    args = p.parse_args()
    bench_args = bench_decode.parse_args(["--layers", str(args.layers), "--batch", "1"])
    cfg = write_config_dir(os.path.join(tempfile.mkdtemp(), "m"), QWEN3_30B_DIR_CONFIG)
    experts = args.layers * QWEN3_30B_DIR_CONFIG["num_experts"]
    offload = args.strategy == "offload"
    engine = bench_decode.make_engine(cfg, bench_args, args.strategy, experts if offload else None, "layer_lru")
    if args.recapture_at_start:
        engine.runner.recapture_graphs()
    t0 = time.time()
    labels = {"recapture": "recaptured", "same": "rebuilt 100%", "50": "50%", "100": "100% again"}
    steps = args.steps if offload else [s for s in args.steps if s == "recapture"]
    for step in ["first"] + steps:
        label = labels.get(step, "start-up" + (", recaptured" if args.recapture_at_start else ""))
        if step in ("same", "50", "100"):
            engine.runner.strategy.build_cache(max(experts // 2, QWEN3_30B_DIR_CONFIG["num_experts"]) if step == "50" else experts,
                                              "layer_lru")
        if step != "first":
            engine.runner.recapture_graphs()
        for i in range(args.runs):
            run = timed_decode(engine, 1, 32, 4, 24, lambda e: {})
            print(f"{time.time() - t0:7.1f} s  {label:<11} run {i}: {run['tok_s']:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
