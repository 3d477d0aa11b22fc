"""Prefill over a partly resident expert cache: a dummy Qwen3-30B-A3B-shaped model
(12 layers by default, 128 experts, top-8, bf16), routing `--routing` (default uniform,
generated in the graph: every expert of a layer is routed by a long chunk; qwen3 / mixtral: those models' published locality; benchmarks/common.force_routing).

`prefill`: pp512 and pp4096 (each prompt one chunk) of `offload` with 25 / 50 / 75 / 100% of
the experts resident, and of `gpu`, side by side in one run. The residency is what decode
leaves: the warm start, then a few decode steps of the routing that scatter each layer's
share over its experts. A streamed chunk reads the resident experts from their slots and
copies the others; each row's floor is those experts' bytes (the statistics'
`prefill_streamed_bytes`) / measured H2D, plus gpu's time for the same prompt, and the ratio
is the row's time over it (copies overlapped with compute perfectly would go under it by up
to the smaller of the two).

`prefill/multi-turn`: one conversation, a system prompt (2,000 tokens) then turns of a user
message and the model's answer; turn t's prompt is turn t-1's plus its answer and a new user
message. TTFT of turns 2..8 at 25% of the experts resident, with and without prefix caching
(`--no-enable-prefix-caching`), each with the tokens it computed and the GiB it streamed.

GPU only: without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from benchmarks.common import (add_results_flag, add_routing_flag, command_line, force_routing, free_engine_memory,
                               gpu_main, h2d_bandwidth, markdown_table, report, routed_section, routing_note,
                               share_slots)
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

PREFILL_HEADER = ["prompt tokens", "strategy", "experts resident", "resident per layer (min-max)", "tok/s", "ms",
                  "GiB streamed", "floor ms", "time / floor", "vs gpu"]
TURN_HEADER = ["turn", "prompt tokens", "uncached: computed", "TTFT ms", "GiB streamed", "cached: computed",
               "TTFT ms", "GiB streamed", "cached / uncached"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    p.add_argument("--repeats", type=int, default=3, help="prefills per row, the fastest kept")
    p.add_argument("--scatter-steps", type=int, default=24,
                   help="decode steps of 4 requests after each warm start, scattering the residency")
    p.add_argument("--parts", nargs="+", choices=["prefill", "multi-turn", "profile"], default=["prefill", "multi-turn"],
                   help="profile: one prefill of the shortest length by gpu and by offload at 100%% resident under "
                        "torch.profiler, the ops by device time printed side by side (no RESULTS section)")
    p.add_argument("--turn-share", type=float, default=0.25, help="multi-turn: share of the experts resident")
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-tokens", type=int, default=100)
    p.add_argument("--answer-tokens", type=int, default=100)
    add_routing_flag(p)
    add_results_flag(p)
    return p.parse_args(argv)


def make_engine(config_dir, args, strategy, max_len, prefix_caching=False, **options):
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    ec = EngineConfig(model=config_dir, load_format="dummy", hf_overrides={"num_hidden_layers": args.layers},
                      moe_strategy=strategy, moe_collect_stats=strategy == "offload", max_running_requests=4,
                      max_prefill_tokens=max_len, max_model_len=max_len + 8, num_tokens=2 * (max_len + 64) + 4096,
                      enable_prefix_caching=prefix_caching, **options)
    engine = Engine(ec)
    force_routing(engine, args.routing, args.routing_seed)
    engine.runner.recapture_graphs()  # the decode graphs draw the routes too
    return engine


def _sync(engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def streamed_bytes(engine) -> int:
    return engine.runner.strategy.stats().get("prefill_streamed_bytes", 0)


def time_to_first_token(engine, prompt: list[int], max_tokens: int = 1):
    """(seconds from adding `prompt` to its first token, the request): the steps it takes are
    its prefill and nothing else (no other request runs)."""
    from moeferry.sampling import SamplingParams

    _sync(engine)
    start = time.perf_counter()
    req = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while not req.output_ids:
        engine.step()
    _sync(engine)
    return time.perf_counter() - start, req


def scatter_residency(engine, steps: int, gen) -> None:
    """`steps` decode steps of 4 requests under the benchmark's routing: each layer keeps a scattered
    share of the slots, as a server's decode leaves it."""
    from moeferry.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for _ in range(4):
        engine.add_request(torch.randint(engine.mc.vocab_size, (16,), generator=gen).tolist(), params)
    while engine.has_work:
        engine.step()


