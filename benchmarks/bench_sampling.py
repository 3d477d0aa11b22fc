"""Sampled against greedy decode (target: a sampled request decodes as fast as a
greedy one): whole engine steps of a dummy Qwen3-30B-A3B-shaped model, `gpu` strategy, at
several batch sizes, for greedy rows and for sampled rows with the parameters real clients
send (temperature 1 and top_p 0.95, the OpenAI defaults' neighbourhood; top_k 50 with
presence, frequency and repetition penalties), then the sampler kernel alone: microseconds per
call over a [B, V] float32 batch of logits against torch's argmax of the same logits, with the
floor of one read of the logits at the measured HBM bandwidth.

Routing matters even with every expert on the GPU: a step reads each distinct routed expert
once, and the dummy weights make greedy requests repeat one token, so a greedy batch routes
every row to the same few experts while sampled rows spread over all of them. Rows are
measured under two routings: `dummy` (the router as it is) and `uniform` (routes generated inside
the graph, benchmarks/common.force_routing, so every row routes at random and greedy and sampled
batches read the same experts: the ratio then measures sampling alone).
GPU only: without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from benchmarks.common import (MODEL_ROUTING, add_results_flag, command_line, force_routing, free_engine_memory,
                               gpu_main, hbm_bandwidth, markdown_table, pivot, replay_us, report, timed_decode,
                               unforce_routing)
from moeferry.routing.profiles import names as profile_names
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

CASES = {
    "greedy": {"temperature": 0.0},
    "top_p": {"temperature": 1.0, "top_p": 0.95},
    "top_k+penalties": {"temperature": 1.0, "top_k": 50, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                        "repetition_penalty": 1.1},
}
CASE_NAMES = {"greedy": "greedy", "top_p": "top_p 0.95", "top_k+penalties": "top_k 50 + penalties"}
CASES_NOTE = ("top_p 0.95: temperature 1, top_p 0.95; top_k 50 + penalties: temperature 1, top_k 50, presence 0.5, "
              "frequency 0.5, repetition 1.1.")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="time each row this many times, keep the fastest")
    p.add_argument("--kernel-replays", type=int, default=50)
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                   help="the sampling cases (greedy first: the ratios are to it)")
    p.add_argument("--parts", nargs="+", choices=["decode", "kernel"], default=["decode", "kernel"])
    p.add_argument("--routings", nargs="+", choices=[*profile_names(), "dummy"], default=["uniform", "dummy"],
                   help="dummy: the router as it is; else a generated routing profile (benchmarks/common.force_routing)")
    p.add_argument("--routing-seed", type=int, default=0, help="the generated routes' seed")
    add_results_flag(p)
    return p.parse_args(argv)


def make_engine(config_dir, args):
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    max_len = args.prompt_len + args.warmup + args.steps + 16
    ec = EngineConfig(model=config_dir, load_format="dummy", hf_overrides={"num_hidden_layers": args.layers},
                      moe_strategy="gpu", max_running_requests=max(args.batch), max_model_len=max_len,
                      num_tokens=(max_len + 16) * max(args.batch))
    return Engine(ec)


def decode_rows(engine, args, routing: str) -> list[list]:
    """[routing, batch, case, tok/s, ratio to greedy] for every batch and case, the fastest of
    the repeats, under `routing`."""
    from moeferry.sampling import SamplingParams

    forced = force_routing(engine, MODEL_ROUTING if routing == "dummy" else routing, args.routing_seed)
    engine.runner.recapture_graphs()  # the graphs bake in the router hooks
    rows = []
    for batch in args.batch:
        greedy_tok_s = None
        for name in args.cases:
            fields = CASES[name]
            params = SamplingParams(max_tokens=args.warmup + args.steps + 1, ignore_eos=True, seed=7, **fields)
            runs = [timed_decode(engine, batch, args.prompt_len, args.warmup, args.steps, lambda e: {}, params)
                    for _ in range(max(1, args.repeats))]
            tok_s = max(run["tok_s"] for run in runs)
            greedy_tok_s = greedy_tok_s or tok_s
            rows.append([routing, batch, CASE_NAMES[name], f"{tok_s:.1f}", f"{tok_s / greedy_tok_s:.3f}"])
            print(rows[-1], flush=True)
    unforce_routing(forced)
    return rows


def kernel_rows(args, vocab: int, hbm: float) -> list[list]:
    """[batch, case, sampler us, argmax us, floor us] of the sampler kernel alone, in a CUDA graph."""
    from moeferry.engine.cuda_graph import capture
    from moeferry.kernels.sampling import SamplingState, sample

    rows = []
    for batch in args.batch:
        logits = torch.randn(batch, vocab, device="cuda") * 3
        state = SamplingState.allocate(batch, vocab, 300, "cuda")
        row_slot = torch.arange(batch, dtype=torch.int32, device="cuda")
        positions = torch.full((batch,), 100, dtype=torch.int64, device="cuda")
        outs = {"logprobs_out": torch.empty_like(logits), "tokens_out": torch.empty(batch, dtype=torch.int64, device="cuda"),
                "token_logprobs_out": torch.empty(batch, device="cuda")}
        argmax_graph, _ = capture(lambda: torch.argmax(logits, dim=-1, out=outs["tokens_out"]))
        argmax_us = replay_us(argmax_graph, args.kernel_replays)
        floor_us = logits.numel() * 4 / hbm * 1e6
        for name in args.cases:
            for slot in range(batch):
                state.assign(slot, seed=slot, full_logprobs=False, prompt_ids=range(0, vocab, 97), **CASES[name])
            graph, _ = capture(lambda: sample(logits, row_slot, positions, state, **outs))
            rows.append([batch, CASE_NAMES[name], f"{replay_us(graph, args.kernel_replays):.1f}", f"{argmax_us:.1f}",
                         f"{floor_us:.1f}"])
            print(rows[-1], flush=True)
        del logits, state, outs
        torch.cuda.empty_cache()
    return rows


def decode_table(rows: list[list]) -> str:
    """One row per (routing, batch): each case's tok/s, beside greedy's the ratio to it."""
    groups, cases = pivot(rows, key=lambda r: (r[0], r[1]), across=lambda r: r[2])
    header = ["routing", "batch", *(f"{c} tok/s" if c == "greedy" else f"{c} tok/s (of greedy)" for c in cases)]
    return markdown_table(header, [[*k, *(g[c][3] if c == "greedy" else f"{g[c][3]} ({g[c][4]})" for c in cases)]
                                   for k, g in groups.items()])


def kernel_table(rows: list[list]) -> str:
    """One row per batch: the sampler's us per case, then argmax's and the floor."""
    groups, cases = pivot(rows, key=lambda r: r[0], across=lambda r: r[1])
    header = ["batch", *(f"sampler us: {c}" if i == 0 else c for i, c in enumerate(cases)), "argmax us",
              "floor us (one read)"]
    return markdown_table(header, [[b, *(g[c][2] for c in cases), g[cases[0]][3], g[cases[0]][4]]
                                   for b, g in groups.items()])


@gpu_main("bench_sampling", parse_args)
def main(argv, args) -> int:
    hbm = hbm_bandwidth()
    vocab = QWEN3_30B_DIR_CONFIG["vocab_size"]
    tables = []
    if "decode" in args.parts:
        cfg_dir = write_config_dir(os.path.join(tempfile.mkdtemp(), "qwen3-30b-a3b"), QWEN3_30B_DIR_CONFIG)
        engine = make_engine(cfg_dir, args)
        rows = [row for routing in args.routings for row in decode_rows(engine, args, routing)]
        tables.append(decode_table(rows))
        del engine
        free_engine_memory()
    if "kernel" in args.parts:
        tables.append(kernel_table(kernel_rows(args, vocab, hbm)))
    table = "\n\n".join(tables)
    report("sampling", f"Sampled vs greedy decode, {args.layers}-layer Qwen3-30B-A3B shape, gpu strategy, bf16",
           command_line("benchmarks.bench_sampling", argv), table,
           f"{CASES_NOTE} Whole engine steps ({args.steps} timed after {args.warmup} warm-up, fastest of {args.repeats}), "
           f"prompts of {args.prompt_len} random tokens, dummy weights; the kernel rows replay the sampler alone "
           f"in a CUDA graph over N(0, 3) logits, V = {vocab}, HBM {hbm / 1e12:.2f} TB/s measured.",
           args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
