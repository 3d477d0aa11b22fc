"""Tuning sweep for the miss gather (kernels/gather_copy/triton.py): GB/s against copy_ of the
same bytes (benchmarks/bench_copy.py's alternating measurement) over the Cartesian product of
GatherTuning fields.
  python -m benchmarks.sweep_gather --set chunk_bytes=16384,65536 --set num_warps=4,8 \\
      [--set programs_per_sm=1,2] [--set block_bytes=8192,16384] [--misses 8 16] [--banks w2]"""
import argparse

import torch

from benchmarks import bench_copy
from benchmarks.common import knob_grid, knob_settings, sweep_header, table_row
from moeferry.kernels.gather_copy import GatherTuning

p = argparse.ArgumentParser()
p.add_argument("--set", action="append", default=[], metavar="KNOB=V1,V2",
               help="a field of GatherTuning and its values")
p.add_argument("--misses", type=int, nargs="+", default=[8, 16])
p.add_argument("--banks", nargs="+", default=["w13", "w2"], choices=["w13", "w2"])
p.add_argument("--iters", type=int, default=10)
p.add_argument("--rounds", type=int, default=7)
args = p.parse_args()
knobs = knob_grid(p, GatherTuning(), args.set)
banks = {name.split()[0]: shape for name, shape in bench_copy.BANKS.items()}
print(f"{torch.cuda.get_device_name()}: medians of {args.rounds} alternating rounds of {args.iters} calls")
print(sweep_header(knobs, ["bank", "misses", "gather GB/s", "copy_ GB/s", "% of copy_"]))
for values, tuning in knob_settings(GatherTuning(), knobs):
    for bank in args.banks:
        for misses in args.misses:
            gather, copy = bench_copy.gather_vs_copy(banks[bank], max(64, misses), misses,
                                                     args.iters, args.rounds, tuning)
            print(table_row([*values, bank, misses, f"{gather:.1f}", f"{copy:.1f}",
                             f"{gather / copy:.1%}"]), flush=True)