def timed_prefill(engine, length: int, repeats: int, gen) -> tuple[float, int]:
    """(fastest seconds to the first token of a new `length`-token prompt, bytes it streamed)."""
    runs = []
    for _ in range(repeats):
        before = streamed_bytes(engine)
        seconds, _ = time_to_first_token(engine, torch.randint(engine.mc.vocab_size, (length,), generator=gen).tolist())
        while engine.has_work:
            engine.step()
        runs.append((seconds, streamed_bytes(engine) - before))
    return min(runs)


def residency(engine) -> tuple[float, str]:
    """(share of every expert resident, the fewest-most resident experts of a layer)."""
    per_layer = (engine.runner.strategy.store.cache.slot_of >= 0).sum(dim=1).tolist()
    return sum(per_layer) / (len(per_layer) * engine.mc.num_experts), f"{min(per_layer)}-{max(per_layer)}"


def prefill_records(config_dir, args) -> list[dict]:
    """One record per (prompt length, strategy, share): seconds, bytes streamed, residency."""
    longest = max(args.lengths)
    records = []
    engine = make_engine(config_dir, args, "gpu", longest)
    gen = torch.Generator().manual_seed(0)
    timed_prefill(engine, min(args.lengths), 1, gen)  # compile and warm up
    for length in args.lengths:
        seconds, moved = timed_prefill(engine, length, args.repeats, gen)
        records.append(dict(length=length, strategy="gpu", share=1.0, spread="-", seconds=seconds, bytes=moved))
    del engine
    free_engine_memory()
    engine = make_engine(config_dir, args, "offload", longest)
    strategy = engine.runner.strategy
    for share in args.shares:
        strategy.store.build_cache(share_slots(engine, share))
        engine.runner.recapture_graphs()  # the graphs hold the pool's pointers
        scatter_residency(engine, args.scatter_steps, gen)
        resident, spread = residency(engine)
        timed_prefill(engine, min(args.lengths), 1, gen)
        for length in args.lengths:
            seconds, moved = timed_prefill(engine, length, args.repeats, gen)
            records.append(dict(length=length, strategy="offload", share=resident, spread=spread, seconds=seconds,
                                bytes=moved))
            print(records[-1], flush=True)
    del engine, strategy
    free_engine_memory()
    return records


def profile_prefills(config_dir, args) -> None:
    """Where a streamed prefill at 100% resident spends its time against gpu's: one prefill of
    the shortest length each, profiled, the top ops by device time printed."""
    from torch.profiler import ProfilerActivity, profile

    length, gen = min(args.lengths), torch.Generator().manual_seed(0)
    for strategy in ("gpu", "offload"):
        engine = make_engine(config_dir, args, strategy, length)
        if strategy == "offload":
            engine.runner.strategy.store.build_cache(share_slots(engine, 1.0))
            engine.runner.recapture_graphs()
            scatter_residency(engine, args.scatter_steps, gen)
        timed_prefill(engine, length, 2, gen)  # compile and warm up
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            seconds, _ = timed_prefill(engine, length, 1, gen)
        print(f"### {strategy}: {length}-token prefill, {seconds * 1e3:.2f} ms to the first token")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=25), flush=True)
        del engine
        free_engine_memory()


def prefill_rows(records: list[dict], h2d: float) -> list[list]:
    gpu = {r["length"]: r["seconds"] for r in records if r["strategy"] == "gpu"}
    rows = []
    for r in sorted(records, key=lambda r: (r["length"], r["strategy"] == "gpu", r["share"])):
        floor = r["bytes"] / h2d + gpu.get(r["length"], 0.0)
        rows.append([r["length"], r["strategy"], f"{r['share']:.0%}", r["spread"], f"{r['length'] / r['seconds']:,.0f}",
                     f"{r['seconds'] * 1e3:.1f}", f"{r['bytes'] / 2**30:.2f}", f"{floor * 1e3:.1f}",
                     f"{r['seconds'] / floor:.2f}x", f"{gpu[r['length']] / r['seconds']:.2f}x" if r["length"] in gpu else "-"])
    return rows


