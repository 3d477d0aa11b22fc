"""Tuning sweep for the admission kernel: microseconds per call (benchmarks/bench_admission.py's
measurement) by the kernel's warp count, radix digit width and where the slot keys live, at a
few widths, all hits and with ~10% misses.
  python3 scripts/sweep_admission.py [--warps 2 4 8 16] [--radix-bits 8] [--registers 1 0]
                                     [--requests 1 16 128]"""
import argparse

import torch

from benchmarks import bench_admission
from moeferry.kernels.triton import admission

p = argparse.ArgumentParser()
p.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8, 16])
p.add_argument("--radix-bits", type=int, nargs="+", default=[8])
p.add_argument("--registers", type=int, nargs="+", default=[1],
               help="1: keys in registers when the pool is one block; 0: always in memory")
p.add_argument("--requests", type=int, nargs="+", default=[1, 16, 128])
p.add_argument("--policy", default="lru")
args = p.parse_args()
bench_args = bench_admission.parse_args(["--policy", args.policy])
print(f"{torch.cuda.get_device_name()}, policy {args.policy}, {bench_args.slots} slots, {bench_args.layers} layers")
print("| warps | radix bits | keys in registers | requests | all hits (us) | with misses (us) "
      "| miss rate |")
print("|---:|---:|---:|---:|---:|---:|---:|")
configs = [(w, b, r) for w in args.warps for b in args.radix_bits for r in args.registers]
for warps, bits, registers in configs:
    # read at every launch; each value compiles its own kernel
    admission._NUM_WARPS, admission._RADIX_BITS = warps, bits
    admission._KEYS_IN_REGISTERS = bool(registers)
    for requests in args.requests:
        hits_us, _ = bench_admission.measure(bench_args, requests, with_misses=False)
        miss_us, rate = bench_admission.measure(bench_args, requests, with_misses=True)
        print(f"| {warps} | {bits} | {registers} | {requests} | {hits_us:.2f} | {miss_us:.2f} "
              f"| {rate:.1%} |", flush=True)
