"""Paged decode attention: the plain-torch reference vs the Triton kernel.

Qwen3-30B-A3B attention shapes (32 q heads, 4 kv heads, head_dim 128, bf16, page size 16)
at B = 1, 4, 16, 64 requests and contexts of 512, 2048 and 8192 tokens, every request at
the full context, pages scattered at random over the cache as a serving engine leaves them.
Each implementation is captured ``--iters`` times (at least once per input copy) in one
CUDA graph, as in the decode step, so launch overhead is the graph's; the time per call is
the best of ``--repeats`` replays. Consecutive calls read different copies of the inputs
(at least 256 MiB of KV between two reads of one copy), so small cases are not served from
the 50 MiB L2. Achieved bandwidth counts the K and V bytes one call must read
(2 * B * context * 4 * 128 * 2 bytes) against the H200's 4.3 TB/s of HBM.

GPU only: without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

from benchmarks.common import add_results_flag, command_line, gpu_main, report
from moeferry.engine.cuda_graph import capture

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 4, 128, 16
BATCHES = (1, 4, 16, 64)
CONTEXTS = (512, 2048, 8192)
HBM_BYTES_PER_S = 4.3e12
L2_FLUSH_BYTES = 256 << 20


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--iters", type=int, default=20,
                   help="calls captured in one graph (more when more input copies are needed)")
    p.add_argument("--repeats", type=int, default=5, help="graph replays; the best is kept")
    p.add_argument("--skip-reference", action="store_true")
    add_results_flag(p)
    return p.parse_args(argv)


def decode_inputs(batch: int, context: int):
    """q, k_cache, v_cache, page_table, seq_lens for `batch` requests of `context` tokens."""
    pages_per_req = -(-context // PAGE_SIZE)
    num_pages = batch * pages_per_req
    slots = (num_pages + 1) * PAGE_SIZE
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    table = torch.randperm(num_pages, device="cuda").int().view(batch, pages_per_req)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    return q, k, v, table, seq_lens


def seconds_per_call(fn, iters: int, repeats: int) -> float:
    def repeated():
        for _ in range(iters):
            fn()

    graph, _ = capture(repeated)
    graph.replay()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / iters)
    del graph
    return best


def measure(batch: int, context: int, args) -> dict:
    from moeferry.kernels.attention import reference
    from moeferry.kernels.attention import triton as triton_attn

    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    copies = -(-L2_FLUSH_BYTES // kv_bytes)
    iters = max(args.iters, copies)
    calls = [(*decode_inputs(batch, context), PAGE_SIZE, HEAD_DIM ** -0.5) for _ in range(copies)]
    row = {"kv_bytes": kv_bytes, "reference": None,
           "splits": triton_attn.num_splits_for(batch, KV_HEADS, calls[0][3].shape[1] * PAGE_SIZE,
                                                calls[0][0].device)}

    def each_copy(fn):
        turn = itertools.cycle(calls)
        return lambda: fn(*next(turn))

    row["triton"] = seconds_per_call(each_copy(triton_attn.decode_attention), iters, args.repeats)
    if not args.skip_reference:
        row["reference"] = seconds_per_call(each_copy(reference.decode_attention), iters, args.repeats)
    torch.cuda.empty_cache()
    return row


@gpu_main("bench_attention", parse_args)
def main(argv, args) -> int:
    lines = ["| B | context | KV MiB | splits | reference µs | Triton µs | speed-up | Triton TB/s | % of 4.3 TB/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for batch in args.batches:
        for context in args.contexts:
            r = measure(batch, context, args)
            ref = "-" if r["reference"] is None else f"{r['reference'] * 1e6:.1f}"
            speedup = "-" if r["reference"] is None else f"{r['reference'] / r['triton']:.1f}x"
            rate = r["kv_bytes"] / r["triton"]
            lines.append(f"| {batch} | {context} | {r['kv_bytes'] / 2**20:.1f} | {r['splits']} | {ref} "
                         f"| {r['triton'] * 1e6:.1f} | {speedup} | {rate / 1e12:.2f} "
                         f"| {rate / HBM_BYTES_PER_S:.0%} |")
            print(lines[-1], flush=True)
    report("attention", "Paged decode attention, Qwen3-30B-A3B shapes (32/4 heads, d 128, bf16, page 16)",
           command_line("benchmarks.bench_attention", argv), "\n".join(lines),
           "Every request at the full context, pages scattered at random; time per call in a CUDA graph, "
           "the best of the replays.", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
