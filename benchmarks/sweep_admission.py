"""Tuning sweep for the admission kernel: microseconds per call (benchmarks/bench_admission.py's
measurement) over the Cartesian product of AdmissionTuning fields (each value compiling its own
kernel), at a few widths, all hits and with ~10% misses.
  python -m benchmarks.sweep_admission --set num_warps=8,16 --set radix_bits=5,8 \\
      [--set keys_in_registers=1,0] [--set extract_max=0,16] \\
      [--requests 1 16 128] [--policy lru] [--no-stats] [--phases]
--phases: the "with misses" run again with the kernel's phase clock (AdmissionTuning.phase_clock:
a barrier and an SM clock read at the end of each phase), and that row's time per call split by
the phases' shares of the cycles over all its calls."""
import argparse
import dataclasses

import torch

from benchmarks import bench_admission
from benchmarks.common import knob_grid, knob_settings, sweep_header, table_row
from moeferry.kernels.admission import AdmissionTuning
from moeferry.kernels.admission import triton as admission

p = argparse.ArgumentParser()
p.add_argument("--set", action="append", default=[], metavar="KNOB=V1,V2",
               help="a field of AdmissionTuning and its values")
p.add_argument("--requests", type=int, nargs="+", default=[1, 16, 128])
p.add_argument("--policy", default="lru")
p.add_argument("--no-stats", action="store_true", help="admit without statistics counters")
p.add_argument("--phases", action="store_true", help="split the time of calls with misses by phase")
args = p.parse_args()


def phase_split(requests, stats, miss_us, tuning):
    """'phase us / ...' of a call with misses: its time by the phases' shares of the cycles,
    measured in a second run with the phase clock on (which adds its own barriers)."""
    cycles = admission.phase_cycles("cuda")
    bench_admission.measure(bench_args, requests, True, stats, before_timing=cycles.zero_,
                            tuning=dataclasses.replace(tuning, phase_clock=True))
    per_phase = cycles[:-1].double() / max(int(cycles[-1]), 1)
    shares = per_phase / per_phase.sum()
    return " / ".join(f"{name} {miss_us * float(share):.2f}"
                      for name, share in zip(admission.PHASES, shares) if share > 0.005) + (
        f" ({float(per_phase.sum()):.0f} cycles a call)")


knobs = knob_grid(p, AdmissionTuning(), args.set)
bench_args = bench_admission.parse_args(["--policy", args.policy])
print(f"{torch.cuda.get_device_name()}, policy {args.policy}, {bench_args.slots} slots, "
      f"{bench_args.layers} layers, statistics {'off' if args.no_stats else 'on'}")
print(sweep_header(knobs, ["requests", "all hits (us)", "with misses (us)", "miss rate"]))
for values, tuning in knob_settings(AdmissionTuning(), knobs):
    for requests in args.requests:
        stats = not args.no_stats
        hits_us, _ = bench_admission.measure(bench_args, requests, False, stats, tuning=tuning)
        miss_us, rate = bench_admission.measure(bench_args, requests, True, stats, tuning=tuning)
        rate_text = f"{rate:.1%}" if stats else "-"  # the miss rate comes from the statistics
        print(table_row([*values, requests, f"{hits_us:.2f}", f"{miss_us:.2f}", rate_text]),
              flush=True)
        if args.phases:
            print(f"|   phases of a call with misses, us: {phase_split(requests, stats, miss_us, tuning)} |",
                  flush=True)
