"""Is offload's slower first configuration in bench_decode a matter of the configuration or of the
time since the engine was built? One offload engine (48 layers, cache of every expert), 1
request: timed runs one after another; then (--steps) the decode graphs recaptured, the cache
rebuilt at the same size, at 50%, at 100% again; each run printed with the seconds since the
engine was built.
  python3 scripts/probe_first_config.py [--runs 8] [--steps recapture same 50 100]"""
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
    args = p.parse_args()
    bench_args = bench_decode.parse_args(["--layers", "48", "--batch", "1"])
    cfg = write_config_dir(os.path.join(tempfile.mkdtemp(), "m"), QWEN3_30B_DIR_CONFIG)
    experts = 48 * QWEN3_30B_DIR_CONFIG["num_experts"]
    engine = bench_decode.make_engine(cfg, bench_args, "offload", experts, "layer_lru")
    t0 = time.time()
    labels = {"recapture": "recaptured", "same": "rebuilt 100%", "50": "50%", "100": "100% again"}
    for step in ["first"] + args.steps:
        label = labels.get(step, "100%")
        if step in ("same", "50", "100"):
            engine.runner.strategy.build_cache(experts // 2 if step == "50" else experts, "layer_lru")
        if step != "first":
            engine.runner.recapture_graphs()
        for i in range(args.runs):
            run = timed_decode(engine, 1, 32, 4, 24, lambda e: {})
            print(f"{time.time() - t0:7.1f} s  {label:<11} run {i}: {run['tok_s']:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
