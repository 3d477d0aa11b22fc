"""Command line: `moeferry serve|generate|bench`. Engine flags are built from EngineConfig's
fields (one flag per field, choices from config.CHOICES), so the CLI and `LLM(**kwargs)` never
drift apart, and both are checked by EngineConfig.check.

Invariant: a user's mistake (a flag's value, a model directory, a prompt the engine refuses)
ends the command with one argparse-style line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing

from moeferry.config import CHOICES, ConfigError, EngineConfig
from moeferry.sampling import InvalidRequest


class UsageError(Exception):
    """A mistake on the command line: `main` prints it as `moeferry <command>: error: ...`."""


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def demand_tokens(text: str) -> int | str:
    from moeferry.moe.prefill_policy import parse_demand_tokens

    try:
        return parse_demand_tokens(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def bounded(kind, low, high=None):
    """An argparse type: `kind` in [low, high] (no upper bound when high is None)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if not low <= value <= (value if high is None else high):  # also false for NaN
            raise argparse.ArgumentTypeError(f"{text} is out of range: give a value in [{low}, {high}]"
                                             if high is not None else f"{text} is out of range: give a value >= {low}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _flag_type(field: dataclasses.Field):
    if field.name == "moe_prefill_demand_tokens":
        return demand_tokens
    hint = typing.get_type_hints(EngineConfig)[field.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: the flag parses X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is dict or typing.get_origin(hint) is dict:
        return json_object
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
        choices = CHOICES[f.name]() if f.name in CHOICES else None
        group.add_argument(flag, type=kind, default=default, choices=choices, metavar=None if choices else f.name.upper())


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine options of the parsed flags (the commands `check()` them before loading)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def _sampling_params(args):
    """The generate command's sampling flags as SamplingParams, checked before any loading."""
    from moeferry.sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              seed=args.sampling_seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                              stop=args.stop)
    except InvalidRequest as exc:
        raise UsageError(f"argument {_SAMPLING_FLAGS.get(exc.param, exc.param)}: {exc}") from None


_SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
                   "seed": "--sampling-seed", "max_tokens": "--max-tokens", "stop": "--stop", "prompt": "--prompt"}


def _prompt(llm, args) -> str | list[int]:
    """The prompt to run: the text, or with --chat the chat template's token ids."""
    if llm.tokenizer is None:
        raise UsageError(f"the model in {llm.engine.ec.model} has no tokenizer (tokenizer.json or "
                         f"tokenizer_config.json beside config.json), so --prompt cannot be read: copy the "
                         f"checkpoint's tokenizer files there")
    if not args.chat:
        return args.prompt
    from moeferry.tokenizer.tokenizer import apply_chat_template

    try:
        return apply_chat_template(llm.tokenizer, [{"role": "user", "content": args.prompt}])
    except ValueError as exc:
        raise UsageError(f"argument --chat: {exc}") from None


def _cmd_generate(args) -> int:
    from moeferry.llm import LLM

    if not args.prompt:
        raise UsageError("argument --prompt: the prompt is empty")
    params = _sampling_params(args)
    llm = LLM(**dataclasses.asdict(engine_config_from_args(args).check()))
    # A flag not given takes the model's generation_config.json value; without one, generate
    # stays greedy (the server's and LLM's fallback is the OpenAI API's temperature 1).
    params = params.with_defaults({"temperature": 0.0, **llm.engine.generation.sampling})
    prompt = _prompt(llm, args)

    def show(out):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()

    try:
        result = llm.generate(prompt, params, on_output=show)[0]
    except InvalidRequest as exc:  # refused before it ran: empty after encoding, longer than the context
        raise UsageError(f"argument {_SAMPLING_FLAGS.get(exc.param, '--prompt')}: {exc}") from None
    sys.stdout.write("\n")
    print(f"[{len(result.token_ids)} tokens, finish_reason={result.finish_reason}]", file=sys.stderr)
    return 0


def _cmd_serve(args) -> int:
    try:
        from moeferry.server.app import serve
    except ImportError as exc:
        print(f"moeferry serve needs the server extras (pip install 'moeferry[serve]'): {exc}", file=sys.stderr)
        return 2
    return serve(engine_config_from_args(args).check(), args)


_BENCHMARKS = ("admission", "copy", "decode", "sampling", "fused_moe", "attention", "linear", "ttft", "uva", "serve",
               "parity")


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
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline, streaming it to the terminal")
    add_engine_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--stop", action="append", default=None)
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI API")
    add_engine_flags(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=bounded(int, 0, 65535), default=8000)
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--log-interval", type=bounded(float, 0.0), default=10.0, help="seconds; 0: no activity lines")
    srv.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="run a benchmark of SPEC section 6")
    bench.add_argument("which", choices=_BENCHMARKS)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, UsageError) as exc:
        message = " ".join(str(exc).split("\n"))
        print(f"moeferry {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