def conversation(engine, args, gen) -> list[dict]:
    """One conversation of `args.turns` turns: per turn its prompt length, TTFT, the tokens its
    prefill computed (the prompt less the prefix-cache hit) and the bytes it streamed."""
    vocab = engine.mc.vocab_size
    history = torch.randint(vocab, (args.system_tokens,), generator=gen).tolist()
    turns = []
    for turn in range(1, args.turns + 1):
        prompt = history + torch.randint(vocab, (args.user_tokens,), generator=gen).tolist()
        hits, moved = engine.counters["prefix_cache_hit_tokens"], streamed_bytes(engine)
        seconds, req = time_to_first_token(engine, prompt, args.answer_tokens)
        hit = engine.counters["prefix_cache_hit_tokens"] - hits
        streamed = streamed_bytes(engine) - moved
        while engine.has_work:
            engine.step()
        turns.append(dict(turn=turn, prompt=len(prompt), computed=len(prompt) - hit, seconds=seconds, bytes=streamed))
        print(turns[-1], flush=True)
        history = prompt + req.output_ids
    return turns


def multi_turn_records(config_dir, args) -> dict[bool, list[dict]]:
    """{prefix caching on: the conversation's turns}, the same conversation both ways."""
    longest = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    out = {}
    for cached in (False, True):
        engine = make_engine(config_dir, args, "offload", longest, prefix_caching=cached)
        strategy = engine.runner.strategy
        strategy.store.build_cache(share_slots(engine, args.turn_share))
        engine.runner.recapture_graphs()
        scatter_residency(engine, args.scatter_steps, torch.Generator().manual_seed(1))
        timed_prefill(engine, args.user_tokens, 1, torch.Generator().manual_seed(2))  # compile and warm up
        out[cached] = conversation(engine, args, torch.Generator().manual_seed(3))
        del engine, strategy
        free_engine_memory()
    return out


def multi_turn_rows(turns: dict[bool, list[dict]]) -> list[list]:
    rows = []
    for plain, cached in zip(turns[False], turns[True]):
        if plain["turn"] < 2:
            continue
        rows.append([plain["turn"], plain["prompt"],
                     plain["computed"], f"{plain['seconds'] * 1e3:.1f}", f"{plain['bytes'] / 2**30:.2f}",
                     cached["computed"], f"{cached['seconds'] * 1e3:.1f}", f"{cached['bytes'] / 2**30:.2f}",
                     f"{cached['seconds'] / plain['seconds']:.0%}"])
    return rows


@gpu_main("bench_prefill", parse_args)
def main(argv, args) -> int:
    config_dir = write_config_dir(os.path.join(tempfile.mkdtemp(), "qwen3-30b-a3b"), QWEN3_30B_DIR_CONFIG)
    h2d = h2d_bandwidth()
    command = command_line("benchmarks.bench_prefill", argv)
    shape = (f"{args.layers} layers of Qwen3-30B-A3B (128 experts, top-8), bf16 dummy weights; "
             f"{routing_note(args.routing, args.routing_seed)} Measured H2D {h2d / 1e9:.1f} GB/s; residency after the warm start "
             f"and {args.scatter_steps} decode steps of 4 requests.")
    if "prefill" in args.parts:
        rows = prefill_rows(prefill_records(config_dir, args), h2d)
        report(routed_section("prefill", args.routing), "Prefill tok/s by share of the experts resident", command,
               markdown_table(PREFILL_HEADER, rows),
               f"{shape} Time to the first token of one prompt (one chunk, no other request, prefix caching off), "
               f"fastest of {args.repeats}. Floor: GiB streamed / H2D + gpu's time for the same prompt; the "
               "streamed GiB are the experts not resident (what crossed the link).", args.results)
    if "profile" in args.parts:
        profile_prefills(config_dir, args)
    if "multi-turn" in args.parts:
        rows = multi_turn_rows(multi_turn_records(config_dir, args))
        report(routed_section("prefill/multi-turn", args.routing), "Multi-turn chat TTFT with and without prefix caching", command,
               markdown_table(TURN_HEADER, rows),
               f"{shape} {args.turn_share:.0%} of the experts resident, streamed prefill "
               f"(--moe-prefill-demand-tokens 0). A {args.system_tokens}-token system prompt, then per turn a "
               f"{args.user_tokens}-token user message and the model's {args.answer_tokens}-token answer (random "
               "token ids, greedy); TTFT from adding the turn's prompt to its first token. A cached turn computes "
               "only what follows its cached prefix, but any chunk that routes to every expert streams every "
               "expert not resident: that floor (GiB streamed / H2D) is the same for both.", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
