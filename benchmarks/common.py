"""Shared by the benchmarks: the measured link and memory bandwidths, the commit, tables."""

from __future__ import annotations

import datetime
import itertools
import subprocess

import torch

def commit() -> str:
    import os

    if os.environ.get("MOEFERRY_COMMIT"):  # the device machine gets the tree without .git
        return os.environ["MOEFERRY_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def elapsed_us(fn) -> float:
    """Device time of everything ``fn`` enqueues on the current stream, in microseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0


def replay_us(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    """Device microseconds per replay of ``graph``, ``replays`` of them back to back."""
    def back_to_back():
        for _ in range(replays):
            graph.replay()

    return elapsed_us(back_to_back) / replays


def busy_and_span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(busy, span) of kernels' [start, end) intervals: the length of their union, and from the
    first start to the last end. The span less the busy time is the GPU's idle time between them."""
    if not intervals:
        return 0.0, 0.0
    intervals = sorted(intervals)
    busy, covered_to = 0.0, intervals[0][0]
    for start, end in intervals:
        if end > covered_to:
            busy += end - max(start, covered_to)
            covered_to = end
    return busy, covered_to - intervals[0][0]


def kernel_profile(fn, repeats: int = 5) -> tuple[dict[str, float], float, float]:
    """Where the device time of ``fn`` (a graph replay, a step) goes: (microseconds per call of
    each kernel name, summed over its launches; busy and span microseconds per call, see
    ``busy_and_span``), from the torch profiler over ``repeats`` calls. Copies and memsets
    count as kernels here."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, float] = {}
    intervals = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            start, end = event.time_range.start, event.time_range.end
            per_name[event.name] = per_name.get(event.name, 0.0) + (end - start) / repeats
            intervals.append((start, end))
    busy, span = busy_and_span(intervals)
    return per_name, busy / repeats, span / repeats


def us_per_call(fn, iters: int) -> float:
    """Device microseconds per call of ``fn``: one untimed call, then ``iters`` back to back."""
    fn()

    def calls():
        for _ in range(iters):
            fn()

    return elapsed_us(calls) / iters


def pinned_h2d_copy(nbytes: int):
    """A callable copying ``nbytes`` from a new pinned host buffer into a new device buffer
    (a non-blocking copy_: the DMA path the H2D figures are measured on)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return lambda: dst.copy_(src, non_blocking=True)


def h2d_bandwidth(nbytes: int = 1 << 30, iters: int = 5) -> float:
    """Measured pinned host-to-device copy bandwidth in bytes/s."""
    return nbytes / (us_per_call(pinned_h2d_copy(nbytes), iters) / 1e6)


def hbm_bandwidth(nbytes: int = 2 << 30, iters: int = 10) -> float:
    """Measured device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes
    written: the rate at which HBM moves bytes, which a weight-reading GEMM can approach."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3)


def knob_grid(parser, module, items: list[str]) -> dict[str, list[int]]:
    """A sweep script's ``--set NAME=V1,V2`` items -> {NAME: [V1, V2]}, each NAME a module
    global of ``module`` (a kernel's tuning knob, read at every launch); a NAME the module
    lacks is a usage error."""
    knobs = {}
    for item in items:
        name, values = item.split("=")
        if not hasattr(module, name):
            parser.error(f"{module.__name__} has no knob {name}")
        knobs[name] = [int(v) for v in values.split(",")]
    return knobs


def knob_settings(module, knobs: dict[str, list[int]]):
    """Every combination of knob_grid's ``knobs``, each set on ``module`` in turn before it is
    yielded (as the tuple of its values): the outer loop of a sweep script."""
    for values in itertools.product(*knobs.values()):
        for name, value in zip(knobs, values):
            setattr(module, name, value)
        yield values


def table_row(cells) -> str:
    """One markdown table row, the cells printed with str()."""
    return "| " + " | ".join(map(str, cells)) + " |"


def sweep_header(knobs: dict[str, list[int]], columns: list[str]) -> str:
    """The header of a sweep's table: a column per knob, then ``columns``, right-aligned."""
    return table_row([*knobs, *columns]) + "\n|" + "---:|" * (len(knobs) + len(columns))


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def report(title: str, command: str, table: str, notes: str = "", out: str | None = None) -> str:
    text = (f"\n### {title}\n\n{datetime.date.today().isoformat()}, {gpu_name()}, commit {commit()}\n\n"
            f"`{command}`\n\n{table}\n" + (f"\n{notes}\n" if notes else ""))
    emit(text, out)
    return text


def emit(text: str, out: str | None) -> None:
    """Print a benchmark's table and append it to `out` (benchmarks/RESULTS.md or $OUT/...)."""
    print(text)
    if out:
        with open(out, "a") as f:
            f.write("\n" + text)


def free_engine_memory() -> None:
    """Give back a dropped engine's device memory and pinned banks before the next engine pins
    its own (the runner and its graphs hold each other, so only a collection frees them): at
    48 layers an offload engine pins 58 GB, two of them more than the GPU machine's RAM."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()


def timed_decode(engine, batch: int, prompt_len: int, warmup: int, steps: int, counters) -> dict:
    """Time `steps` whole engine steps of `batch` greedy requests with random prompts (fixed by
    `batch`), after their prefill and `warmup` decode steps. Returns tok_s, step_s and the
    per-step change of every value in the dict `counters(engine)` over exactly those steps."""
    import time

    from moeferry.sampling import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 1, ignore_eos=True)
    vocab = engine.mc.vocab_size
    reqs = [engine.add_request(torch.randint(vocab, (prompt_len,), generator=gen).tolist(), params)
            for _ in range(batch)]
    while any(r.in_prefill for r in reqs):
        engine.step()
    for _ in range(warmup):
        engine.step()
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    sync()
    before = counters(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    dt = time.perf_counter() - t0
    after = counters(engine)
    while engine.has_work:
        engine.step()
    per_step = {k: (after[k] - before[k]) / steps for k in before}
    return {"tok_s": batch * steps / dt, "step_s": dt / steps, **per_step}
