"""Which event turns offload's slow start-up decode graph fast? One offload engine (cache of every
expert, 1 request); the start-up 1-request graph is timed alone (back-to-back replays, no host
work) after each event in turn: none (before any prefill), a timed decode run (prefill and
replays), gc + empty_cache, an eager decode forward on the current stream, another timed run,
an eager decode forward on a side stream (as a capture's warm-up runs it), a recapture.
  python3 scripts/probe_startup_graph.py [--layers 48] [--strategy offload|gpu]"""
import argparse
import gc
import os
import tempfile

import torch

from benchmarks import bench_decode
from benchmarks.common import QWEN3_30B_DIR_CONFIG, replay_us, timed_decode, write_config_dir


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--strategy", choices=["offload", "gpu"], default="offload")
    args = p.parse_args()
    bench_args = bench_decode.parse_args(["--layers", str(args.layers), "--batch", "1"])
    cfg = write_config_dir(os.path.join(tempfile.mkdtemp(), "m"), QWEN3_30B_DIR_CONFIG)
    experts = args.layers * QWEN3_30B_DIR_CONFIG["num_experts"]
    offload = args.strategy == "offload"
    engine = bench_decode.make_engine(cfg, bench_args, args.strategy, experts if offload else None, "layer_lru")
    runner = engine.runner
    start_up = runner.graphs

    def eager_decode():
        with torch.inference_mode():
            runner.model(start_up.batches[1], runner.kv)

    def on_side_stream():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager_decode()
        torch.cuda.current_stream().wait_stream(side)

    events = [
        ("nothing (no prefill yet)", lambda: None),
        ("a timed decode run", lambda: timed_decode(engine, 1, 32, 4, 24, lambda e: {})),
        ("gc + empty_cache", lambda: (gc.collect(), torch.cuda.empty_cache())),
        ("eager decode forward", eager_decode),
        ("another timed run", lambda: timed_decode(engine, 1, 32, 4, 24, lambda e: {})),
        ("eager forward, side stream", on_side_stream),
        ("another timed run", lambda: timed_decode(engine, 1, 32, 4, 24, lambda e: {})),
        ("recapture (start-up graph kept)", runner.recapture_graphs),
    ]
    for name, event in events:
        event()
        torch.cuda.synchronize()
        times = [replay_us(start_up.graphs[1]) for _ in range(3)]
        print(f"after {name:<32} start-up graph {min(times):6.0f} us (of {', '.join(f'{t:.0f}' for t in times)})",
              flush=True)
    print(f"the recaptured graph {min(replay_us(runner.graphs.graphs[1]) for _ in range(3)):6.0f} us", flush=True)


if __name__ == "__main__":
    main()
