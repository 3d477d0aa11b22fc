"""Tile sweep for the MLA decode kernel (kernels/mla/triton.py) at DeepSeek-V3's shapes: 128 heads,
rank 512 + rope 64, bf16, page 16, every request at the full context, pages scattered at random
(bench_deepseek's mla_inputs). Per (B, context), each MLAConfig is first checked against the
fp32 reference on that input (a config whose max abs error is past bf16's tolerance is flagged
and not timed), then timed in a CUDA graph (triton.testing.do_bench_cudagraph) over enough
input copies that consecutive calls miss the L2, at the default split count (launch_shape).
Rows: us per call, the byte floor's share (latent bytes B * context * 576 * 2 over 4.3 TB/s)
and TFLOP/s (per request and token 128 heads x (576 + 512) x 2 FLOPs, what one pass over the
scores and the values needs; value blocks recompute the scores on top). Then the fastest tile
per shape; select_config's choice is the first row of each shape.
  python -m benchmarks.sweep_mla [--shapes 1x4096 1x32768 16x4096 64x4096 64x32768]
      [--grid quick|full] [--block-h 32 64] [--block-n 16 32 64] [--block-v 128 256 512]
      [--warps 4 8] [--stages 1 2 3] [--dry]
--grid quick (the default) tries QUICK, a dozen tiles that fit an SM's shared memory at these
shapes, in about two minutes on an H200; --grid full the product of the per-axis lists (a tile
that does not fit reports its error). --dry lists the shapes and tiles and measures nothing.
GPU only: without CUDA (and without --dry) it says so and exits 0."""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

from benchmarks.bench_deepseek import (HBM_BYTES_PER_S, HEADS, L2_FLUSH_BYTES, PAGE_SIZE, RANK, ROPE, latent_bytes,
                                       mla_inputs)
from benchmarks.common import gpu_main
from moeferry.kernels.mla.triton import MLAConfig, launch_shape, select_config

SCALE = 192 ** -0.5  # DeepSeek-V3's (nope 128 + rope 64) ** -0.5
ATOL = RTOL = 2e-2  # bf16 output against the fp32 reference, as tests/kernels/test_mla.py
C = MLAConfig
QUICK = [C(64, 32, 256, 8, 2), C(64, 32, 512, 8, 2), C(64, 32, 128, 8, 2), C(64, 16, 256, 8, 2),
         C(64, 16, 512, 8, 2), C(64, 16, 256, 8, 3), C(32, 16, 512, 8, 2), C(32, 32, 256, 8, 2),
         C(32, 32, 512, 8, 2), C(32, 64, 256, 8, 2), C(32, 32, 256, 4, 2), C(32, 32, 256, 8, 3)]


def parse_shape(text: str) -> tuple[int, int]:
    batch, context = text.lower().split("x")
    return int(batch), int(context)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=parse_shape, nargs="+",
                   default=[(1, 4096), (1, 32768), (16, 4096), (64, 4096), (64, 32768)], help="BxCONTEXT")
    p.add_argument("--grid", choices=["quick", "full"], default="quick")
    p.add_argument("--block-h", type=int, nargs="+", default=[32, 64])
    p.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--block-v", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--rep", type=int, default=20, help="ms of calls per timed graph (do_bench_cudagraph's rep)")
    p.add_argument("--dry", action="store_true", help="list the shapes and tiles, measure nothing")
    args = p.parse_args(argv)
    try:
        for config in tiles(args):
            config.check()
    except ValueError as e:
        p.error(str(e))
    return args


def tiles(args) -> list[MLAConfig]:
    """The grid: QUICK, or the product of the per-axis lists."""
    if args.grid == "quick":
        return list(QUICK)
    return [MLAConfig(*t) for t in itertools.product(args.block_h, args.block_n, args.block_v, args.warps,
                                                      args.stages)]


def shape_tiles(args, batch: int, context: int) -> list[MLAConfig]:
    """select_config's choice first, then the grid without it."""
    chosen = select_config(batch, HEADS, RANK, context)
    return [chosen, *(c for c in tiles(args) if c != chosen)]


def useful_flops(batch: int, context: int) -> float:
    return batch * context * HEADS * (RANK + ROPE + RANK) * 2


