"""Does an L2 prefetch on a side stream, during latency-bound kernels, speed up the GEMV after them?
A CUDA graph of 48 "layers", each: three RMSNorms of one row (HBM idle, about 8 us), optionally a
kernel streaming 75 MB (the expert GEMMs' traffic at one request), then a one-row GEMV over a
distinct weight (o_proj 2048 x 4096, or qkv 5120 x 2048, bf16). Modes:
  gemv-cold     the 48 GEMVs alone, back to back (weights from HBM)
  gemv-warm     each GEMV run twice; the second reads its weight from L2 (shown: second only)
  chain         norms + GEMV
  bulk-P        chain, with the weight prefetched by P programs of bulk L2 prefetches
                (kernels/triton/prefetch.py) on a side stream forked at the layer's start
  lines-P       the same with one prefetch.global.L2 per 128-byte line
  stream[-ef]   norms + 75 MB stream (-ef: its loads evict_first) + GEMV; +bulk-P prefetched
Every mode's GEMV outputs are checked bit for bit against the chain's.
  python3 scripts/probe_l2_prefetch.py [--layers 48] [--shape o|qkv]"""
import argparse

import torch
import triton
import triton.language as tl

from benchmarks.common import elapsed_us
from moeferry.kernels import linear, norm_rope
from moeferry.kernels.triton.prefetch import prefetch_l2

SHAPES = {"o": (2048, 4096), "qkv": (5120, 2048)}


@triton.jit
def _stream_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if EVICT_FIRST:
            v = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
        else:
            v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def layer_chain(x, norm_w, weight, stream_buf, sink, mode: str, side: torch.cuda.Stream, warm: bool):
    prefetch = mode.split("+")[-1] if ("bulk" in mode or "lines" in mode) else None
    if prefetch:
        kind, programs = prefetch.split("-")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prefetch_l2(weight, int(programs), bulk=kind == "bulk")
    if mode.startswith("gemv"):
        if warm:
            linear.linear(x, weight)
        return linear.linear(x, weight)
    h = x[:, :2048]
    for _ in range(3):
        h = norm_rope.rms_norm(h, norm_w, 1e-6)
    if mode.startswith("stream"):
        _stream_kernel[(sink.numel(),)](stream_buf, stream_buf.numel(), sink, BLOCK=2048,
                                        EVICT_FIRST=mode.startswith("stream-ef"), num_warps=8)
    return linear.linear(x, weight)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--shape", choices=sorted(SHAPES), default="o")
    p.add_argument("--modes", nargs="+", default=[
        "gemv-cold", "gemv-warm", "chain", "chain+bulk-1", "chain+bulk-4", "chain+bulk-16", "chain+bulk-64",
        "chain+lines-16", "chain+lines-132", "stream", "stream+bulk-16", "stream-ef", "stream-ef+bulk-16"])
    args = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    n, k = SHAPES[args.shape]
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
    streams = [torch.randn(75 << 19, device=dev, dtype=torch.bfloat16) for _ in range(args.layers)]
    norm_w = torch.rand(2048, device=dev, dtype=torch.bfloat16) + 0.5
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    sink = torch.empty(132 * 4, device=dev, dtype=torch.float32)
    side = torch.cuda.Stream()
    floor_us = n * k * 2 / 4.3e12 * 1e6
    print(f"weight {n} x {k} bf16 ({n * k * 2 / 1e6:.1f} MB, {floor_us:.2f} us at 4.3 TB/s), {args.layers} layers")
    print(f"{'mode':<20} {'us/layer':>9} {'vs base':>9}")
    reference, per_layer = None, {}
    for mode in args.modes:
        warm = mode == "gemv-warm"
        def run():
            outs = [layer_chain(x, norm_w, w, s, sink, mode, side, warm) for w, s in zip(weights, streams)]
            if "bulk" in mode or "lines" in mode:  # join the side stream (only once it was forked:
                torch.cuda.current_stream().wait_stream(side)  # a capture cannot wait on outside work)
            return outs
        run()  # compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run()
        graph.replay()
        torch.cuda.synchronize()
        got = torch.stack([o.view(-1) for o in outs])
        reference = got.clone() if reference is None else reference
        assert torch.equal(got, reference), f"{mode}: GEMV outputs differ"

        def replays():
            for _ in range(20):
                graph.replay()

        us = elapsed_us(replays) / 20 / args.layers
        if mode == "gemv-warm" and "gemv-cold" in per_layer:
            us -= per_layer["gemv-cold"]  # the second GEMV of each pair
        per_layer[mode] = us
        base = mode.split("+")[0]
        delta = f"{us - per_layer[base]:+9.2f}" if "+" in mode and base in per_layer else ""
        print(f"{mode:<20} {us:>9.2f} {delta:>9}")



if __name__ == "__main__":
    main()
