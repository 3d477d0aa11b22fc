"""Which event turns offload's slow start-up decode graph fast? One offload engine (cache of every
expert, 1 request); the start-up 1-request graph is timed alone (back-to-back replays, no host
work) after each event in turn: none (before any prefill), a timed decode run (prefill and
replays), gc + empty_cache, an eager decode forward on the current stream, another timed run,
an eager decode forward on a side stream (as a capture's warm-up runs it), a recapture. (Since
DecodeGraphs ends its captures with a side-stream forward, the start-up graph should be fast from
the first event.)
--bisect (offload): instead, launches on a side stream, one after another, the first MoE
layer's admission alone, its miss copy, its fused MoE over the slot pool, the whole MoE block,
then the whole forward: the first that turns the graph fast names the kernel concerned.
--carveout PCT: first set every compiled Triton kernel's preferred shared-memory carveout to
PCT percent (cuFuncSetAttribute through ctypes) and recapture: is the slow mode the SMs'
L1/shared split changing between the kernels of a step?
  python3 scripts/probe_startup_graph.py [--layers 48] [--strategy offload|gpu] [--bisect]
                                         [--carveout PCT]"""
import argparse
import gc

import torch

from benchmarks import bench_decode
from benchmarks.common import replay_us, timed_decode
from moeferry.engine.cuda_graph import run_on_side_stream


def set_carveout(percent: int) -> None:
    """Preferred shared-memory carveout of every compiled kernel of moeferry's Triton modules."""
    import ctypes
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import moeferry.kernels.triton as package

    libcuda = ctypes.CDLL("libcuda.so.1")
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, fn in vars(module).items():
            if not isinstance(fn, JITFunction):
                continue
            for caches in fn.device_caches.values():
                for kernel in caches[0].values():
                    kernel._init_handles()
                    rc = libcuda.cuFuncSetAttribute(ctypes.c_void_p(kernel.function), 9, percent)
                    print(f"  carveout {percent}% rc={rc}: {name} shared {kernel.metadata.shared} B, "
                          f"{kernel.metadata.num_warps} warps", flush=True)


def bisect_events(runner, on_side_stream, eager_decode):
    """Side-stream launches of the first MoE layer's parts, growing, then the whole forward."""
    from moeferry.kernels import ops

    strategy = runner.strategy
    layer = sorted(strategy.banks)[0]
    block = runner.model.moe_block(layer)
    host, pool, cache = strategy.banks[layer], strategy.pool, strategy.cache
    with torch.inference_mode():
        hidden = torch.randn(1, block.gate.weight.shape[1], dtype=runner.dtype, device=runner.device)
        weights, ids = block.gate(hidden).float().topk(block.top_k)
        weights, ids = weights.softmax(-1), ids.to(torch.int32)
    slot_ids = cache.admit(strategy.moe_index[layer], ids)
    return [
        ("nothing (no prefill yet)", lambda: None),
        ("admission, side stream", lambda: on_side_stream(lambda: cache.admit(strategy.moe_index[layer], ids))),
        ("miss copy, side stream", lambda: on_side_stream(
            lambda: cache.copy_misses([host.w13, host.w2], [pool.w13, pool.w2]))),
        ("fused MoE, side stream", lambda: on_side_stream(lambda: ops.fused_moe(
            hidden, pool.w13, pool.w2, weights, slot_ids, num_routed_experts=host.num_experts, sum_routes=False))),
        ("MoE block, side stream", lambda: on_side_stream(lambda: block(hidden, True, sum_routes=False))),
        ("eager forward, side stream", lambda: on_side_stream(eager_decode)),
    ]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--strategy", choices=["offload", "gpu"], default="offload")
    p.add_argument("--bisect", action="store_true")
    p.add_argument("--carveout", type=int)
    args = p.parse_args()
    engine, _ = bench_decode.probe_engine(args.strategy, args.layers)
    runner = engine.runner
    if args.carveout is not None:
        set_carveout(args.carveout)
        runner.recapture_graphs()
    start_up = runner.graphs

    def eager_decode():
        with torch.inference_mode():
            runner.model(start_up.batches[1], runner.kv)

    def on_side_stream(fn=eager_decode):
        def under_inference_mode():
            with torch.inference_mode():
                fn()
        run_on_side_stream(under_inference_mode)

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
    if args.bisect:
        events = bisect_events(runner, on_side_stream, eager_decode)
    for name, event in events:
        event()
        torch.cuda.synchronize()
        times = [replay_us(start_up.graphs[1]) for _ in range(3)]
        print(f"after {name:<32} start-up graph {min(times):6.0f} us (of {', '.join(f'{t:.0f}' for t in times)})",
              flush=True)
    print(f"the recaptured graph {min(replay_us(runner.graphs.graphs[1]) for _ in range(3)):6.0f} us", flush=True)


if __name__ == "__main__":
    main()
