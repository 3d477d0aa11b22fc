"""Where a decode graph's time goes between kernels: for `gpu` and `offload` (cache of every
expert) and offload with one of its two nodes per layer taken out, the host time of one
`graph.replay()`, the wall time of one replay from idle to done, and the GPU time per replay
when replays run back to back. Ablated graphs compute wrong values: timing only.
Then graphs of N empty Triton kernels taking a device pointer or a pinned host pointer.
  python3 scripts/probe_graph_launch.py [--layers 12] [--variants gpu offload no-gather ...]"""
import argparse
import os
import statistics
import tempfile
import time

import torch
import triton
import triton.language as tl

from benchmarks.common import free_engine_memory, replay_us
from moeferry.config import EngineConfig
from moeferry.engine.cuda_graph import capture
from moeferry.engine.engine import Engine
from moeferry.sampling import SamplingParams
from moeferry.testing.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

VARIANTS = ("gpu", "offload", "no-gather", "gather-1-program", "gather-1-per-SM", "no-admission", "neither")


def replay_times(graph: torch.cuda.CUDAGraph, repeats: int = 20) -> tuple[float, float, float]:
    """(median host us of replay(), median idle-to-done wall us, back-to-back GPU us per replay)."""
    host, wall = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e6)
        wall.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(host), statistics.median(wall), replay_us(graph, repeats)


def ablate(strategy, variant: str) -> None:
    """Take out or shrink one offload node per layer. Module-level changes are undone by
    `restore_modules` before the next variant."""
    from moeferry.kernels.triton import gather_copy

    cache = strategy.cache
    if variant in ("no-gather", "neither"):
        cache.copy_misses = lambda host_banks, slot_banks: None
    if variant == "gather-1-program":
        gather_copy._num_programs = lambda work_items, device: 1
    if variant == "gather-1-per-SM":
        gather_copy._PROGRAMS_PER_SM = 1
    if variant in ("no-admission", "neither"):
        cache.admit = lambda layer, topk_ids, phase="decode": topk_ids.to(torch.int32)


def restore_modules(saved: dict) -> None:
    from moeferry.kernels.triton import gather_copy

    for name, value in saved.items():
        setattr(gather_copy, name, value)


def engine_row(variant: str, layers: int) -> list[str]:
    cfg = write_config_dir(os.path.join(tempfile.mkdtemp(), "m"), QWEN3_30B_DIR_CONFIG)
    engine = Engine(EngineConfig(model=cfg, load_format="dummy", hf_overrides={"num_hidden_layers": layers},
                                 moe_strategy="gpu" if variant == "gpu" else "offload", max_running_requests=1,
                                 max_model_len=256, num_tokens=4096))
    engine.add_request(list(range(1, 33)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    runner = engine.runner
    if variant not in ("gpu", "offload"):
        ablate(runner.strategy, variant)
        runner.recapture_graphs()
    host, wall, back_to_back = replay_times(runner.graphs.graphs[1])
    return [variant, f"{host:.0f}", f"{wall:.0f}", f"{back_to_back:.0f}"]


@triton.jit
def _empty_kernel(ptr, n):
    if n > 0:
        tl.store(ptr, tl.load(ptr))


def empty_graph_row(label: str, nodes: int, tensor: torch.Tensor, programs: int) -> list[str]:
    def launches():
        for _ in range(nodes):
            _empty_kernel[(programs,)](tensor, 0)
    graph, _ = capture(launches)
    host, wall, back_to_back = replay_times(graph)
    return [label, f"{host:.0f}", f"{wall:.0f}", f"{back_to_back:.0f}"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--nodes", type=int, default=160)
    args = p.parse_args()
    from moeferry.kernels.triton import gather_copy

    saved = {name: getattr(gather_copy, name) for name in ("_num_programs", "_PROGRAMS_PER_SM")}
    rows = []
    for variant in args.variants:
        rows.append(engine_row(variant, args.layers))
        restore_modules(saved)
        free_engine_memory()
    device_word = torch.zeros(1, device="cuda")
    host_word = torch.zeros(1, pin_memory=True)
    for programs in (1, 528):
        rows.append(empty_graph_row(f"{args.nodes} empty, device ptr, {programs} programs", args.nodes, device_word, programs))
    try:
        rows.append(empty_graph_row(f"{args.nodes} empty, pinned host ptr", args.nodes, host_word, 1))
    except (ValueError, RuntimeError, TypeError) as e:  # a launcher that refuses CPU tensors
        rows.append([f"pinned host ptr: {type(e).__name__}", "-", "-", "-"])
    print(f"{torch.cuda.get_device_name()}, {args.layers} layers, batch 1 (median of 20; us)")
    print("| graph | host replay() | idle-to-done wall | back-to-back GPU |\n|---|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
