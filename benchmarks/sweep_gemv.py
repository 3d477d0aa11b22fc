"""Does the CUDA-core GEMV (kernels/linear/triton.py) run faster with more of each weight row in
flight per program? bench_linear's sweep stopped at BLOCK_K 2048; here the K chunk goes up to the
whole row (one round trip per program instead of K / BLOCK_K in turn), at 1, 2 and 4 rows, for
qkv and o_proj, beside select_config's choice and cuBLAS. us per call, 48 distinct weights per
CUDA graph (benchmarks/bench_linear.us_per_call).
  python -m benchmarks.sweep_gemv [--rows 1 2 4]"""
import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_linear import SHAPES, describe, us_per_call, weight_copies
from moeferry.kernels.linear import triton as skinny
from moeferry.kernels.linear.triton import LinearConfig

TILES = [(1, 512, 4), (1, 1024, 4), (1, 2048, 4), (1, 2048, 8), (1, 4096, 4), (1, 4096, 8),
         (2, 1024, 4), (2, 2048, 4), (2, 2048, 8), (4, 512, 4), (4, 1024, 4), (4, 2048, 8), (8, 1024, 8)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--shapes", nargs="+", default=["qkv", "o_proj"])
    args = p.parse_args()
    print(f"{'shape':<7} {'rows':>4} {'config':<22} {'us':>7} {'floor':>6}")
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = weight_copies(n, k)
        floor = n * k * 2 / 4.3e12 * 1e6
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            block_m = min(16, 1 << (m - 1).bit_length())
            results = [("cuBLAS", us_per_call(F.linear, x, weights, 20))]
            chosen = skinny.select_config(m, n, k)
            results.append((f"chosen {describe(chosen)}", us_per_call(skinny.linear, x, weights, 20)))
            for bn, bk, warps in TILES:
                if bk > k or block_m * bn * bk > 64 * 32 * warps:
                    continue
                config = LinearConfig(block_m, bn, bk, warps, 1)
                try:
                    us = us_per_call(lambda a, w, c=config: skinny.linear(a, w, config=c), x, weights, 20)
                except Exception as e:  # out of resources: skip the tile
                    print(f"{name:<7} {m:>4} {describe(config):<22} failed: {type(e).__name__}")
                    continue
                results.append((describe(config), us))
            for label, us in sorted(results, key=lambda r: r[1]):
                print(f"{name:<7} {m:>4} {label:<22} {us:>7.2f} {floor:>6.2f}")
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
