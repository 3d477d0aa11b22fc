"""Decode tokens/s with a JSON-schema grammar against without (target: >= 0.9x), for a dummy
Qwen3-30B-A3B-shaped model with a synthetic 151,936-token tokenizer (the built-in one's tokens
and random joins of them: tests.support.fixtures.write_wide_tokenizer).

Every request of a constrained run carries the same schema: an array of at least 1,000
objects of a bounded string, an integer in a range and an enum array, so no request completes
inside the timed steps and the masks cover keys, strings, numbers and enums. The whole engine
step is timed (scheduler, the masks on the host, their copy, graph replay, sampling), greedy,
the same prompts with and without the grammar.

GPU only: without CUDA it says so and exits 0 (tests/benchmarks runs `run` on a tiny model).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from benchmarks.common import (MODEL_ROUTING, add_results_flag, add_routing_flag, command_line, force_routing,
                               gpu_main, markdown_table, report, routed_section, routing_note, timed_decode)
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir, write_wide_tokenizer

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                  "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 1000}
HEADER = ["requests", "tok/s without grammar", "tok/s with grammar", "ratio", "ms/step without", "ms/step with"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--strategy", default="gpu")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="time each row this many times and keep the fastest")
    add_routing_flag(p, default=MODEL_ROUTING)
    add_results_flag(p)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def make_engine(model_dir: str, args):
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    ec = EngineConfig(model=model_dir, load_format="dummy", hf_overrides={"num_hidden_layers": args.layers},
                      moe_strategy=args.strategy, max_running_requests=max(args.batch),
                      max_model_len=args.prompt_len + args.warmup + args.steps + 16,
                      num_tokens=(args.prompt_len + 64) * max(args.batch) * 2)
    engine = Engine(ec)
    if force_routing(engine, args.routing, args.routing_seed) is not None:
        engine.runner.recapture_graphs()  # the decode graphs draw the routes
    return engine


def generated(engine) -> dict:
    return {"tokens": engine.counters["generation_tokens"]}


def fastest(engine, args, batch: int, params) -> dict:
    """timed_decode's fastest of `args.repeats` runs; RuntimeError when a request ended inside
    the timed steps (the batch would have shrunk under the timer)."""
    runs = [timed_decode(engine, batch, args.prompt_len, args.warmup, args.steps, generated, params)
            for _ in range(max(1, args.repeats))]
    if any(r["tokens"] != batch for r in runs):
        raise RuntimeError(f"batch {batch}: a request finished inside the timed steps")
    return min(runs, key=lambda run: run["step_s"])


def run(model_dir: str, args) -> list[list]:
    """The table's rows: per batch size, greedy decode timed without and with the grammar."""
    from moeferry.sampling import SamplingParams
    from moeferry.structured import json_schema_constraint

    engine = make_engine(model_dir, args)
    tokens = args.warmup + args.steps + 1
    free = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                                 structured=json_schema_constraint(SCHEMA))
    rows = []
    for b in args.batch:
        without, with_grammar = fastest(engine, args, b, free), fastest(engine, args, b, constrained)
        rows.append([b, f"{without['tok_s']:.1f}", f"{with_grammar['tok_s']:.1f}",
                     f"{with_grammar['tok_s'] / without['tok_s']:.3f}", f"{without['step_s'] * 1e3:.2f}",
                     f"{with_grammar['step_s'] * 1e3:.2f}"])
        print(rows[-1], flush=True)
    return rows


def model_dir_with_tokenizer(config: dict) -> str:
    path = write_config_dir(os.path.join(tempfile.mkdtemp(), "qwen3-30b-a3b"), config)
    return write_wide_tokenizer(path, config["vocab_size"])


@gpu_main("bench_structured", parse_args)
def main(argv, args) -> int:
    rows = run(model_dir_with_tokenizer(QWEN3_30B_DIR_CONFIG), args)
    notes = (f"{args.layers} layers, strategy {args.strategy}, bf16, dummy weights, a synthetic 151,936-token "
             f"tokenizer; prompt {args.prompt_len} tokens, {args.steps} timed steps, the fastest of {args.repeats} "
             "runs; greedy. With grammar: every request constrained by one JSON schema (an array of >= 1,000 "
             "objects: a string, a bounded integer, an enum array), xgrammar's masks computed on the host each "
             "step while the forward's graph runs, then copied and applied by the sampler's graph (a step with "
             "a mask replays two graphs, engine/cuda_graph.py). " + routing_note(args.routing, args.routing_seed))
    report(routed_section("structured", args.routing, MODEL_ROUTING), "Decode tokens/s with a JSON-schema grammar against without",
           command_line("benchmarks.bench_structured", argv), markdown_table(HEADER, rows), notes, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