def describe(config: MLAConfig) -> str:
    return (f"h{config.block_h} n{config.block_n} v{config.block_v} w{config.num_warps} "
            f"s{config.num_stages}")


def check(config: MLAConfig, call, want: torch.Tensor) -> tuple[float, bool]:
    """(max abs error of the tile's output against the fp32 reference, within bf16's tolerance)."""
    from moeferry.kernels.mla import triton as triton_mla

    got = triton_mla.mla_decode_attention(*call, config=config).float()
    return (got - want).abs().max().item(), torch.allclose(got, want, atol=ATOL, rtol=RTOL)


def time_us(config: MLAConfig, calls: list, rep: int) -> float:
    """us per call in a CUDA graph, each captured call on the next input copy."""
    import triton.testing

    from moeferry.kernels.mla import triton as triton_mla

    turn = itertools.cycle(calls)
    ms = triton.testing.do_bench_cudagraph(lambda: triton_mla.mla_decode_attention(*next(turn), config=config),
                                           rep=rep, return_mode="median")
    return ms * 1e3


def shape_rows(args, batch: int, context: int) -> list[list]:
    """One row per tile at (batch, context): the check, then the timing."""
    from moeferry.kernels.mla import reference

    nbytes = latent_bytes(batch, context)
    copies = -(-L2_FLUSH_BYTES // nbytes)
    calls = [(*mla_inputs(batch, context), PAGE_SIZE, SCALE, RANK) for _ in range(copies)]
    q, cache, table, lens, *_ = calls[0]
    want = reference.mla_decode_attention(q.float(), cache.float(), table, lens, PAGE_SIZE, SCALE, RANK)
    floor_us = nbytes / HBM_BYTES_PER_S * 1e6
    rows = []
    for i, config in enumerate(shape_tiles(args, batch, context)):
        _, splits = launch_shape(batch, HEADS, RANK, context, config, q.device)
        err, us = "-", None
        try:
            error, ok = check(config, calls[0], want)
            err = f"{error:.3g}" + ("" if ok else " MISMATCH, not timed")
            us = time_us(config, calls, args.rep) if ok else None
        except Exception as e:  # noqa: BLE001 (out of shared memory, say): the row says so
            err = type(e).__name__
        label = describe(config) + (" (default)" if i == 0 else "")
        rows.append([batch, context, label, splits, "-" if us is None else f"{us:.1f}",
                     "-" if us is None else f"{floor_us / us:.1%}",
                     "-" if us is None else f"{useful_flops(batch, context) / us / 1e6:.0f}", err])
        print("| " + " | ".join(str(v) for v in rows[-1]) + " |", flush=True)
    del calls, want
    torch.cuda.empty_cache()
    return rows


def best_rows(rows: list[list]) -> list[list]:
    """The fastest timed tile per (B, context), beside the default's time."""
    best = []
    for shape, group in itertools.groupby(rows, key=lambda r: (r[0], r[1])):
        group = list(group)
        timed = [r for r in group if r[4] != "-"]
        if timed:
            top = min(timed, key=lambda r: float(r[4]))
            best.append([*shape, top[2], top[4], top[5], top[6], group[0][4]])
    return best


HEADER = ["B", "context", "tile", "splits", "us", "% of byte floor", "TFLOP/s", "max abs err"]


@gpu_main("sweep_mla", parse_args)
def sweep(argv, args) -> int:
    print(f"{torch.cuda.get_device_name()}; MLA decode, {HEADS} heads, rank {RANK} + rope {ROPE}, bf16, "
          f"page {PAGE_SIZE}; {len(tiles(args))} tiles x {len(args.shapes)} shapes")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---:|" * 2 + "---|" + "---:|" * 4 + "---|")
    rows = [row for batch, context in args.shapes for row in shape_rows(args, batch, context)]
    print("\nFastest tile per shape:")
    print("| B | context | tile | us | % of byte floor | TFLOP/s | default us |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for row in best_rows(rows):
        print("| " + " | ".join(str(v) for v in row) + " |")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.dry:
        for batch, context in args.shapes:
            for i, config in enumerate(shape_tiles(args, batch, context)):
                print(batch, context, describe(config) + (" (default)" if i == 0 else ""))
        return 0
    return sweep(argv)


if __name__ == "__main__":
    sys.exit(main())
