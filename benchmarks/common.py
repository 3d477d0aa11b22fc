"""Shared by the benchmarks: the measured link and memory bandwidths, timers, the sweeps' knob
grids, and the tables as sections of RESULTS.md (``report``, ``--results``)."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import os
import re
import shlex
import subprocess
import sys

import torch


def commit() -> str:
    if os.environ.get("MOEFERRY_COMMIT"):  # a copy of the tree without .git
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


def gpu_main(name: str, parse_args):
    """Decorator of a GPU benchmark's body ``(argv, args) -> int``: the ``main(argv=None)`` that
    parses the command line (None: sys.argv) and, without a CUDA GPU to measure on, says so
    and returns 0."""
    def wrap(body):
        @functools.wraps(body)
        def main(argv=None) -> int:
            argv = sys.argv[1:] if argv is None else argv
            args = parse_args(argv)
            if not torch.cuda.is_available():
                print(f"{name}: needs a CUDA GPU; no CUDA GPU found, nothing measured.")
                return 0
            return body(argv, args)
        return main
    return wrap


def knob_grid(parser, default, items: list[str]) -> dict[str, list[int]]:
    """A sweep's ``--set NAME=V1,V2`` items -> {NAME: [V1, V2]}, each NAME a field of the frozen
    tuning value ``default`` (AdmissionTuning, GatherTuning; booleans as 0/1); an unknown NAME
    is a usage error."""
    names = {f.name for f in dataclasses.fields(default)}
    knobs = {}
    for item in items:
        name, values = item.split("=")
        if name not in names:
            parser.error(f"{type(default).__name__} has no field {name}; fields: {', '.join(sorted(names))}")
        knobs[name] = [int(v) for v in values.split(",")]
    return knobs


def knob_settings(default, knobs: dict[str, list[int]]):
    """Every combination of knob_grid's ``knobs``: (the tuple of its values, ``default`` with
    them replaced), the outer loop of a sweep."""
    for values in itertools.product(*knobs.values()):
        yield values, dataclasses.replace(default, **dict(zip(knobs, values)))


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


def pivot(rows: list[list], key, across) -> tuple[dict, list]:
    """Rows regrouped for a wide table: {key(row): {across(row): row}} and the across values,
    both in the order first seen (a table of one row per key, one column per across value)."""
    groups: dict = {}
    columns: list = []
    for row in rows:
        column = across(row)
        if column not in columns:
            columns.append(column)
        groups.setdefault(key(row), {})[column] = row
    return groups, columns


# --- RESULTS.md: one marked section per benchmark table, regenerated in place ---------------

def add_results_flag(parser) -> None:
    """The ``--results FILE...`` flag every benchmark takes (see ``report``)."""
    parser.add_argument("--results", nargs="+", default=[], metavar="FILE",
                        help="replace this benchmark's section of each FILE (benchmarks/RESULTS.md) with the new "
                             "table, adding the section where absent")


def command_line(module: str, argv: list[str]) -> str:
    """How a benchmark was run, as its section shows it: ``python -m MODULE ARGS`` without
    ``--results`` and its files (where a table was written is not how it was measured)."""
    shown, in_results = [], False
    for arg in argv:
        if arg == "--results" or arg.startswith("--results="):
            in_results = arg == "--results"
            continue
        if in_results and not arg.startswith("-"):
            continue
        in_results = False
        shown.append(shlex.quote(arg))
    return " ".join(["python -m", module, *shown])


def section(name: str, title: str, command: str, body: str, notes: str = "") -> str:
    """One benchmark table as a section of RESULTS.md: between ``<!-- bench:NAME -->`` and
    ``<!-- /bench:NAME -->``, its title, one line of the date, GPU, commit and the command line
    as run, the table(s) and notes."""
    lines = [f"<!-- bench:{name} -->", f"### {title}",
             f"{datetime.date.today().isoformat()}, {gpu_name()}, commit {commit()}: `{command}`", "",
             body.strip("\n")]
    if notes:
        lines += ["", notes.strip("\n")]
    return "\n".join(lines + [f"<!-- /bench:{name} -->"]) + "\n"


def replace_section(text: str, name: str, block: str) -> str:
    """``text`` (a RESULTS.md) with its section ``name`` replaced by ``block``: every line from
    the one holding ``<!-- bench:NAME -->`` to the one holding ``<!-- /bench:NAME -->``. A
    section not yet in ``text`` is added before the ``## Findings`` heading, or at the end when
    there is none. A start marker without its end is an error (nothing is guessed)."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    marked = re.compile(rf"^[^\n]*{re.escape(begin)}.*?{re.escape(end)}[^\n]*(\n|\Z)", re.S | re.M)
    if marked.search(text):
        return marked.sub(lambda _: block, text, count=1)
    if begin in text:
        raise ValueError(f"{begin} has no {end}")
    findings = re.search(r"^## Findings\b", text, re.M)
    if findings:
        return text[:findings.start()] + block + "\n" + text[findings.start():]
    gap = "" if not text else "\n" if text.endswith("\n") else "\n\n"
    return text + gap + block


def write_section(path: str, name: str, block: str) -> None:
    """Replace (or add) section ``name`` of the file at ``path`` (created if missing) with
    ``block``; the file is replaced whole, so a crash leaves the old one."""
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(replace_section(text, name, block))
    os.replace(tmp, path)


