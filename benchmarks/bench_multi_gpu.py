"""Decode tokens/s on one GPU and on two (--tensor-parallel-size 2: the dense part replicated,
each GPU holding half of every layer's routed experts behind its own slot cache), for a dummy
Qwen3-30B-A3B-shaped model under `offload`.

A share is the part of each rank's experts its slot cache holds: of the whole model on one
GPU, of its half on two, so the same part of the model is resident either way and each of two
GPUs spends half the slot memory of one. Routes are generated (--routing: uniform, the worst
case for a cache; qwen3, calibrated to Qwen3's published locality), the same on every rank;
every configuration decodes the same prompts, and the whole engine step is timed (scheduler,
graph replay with the ranks' all-reduce inside, sampling).

GPU only: without CUDA it says so and exits 0; two GPUs are needed for the second column.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from benchmarks.common import (add_results_flag, add_routing_flag, command_line, force_routing, free_engine_memory,
                               gpu_main, markdown_table, pivot, report, routed_section, routing_note, timed_decode)
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    add_routing_flag(p, default="uniform")
    add_results_flag(p)
    return p.parse_args(argv)


def _force(engine, routing: str, seed: int) -> None:
    """On every rank: the generated routes, drawn inside the decode graphs recaptured after."""
    force_routing(engine, routing, seed)
    engine.runner.recapture_graphs()


def rank_slots(layers: int, experts: int, gpus: int, share: float) -> int:
    """Slots holding `share` of a rank's experts (at least one layer's share)."""
    per_rank = experts // gpus
    return max(per_rank, int(round(share * layers * per_rank)))


def make_engine(config_dir, args, gpus: int, share: float):
    from moeferry.config import EngineConfig
    from moeferry.engine.ranks import create_engine

    ec = EngineConfig(model=config_dir, load_format="dummy", hf_overrides={"num_hidden_layers": args.layers},
                      moe_strategy="offload", tensor_parallel_size=gpus,
                      moe_cache_slots=rank_slots(args.layers, QWEN3_30B_DIR_CONFIG["num_experts"], gpus, share),
                      max_running_requests=max(args.batch),
                      max_model_len=args.prompt_len + args.warmup + args.steps + 16,
                      num_tokens=(args.prompt_len + 64) * max(args.batch) * 2)
    engine = create_engine(ec)
    if gpus > 1:
        engine.run_on_every_rank(_force, args.routing, args.routing_seed)
    else:
        _force(engine, args.routing, args.routing_seed)
    return engine


@gpu_main("bench_multi_gpu", parse_args)
def main(argv, args) -> int:
    if max(args.gpus) > torch.cuda.device_count():
        print(f"bench_multi_gpu: --gpus {max(args.gpus)} asked for, torch sees {torch.cuda.device_count()} GPU(s); "
              f"nothing measured.")
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config_dir = write_config_dir(os.path.join(tmp, "qwen3-30b"), QWEN3_30B_DIR_CONFIG)
        for gpus in args.gpus:
            for share in args.shares:
                engine = make_engine(config_dir, args, gpus, share)
                try:
                    for batch in args.batch:
                        run = timed_decode(engine, batch, args.prompt_len, args.warmup, args.steps, lambda e: {})
                        rows.append([f"{share:.0%}", batch, f"{gpus} GPU", f"{run['tok_s']:.1f}"])
                        print(rows[-1], flush=True)
                finally:
                    engine.close()
                    del engine
                    free_engine_memory()
    table, columns = pivot(rows, key=lambda r: (r[0], r[1]), across=lambda r: r[2])
    body = markdown_table(["share", "batch", *(f"{c} tok/s" for c in columns)],
                          [[*key, *(cells[c][3] if c in cells else "-" for c in columns)]
                           for key, cells in table.items()])
    report(routed_section("multi_gpu", args.routing), "Decode tokens/s on one and two GPUs (experts split)",
           command_line("benchmarks.bench_multi_gpu", argv), body,
           notes=f"{torch.cuda.get_device_name()}; {args.layers} layers. {routing_note(args.routing, args.routing_seed)}",
           results=args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
