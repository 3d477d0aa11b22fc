"""Command line: `moeferry serve|generate|bench`. Engine flags are built from EngineConfig's
fields (one flag per field), so the CLI and `LLM(**kwargs)` never drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing

from moeferry.config import ConfigError, EngineConfig

_CHOICES = {
    "moe_strategy": lambda: __import__("moeferry.moe.strategies", fromlist=["x"]).strategy_names(),
    "moe_cache_policy": lambda: ["lru", "lrfu", "layer_lru"],
    "load_format": lambda: ["auto", "safetensors", "dummy"],
    "dtype": lambda: ["auto", "float32", "bfloat16", "float16"],
    "device": lambda: ["auto", "cpu", "cuda"],
}


def _flag_type(field: dataclasses.Field):
    if field.name == "moe_prefill_demand_tokens":
        from moeferry.moe.prefill_policy import parse_demand_tokens

        return parse_demand_tokens
    hint = typing.get_type_hints(EngineConfig)[field.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: the flag parses X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is dict or typing.get_origin(hint) is dict:
        return json.loads
    return hint


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = _flag_type(f)
        if kind is bool:
            group.add_argument(flag, action="store_true", default=f.default)
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        choices = _CHOICES[f.name]() if f.name in _CHOICES else None
        group.add_argument(flag, type=kind, default=default, choices=choices, metavar=None if choices else f.name.upper())


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def _cmd_generate(args) -> int:
    from moeferry.llm import LLM
    from moeferry.sampling import SamplingParams

    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, stop=args.stop)
    prompt = args.prompt
    if args.chat:
        from moeferry.tokenizer.tokenizer import apply_chat_template

        prompt = apply_chat_template(llm.tokenizer, [{"role": "user", "content": args.prompt}])

    def show(out):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()

    result = llm.generate(prompt, params, on_output=show)[0]
    sys.stdout.write("\n")
    print(f"[{len(result.token_ids)} tokens, finish_reason={result.finish_reason}]", file=sys.stderr)
    return 0


def _cmd_serve(args) -> int:
    try:
        from moeferry.server.app import serve
    except ImportError as exc:
        print(f"moeferry serve needs the server extras (pip install 'moeferry[serve]'): {exc}", file=sys.stderr)
        return 2
    return serve(engine_config_from_args(args), args)


_BENCHMARKS = ("admission", "copy", "decode", "fused_moe", "attention", "ttft", "uva", "serve", "parity")


def _cmd_bench(args) -> int:
    """Run benchmarks/bench_<which>.py. The benchmarks live beside the package in a source
    checkout (they are not installed), so the checkout's root goes on sys.path."""
    import os
    import runpy

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "benchmarks", f"bench_{args.which}.py")):
        print(f"moeferry bench needs a source checkout: {root}/benchmarks/ not found", file=sys.stderr)
        return 2
    sys.path.insert(0, root)
    sys.argv = [f"bench_{args.which}"] + args.rest
    runpy.run_module(f"benchmarks.bench_{args.which}", run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeferry", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline, streaming it to the terminal")
    add_engine_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--stop", action="append", default=None)
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI API")
    add_engine_flags(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--log-interval", type=float, default=10.0)
    srv.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="run a benchmark of SPEC section 6")
    bench.add_argument("which", choices=_BENCHMARKS)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"moeferry: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