def report(name: str, title: str, command: str, body: str, notes: str = "", results: list[str] = ()) -> str:
    """Print a benchmark's table as its RESULTS.md section (``section``) and put that section
    into each file of ``results`` (``--results``), replacing the one there."""
    block = section(name, title, command, body, notes)
    print(block)
    for path in results:
        write_section(path, name, block)
    return block


def free_engine_memory() -> None:
    """Give back a dropped engine's device memory and pinned banks before the next engine pins
    its own (the runner and its graphs hold each other, so only a collection frees them): at
    48 layers an offload engine pins 58 GB, two of them more than a 128 GB host's RAM."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()


def set_statistics(engine, on: bool) -> None:
    """The slot cache's and the prefetch's counters on or off (as --moe-collect-stats would set
    them), the decode graphs recaptured: the kernels compile their counters in. A strategy
    without them has nothing to switch."""
    strategy = engine.runner.strategy
    if strategy.store.admits or strategy.prefetch is not None:
        strategy.set_statistics(on)
        engine.runner.recapture_graphs()


# Untimed decode steps before a decode benchmark times any: a slot cache starts from its start-up
# fill (the first layers' experts, whole), far from where routing with locality settles it; on
# the CPU engine (12 layers of 128 experts, 25% resident, qwen3 routing) a strategy that admits
# fewer of its misses (hybrid) still missed 29% more than offload after 4 steps, and as often
# after 25.
DECODE_WARMUP_STEPS = 32


def start_decode(engine, batch: int, prompt_len: int, warmup: int, steps: int, params=None) -> None:
    """`batch` requests with random prompts (fixed by `batch`), long enough for `warmup` +
    `steps` decode steps (greedy unless `params`, a SamplingParams), through their prefill and
    `warmup` decode steps: the next `steps` engine steps are decode steps of all of them."""
    from moeferry.sampling import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    params = params or SamplingParams(temperature=0.0, max_tokens=warmup + steps + 1, ignore_eos=True)
    vocab = engine.mc.vocab_size
    reqs = [engine.add_request(torch.randint(vocab, (prompt_len,), generator=gen).tolist(), params)
            for _ in range(batch)]
    while any(r.in_prefill for r in reqs):
        engine.step()
    for _ in range(warmup):
        engine.step()


def timed_decode(engine, batch: int, prompt_len: int, warmup: int, steps: int, counters, params=None) -> dict:
    """Time `steps` whole engine steps of `batch` requests (greedy unless `params`, a
    SamplingParams, says otherwise) with random prompts (fixed by `batch`), after their prefill
    and `warmup` decode steps. Returns tok_s, step_s and the per-step change of every value in
    the dict `counters(engine)` over exactly those steps."""
    import time

    start_decode(engine, batch, prompt_len, warmup, steps, params)
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


# --- routing: the routes every strategy of a table is measured under ------------------------

MODEL_ROUTING = "model"  # the model's own router, as it is (dummy weights: near-uniform)


def routing_choices() -> list[str]:
    from moeferry.routing.profiles import names

    return [*names(), MODEL_ROUTING]


def add_routing_flag(parser, default: str = "uniform") -> None:
    """The ``--routing`` flag of a decode, prefill or serve benchmark (see ``force_routing``)."""
    parser.add_argument("--routing", choices=routing_choices(), default=default,
                        help="the routes measured under: a generated profile (moeferry/routing/profiles.py: uniform, "
                             "the worst case for a cache; qwen3 and mixtral, calibrated to those models' published "
                             f"locality), the same for every strategy, or {MODEL_ROUTING!r}, the model's own router")
    parser.add_argument("--routing-seed", type=int, default=0, help="the generated routes' seed")


def force_routing(engine, routing: str, seed: int = 0, oracle_recall: float | None = None):
    """Hooks on every MoE router of ``engine`` forcing ``routing``'s generated routes
    (moeferry/routing/forced.py: drawn inside the decode graphs, the same routes under every
    strategy for the same seed and steps), with oracle predictions of the next layer's at
    ``oracle_recall`` if given; None for ``model``. Recapture the graphs after (and after
    ``remove()`` on what this returns)."""
    if routing == MODEL_ROUTING:
        if oracle_recall is not None:
            raise SystemExit("an oracle prefetch needs generated routes: --routing uniform, qwen3 or mixtral")
        return None
    from moeferry.routing.forced import ForcedRouting
    from moeferry.routing.profiles import get_profile

    return ForcedRouting.install(engine, get_profile(routing), seed, oracle_recall=oracle_recall)


def unforce_routing(forced) -> None:
    if forced is not None:
        forced.remove()


def routed_section(name: str, routing: str, default: str = "uniform") -> str:
    """A table's RESULTS.md section under ``routing``: ``name`` under the benchmark's default
    routing, ``name/ROUTING`` otherwise, so tables of two routings stand side by side."""
    return name if routing == default else f"{name}/{routing}"


def routing_note(routing: str, seed: int = 0) -> str:
    """The line under a table naming its routing."""
    if routing == MODEL_ROUTING:
        return "Routing: the model's own router (dummy weights: near-uniform, not a measure of locality)."
    from moeferry.routing.profiles import get_profile

    return f"Routing `{routing}`: {get_profile(routing).description} (seed {seed}; moeferry/routing/profiles.py)."


def share_slots(engine, share: float) -> int:
    """Slots holding `share` of every expert of `engine`'s model; at 0, the least a slot cache
    holds (one layer's experts: hybrid's copies then only pass through it)."""
    mc = engine.mc
    return max(mc.num_experts, int(round(share * len(mc.moe_layer_ids) * mc.num_experts)))
