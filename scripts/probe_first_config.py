"""Was offload's slower first configuration in bench_decode a matter of the configuration or of
the time since the engine was built? (Neither: of the start-up graphs, which
scripts/probe_startup_graph.py traced to the SMs' shared-memory split; RESULTS.md seventh
session.) One offload engine (48 layers, cache of every expert), 1
request: timed runs one after another; then (--steps) the decode graphs recaptured, the cache
rebuilt at the same size, at 50%, at 100% again; each run printed with the seconds since the
engine was built.
--recapture-at-start recaptures once before any forward (no prefill has run then, as at start-
up); --strategy gpu asks the same of the `gpu` strategy (cache steps skipped). --profile times
the 1-request decode graph alone after each step's runs (back-to-back replays, no host work)
and prints, per kernel name, where its device time moved against the start-up graph.
  python3 scripts/probe_first_config.py [--runs 8] [--steps recapture same 50 100]
                                        [--recapture-at-start] [--strategy gpu|offload] [--layers 48]
                                        [--profile]"""
import argparse
import time

from benchmarks import bench_decode
from benchmarks.common import kernel_profile, replay_us, timed_decode
from moeferry.testing.fixtures import QWEN3_30B_DIR_CONFIG


def profile_graph(engine, label: str) -> dict[str, float]:
    """The 1-request decode graph's device time per replay, printed; its kernels' times."""
    graph = engine.runner.graphs.graphs[1]
    per_name, busy, span = kernel_profile(graph.replay)
    print(f"        {label:<11} graph replay {replay_us(graph):.0f} us back to back; profiled: busy {busy:.0f} us, "
          f"span {span:.0f} us, {len(per_name)} kernel names", flush=True)
    return per_name


def print_moves(base: dict[str, float], other: dict[str, float], label: str, rows: int = 12) -> None:
    """The kernel names whose device time per replay moved most from `base` to `other`."""
    names = sorted(set(base) | set(other), key=lambda n: -abs(other.get(n, 0.0) - base.get(n, 0.0)))
    print(f"kernel time per replay, start-up -> {label} (us):")
    for name in names[:rows]:
        a, b = base.get(name, 0.0), other.get(name, 0.0)
        print(f"  {a:8.1f} -> {b:8.1f}  ({b - a:+7.1f})  {name[:90]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--steps", nargs="+", default=["50", "100"], choices=["recapture", "same", "50", "100"])
    p.add_argument("--recapture-at-start", action="store_true")
    p.add_argument("--strategy", choices=["offload", "gpu"], default="offload")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    offload = args.strategy == "offload"
    engine, experts = bench_decode.probe_engine(args.strategy, args.layers)
    if args.recapture_at_start:
        engine.runner.recapture_graphs()
    t0 = time.time()
    labels = {"recapture": "recaptured", "same": "rebuilt 100%", "50": "50%", "100": "100% again"}
    steps = args.steps if offload else [s for s in args.steps if s == "recapture"]
    profiles: dict[str, dict[str, float]] = {}
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
        if args.profile:
            profiles[label] = profile_graph(engine, label)
    first, *later = profiles or [None]
    for label in later:
        print_moves(profiles[first], profiles[label], label)


if __name__ == "__main__":
    main()
