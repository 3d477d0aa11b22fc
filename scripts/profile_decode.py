"""Device-side profile of decode steps (dummy Qwen3-30B-A3B shape): where the step's GPU time
goes, kernel by kernel, and how long the host side of a step takes.
  python3 scripts/profile_decode.py [--layers 12] [--strategy gpu] [--batch 1] [--eager]"""
import argparse
import os
import tempfile
import time

import torch

from benchmarks.common import busy_and_span
from moeferry.config import EngineConfig
from moeferry.engine.engine import Engine
from moeferry.sampling import SamplingParams
from moeferry.testing.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir



def busy_summary(intervals: list[tuple[float, float]], steps: int) -> str:
    """Kernels per step, GPU busy time (the union of the kernels' [start, end) in us) and the
    idle time between them inside the span from the first start to the last end: the gaps
    of a launch-bound step."""
    busy, span = busy_and_span(intervals)
    idle = span - busy
    return (f"GPU per step: {len(intervals) / steps:.0f} kernels, busy {busy / steps:.0f} us, "
            f"idle between them {idle / steps:.0f} us ({idle / max(len(intervals) - 1, 1):.2f} us "
            f"per boundary), span {span / steps:.0f} us")


p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=12)
p.add_argument("--strategy", default="gpu")
p.add_argument("--batch", type=int, default=1)
p.add_argument("--eager", action="store_true")
args = p.parse_args()
cfg = write_config_dir(os.path.join(tempfile.mkdtemp(), "m"), QWEN3_30B_DIR_CONFIG)
engine = Engine(EngineConfig(model=cfg, load_format="dummy", hf_overrides={"num_hidden_layers": args.layers},
                             moe_strategy=args.strategy, max_running_requests=args.batch, max_model_len=256,
                             num_tokens=4096, disable_cuda_graph=args.eager))
for _ in range(args.batch):
    engine.add_request(list(range(1, 33)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
for _ in range(10):
    engine.step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20):
    engine.step()
torch.cuda.synchronize()
print(f"step wall: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms")
runner = engine.runner
reqs = list(engine.scheduler.running)
t0 = time.perf_counter()
for _ in range(20):
    runner.graphs.inputs.write(*runner.decode_inputs(reqs), len(reqs)) if runner.graphs else runner.decode_inputs(reqs)
print(f"decode_inputs host: {(time.perf_counter() - t0) / 20 * 1e3:.3f} ms")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
           and "Memset" not in e.name]
if kernels:  # the 5 steps include the host's work between them, counted as idle
    print(busy_summary(kernels, 5))
