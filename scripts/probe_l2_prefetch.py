"""Does an L2 prefetch on a side stream, during latency-bound kernels, speed up the GEMV after them?
A CUDA graph of 48 "layers", each: three RMSNorms of one row (HBM idle, about 8 us), optionally a
kernel streaming 75 MB (the expert GEMMs' traffic at one request), then a one-row GEMV over a
distinct weight (o_proj 2048 x 4096, or qkv 5120 x 2048, bf16). Modes:
  gemv-cold     the 48 GEMVs alone, back to back (weights from HBM)
  gemv-warm     each GEMV run twice; the second reads its weight from L2 (shown: second only)
  chain         norms + GEMV
  bulk-P        chain, with the weight prefetched by P programs of bulk L2 prefetches
                (cp.async.bulk.prefetch.L2, sm_90, 64 KiB each) on a side stream forked at the
                layer's start
  lines-P       the same with one prefetch.global.L2 per 128-byte line
  stream[-ef]   norms + 75 MB stream (-ef: its loads evict_first) + GEMV; +bulk-P prefetched
Every mode's GEMV outputs are checked bit for bit against the chain's. The answer on an H200
(benchmarks/RESULTS.md, sixth session): no; the engine has no prefetch.
  python3 scripts/probe_l2_prefetch.py [--layers 48] [--shape o|qkv]"""
import argparse

import torch
import triton
import triton.language as tl

from benchmarks.common import replay_us
from moeferry.engine.cuda_graph import capture
from moeferry.kernels import linear, norm_rope

SHAPES = {"o": (2048, 4096), "qkv": (5120, 2048)}
CHUNK_BYTES = 64 * 1024  # one bulk prefetch (a multiple of 16 bytes, as the instruction requires)
LINE_BYTES = 128
BLOCK = 128  # chunks (lines) a program issues at once: one per thread of 4 warps


@triton.jit
def _prefetch_kernel(base_ptr, num_bytes, CHUNK: tl.constexpr, BULK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p issues chunks p * BLOCK + [0, BLOCK), then every num_programs * BLOCK on; the
    last chunk is clamped to the end (lanes past it repeat it: harmless for a prefetch)."""
    num_chunks = tl.cdiv(num_bytes, CHUNK)
    for start in range(tl.program_id(0) * BLOCK, num_chunks, tl.num_programs(0) * BLOCK):
        chunk = tl.minimum(start + tl.arange(0, BLOCK), num_chunks - 1).to(tl.int64)
        addr = base_ptr + chunk * CHUNK
        if BULK:
            size = tl.minimum(num_bytes - chunk * CHUNK, CHUNK).to(tl.int32)
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                                      "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
                                      "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(t: torch.Tensor, programs: int, bulk: bool) -> None:
    """Prefetch t's bytes (contiguous, 16-byte aligned, a multiple of 16 long) into L2."""
    raw = t.view(-1).view(torch.uint8)
    _prefetch_kernel[(programs,)](raw, raw.numel(), CHUNK=CHUNK_BYTES if bulk else LINE_BYTES, BULK=bulk,
                                  BLOCK=BLOCK, num_warps=BLOCK // 32)


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
        graph, outs = capture(run)  # (its warm-up compiles)
        graph.replay()
        torch.cuda.synchronize()
        got = torch.stack([o.view(-1) for o in outs])
        reference = got.clone() if reference is None else reference
        assert torch.equal(got, reference), f"{mode}: GEMV outputs differ"
        us = replay_us(graph) / args.layers
        if mode == "gemv-warm" and "gemv-cold" in per_layer:
            us -= per_layer["gemv-cold"]  # the second GEMV of each pair
        per_layer[mode] = us
        base = mode.split("+")[0]
        delta = f"{us - per_layer[base]:+9.2f}" if "+" in mode and base in per_layer else ""
        print(f"{mode:<20} {us:>9.2f} {delta:>9}")



if __name__ == "__main__":
    main()
