"""Command line: `moeferry serve|generate|routing simulate`. Engine flags are built from EngineConfig's
fields (one flag per field, its help text and argument group declared beside the field,
choices from config.CHOICES), so the CLI and `LLM(**kwargs)` never drift apart, and both are
checked by EngineConfig.check. Every flag's help shows its default.

Invariant: a user's mistake (a flag's value, a model directory, a prompt the engine refuses)
ends the command with one argparse-style line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import sys
import types
import typing

from moeferry.config import CHOICES, Alias, ConfigError, EngineConfig
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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help says it in words (a None
    default that means something: "default: the model's") or the flag is required."""

    def _get_help_string(self, action):
        if "(default: " in (action.help or "") or action.required:
            return action.help
        return super()._get_help_string(action)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, with the help text and in the argument group that
    the field declares (config.option); vLLM's name of a flag is another option string of it,
    and a vLLM flag whose value is converted follows it in the same group."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(EngineConfig):
        name = f.metadata.get("group", "engine")
        group = groups.get(name) or groups.setdefault(name, parser.add_argument_group(name))
        flag, kind, text = "--" + f.name.replace("_", "-"), _flag_type(f), f.metadata.get("help")
        aliases = f.metadata.get("aliases", ())
        same = [a for a in aliases if isinstance(a, str)]
        if kind is bool:  # a flag on by default also gets its way off: --no-<flag>
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            group.add_argument(flag, *same, action=action, default=f.default, help=text)
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = CHOICES[f.name]() if f.name in CHOICES else None
            group.add_argument(flag, *same, dest=f.name, type=kind, default=default, choices=choices, help=text,
                               metavar=None if choices else f.name.upper())
        for alias in aliases:
            if isinstance(alias, Alias):
                group.add_argument(alias.flag, dest=_alias_dest(f.name), type=alias.kind, default=None,
                                   metavar=alias.flag[2:].replace("-", "_").upper(),
                                   help=f"{alias.text} (default: --{f.name.replace('_', '-')}'s)")


def _alias_dest(name: str) -> str:
    return f"alias_of_{name}"


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine options of the parsed flags (the commands `check()` them before loading): a
    converted vLLM flag gives its option's value, the positional MODEL gives --model's."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(EngineConfig):
        for alias in f.metadata.get("aliases", ()):
            given = getattr(args, _alias_dest(f.name), None) if isinstance(alias, Alias) else None
            if given is None:
                continue
            if values[f.name] != f.default:
                raise UsageError(f"{alias.flag} and --{f.name.replace('_', '-')} both set {f.name}: give one of them")
            values[f.name] = alias.convert(given, args)
    positional = getattr(args, "model_tag", None)
    if positional is not None:
        if values["model"] not in (None, positional):
            raise UsageError(f"the model is given twice: {positional} and --model {values['model']}")
        values["model"] = positional
    return EngineConfig(**values)


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


def add_model_positional(parser: argparse.ArgumentParser) -> None:
    """`moeferry serve MODEL`, as `vllm serve MODEL`: the same as --model."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model (default: --model's)")


def _cmd_routing_simulate(args) -> int:
    """A recorded trace replayed through the slot cache at each size and policy (routing/simulate.py)."""
    from moeferry.routing.simulate import (DEFAULT_COPY_CALL_US, DEFAULT_HOST_GBPS, HostSpeed, HostSplit,
                                           SimulationError, cache_sizes, h2d_bandwidth, report)
    from moeferry.routing.trace import RoutingTrace, TraceError

    if not (args.cache_gb or args.cache_slots or args.cache_fraction):
        raise UsageError("give at least one cache size: --cache-gb, --cache-slots or --cache-fraction")
    hybrid_only = [flag for flag, given in (("--host-gbps", args.host_gbps), ("--host-call-us", args.host_call_us))
                   if given]
    if args.host_share is None and hybrid_only:
        raise UsageError(f"{hybrid_only[0]} is read only with --host-share (a hybrid split)")
    hosts = [None] + ([HostSplit(args.host_share)] if args.host_share is not None else [])
    try:
        trace = RoutingTrace.read(args.trace)
        sizes = cache_sizes(trace.header, args.cache_gb, args.cache_slots, args.cache_fraction)
        results = []
        print(report(trace, sizes, args.policy, h2d=h2d_bandwidth(args.h2d_gbps), step_ms=args.step_ms,
                     lrfu_decay=args.lrfu_decay, prefill_demand_tokens=args.prefill_demand_tokens, hosts=hosts,
                     host_speed=HostSpeed(args.host_gbps or DEFAULT_HOST_GBPS, args.host_call_us or 0.0),
                     copy_call_us=DEFAULT_COPY_CALL_US if args.copy_call_us is None else args.copy_call_us,
                     results=results))
    except (TraceError, SimulationError) as exc:
        raise UsageError(str(exc)) from None
    if args.plot:
        from moeferry.routing.plot import plot_hit_rates

        try:
            plot_hit_rates(results, trace.header.num_moe_layers * trace.header.num_experts, args.plot,
                           title=trace.header.model or "")
        except ImportError as exc:
            raise UsageError(str(exc)) from None
        print(f"hit-rate curve written to {args.plot}")
    return 0


def _cmd_routing_fit(args) -> int:
    """Next-layer predictors fitted on windows of a text, for --moe-prefetch fitted (routing/predict.py)."""
    from moeferry.llm import LLM
    from moeferry.routing.predict import fit_on, windows

    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--text {args.text}: {getattr(exc, 'strerror', None) or exc}") from None
    llm = LLM(args.model, device=args.device, dtype="float32", max_prefill_tokens=4 * args.prompt_len)
    if llm.tokenizer is None:
        raise UsageError(f"{args.model} has no tokenizer to read --text with")
    ids = llm.tokenizer(text)["input_ids"]
    prompts = windows(ids, args.prompts, args.prompt_len)
    if not prompts:
        raise UsageError(f"--text {args.text}: {len(ids)} tokens, fewer than one window of --prompt-len "
                         f"{args.prompt_len}")
    fitted = fit_on(llm, prompts, args.hidden, args.ridge)
    try:
        fitted.save(args.output)
    except OSError as exc:
        raise UsageError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    kind = f"an MLP of {args.hidden}" if args.hidden else "a Linear"
    print(f"wrote {len(fitted.maps)} predictors ({kind} each) fitted on {len(prompts)} windows of {args.prompt_len} "
          f"tokens to {args.output}")
    return 0


def _cmd_routing_generate(args) -> int:
    """A trace of generated routes (routing/profiles.py), replayable by `routing simulate`."""
    from moeferry.routing.profiles import get_profile, write_trace

    if args.top_k > args.experts:
        raise UsageError(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    try:
        steps = write_trace(args.output, get_profile(args.profile), args.layers, args.experts, args.top_k,
                            args.tokens, rows=args.rows, seed=args.seed, expert_bytes=args.expert_bytes)
    except OSError as exc:
        raise UsageError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {steps} decode steps of {args.rows} request(s), {args.layers} layers x {args.experts} experts, "
          f"top-{args.top_k}, routing {args.profile}, to {args.output}")
    return 0


def add_routing_commands(sub) -> None:
    from moeferry.config import cache_policies
    from moeferry.routing.profiles import QWEN3_30B_EXPERT_BYTES
    from moeferry.routing.profiles import names as profile_names

    routing = sub.add_parser("routing", help="routing traces (--moe-record-routing or generated): size the expert "
                                             "cache")
    commands = routing.add_subparsers(dest="routing_command", required=True)
    gen = commands.add_parser(
        "generate", help="write a trace of generated routes (a routing profile), replayable by simulate",
        description="Writes decode steps of routes drawn under a routing profile (uniform; qwen3 and mixtral, "
                    "calibrated to those models' published reuse and LRU curves) in the trace format "
                    "--moe-record-routing writes, so `moeferry routing simulate` replays it.")
    gen.add_argument("--profile", choices=profile_names(), default="qwen3")
    gen.add_argument("--layers", type=bounded(int, 1), default=48, help="MoE layers")
    gen.add_argument("--experts", type=bounded(int, 1, 65536), default=128, help="experts per layer")
    gen.add_argument("--top-k", type=bounded(int, 1), default=8, help="experts routed per token")
    gen.add_argument("--tokens", type=bounded(int, 1), default=256, help="decode steps")
    gen.add_argument("--rows", type=bounded(int, 1, 4096), default=1, help="requests decoded together")
    gen.add_argument("--seed", type=bounded(int, 0), default=0)
    gen.add_argument("--expert-bytes", type=bounded(int, 1), default=QWEN3_30B_EXPERT_BYTES,
                     help="bytes one expert moves (default: a Qwen3-30B-A3B expert in bf16)")
    gen.add_argument("-o", "--output", required=True, help="the trace file to write")
    gen.set_defaults(func=_cmd_routing_generate)
    fit = commands.add_parser(
        "fit", help="fit next-layer expert predictors on a text, for --moe-prefetch fitted",
        description="Prefills windows of a text through the model, records each MoE layer's input beside the next "
                    "MoE layer's router scores, fits a predictor per pair of layers (a small MLP, or with --hidden 0 "
                    "a Linear by ridge regression) and writes them for --moe-prefetch-predictor. Their recall on "
                    "held-out text: benchmarks/bench_predictor.py.")
    fit.add_argument("model", help="a checkpoint directory or cached model id, as --model")
    fit.add_argument("--text", required=True, help="a UTF-8 text file like what the model will serve")
    fit.add_argument("--prompts", type=bounded(int, 1), default=200, help="windows of the text prefilled")
    fit.add_argument("--prompt-len", type=bounded(int, 2), default=128, help="tokens a window")
    fit.add_argument("--hidden", type=bounded(int, 0), default=512, help="the MLP's width (0: a Linear)")
    fit.add_argument("--ridge", type=bounded(float, 0.0), default=1e-3, help="--hidden 0: the fit's ridge")
    fit.add_argument("--device", default="cpu", help="where the model runs (cpu or cuda)")
    fit.add_argument("-o", "--output", required=True, help="the predictors file to write (safetensors)")
    fit.set_defaults(func=_cmd_routing_fit)
    sim = commands.add_parser(
        "simulate", help="replay a trace through the slot cache's admission: hit rates, copies, predicted tok/s",
        description="Replays a trace through the slot cache's own admission at each cache size and policy. "
                    "Predicted decode tok/s = decode tokens / (compute time + missed decode bytes / H2D bandwidth), "
                    "copies not overlapped; the copy floor is the second term per decode step.")
    sim.add_argument("trace", help="a file written by --moe-record-routing")
    sim.add_argument("--cache-gb", type=bounded(float, 0.0), nargs="+", default=[], help="GiB, as --moe-cache-gb")
    sim.add_argument("--cache-slots", type=bounded(int, 1), nargs="+", default=[], help="expert slots")
    sim.add_argument("--cache-fraction", type=bounded(float, 0.0, 1.0), nargs="+", default=[],
                     help="share of every MoE layer's experts")
    sim.add_argument("--policy", nargs="+", choices=cache_policies(), default=list(cache_policies()))
    sim.add_argument("--lrfu-decay", type=bounded(float, 1e-6, 1.0), default=0.5, help="as --moe-lrfu-decay")
    sim.add_argument("--prefill-demand-tokens", type=bounded(int, 0), default=None,
                     help="admit prefill steps of at most N tokens (default: those the recording engine admitted)")
    sim.add_argument("--h2d-gbps", type=bounded(float, 1e-3), default=None,
                     help="host-to-device GB/s (default: measured on this GPU, else 55, an H200's pinned H2D)")
    sim.add_argument("--step-ms", type=bounded(float, 0.0), default=None,
                     help="compute ms per decode step (default: the trace's own times if recorded under gpu)")
    sim.add_argument("--copy-call-us", type=bounded(float, 0.0), default=None,
                     help="a decode layer call's fixed cost of copying any expert, us: the wait around its DMA "
                          "copies (default 34, measured on an H100 host; 0 for the bytes alone)")
    sim.add_argument("--host-share", type=bounded(float, 0.0, 1.0), default=None,
                     help="also replay hybrid's route split: the host computes this share of each decode layer's "
                          "misses (as --moe-host-share), the rest copied and admitted (default: offload rows only)")
    sim.add_argument("--host-gbps", type=bounded(float, 1e-3), default=None,
                     help="with --host-share: the host kernel's GB/s of expert weights, for the hybrid rows' "
                          "channel time (default 116.6, an H100 host's)")
    sim.add_argument("--host-call-us", type=bounded(float, 0.0), default=None,
                     help="with --host-share: the host's fixed cost of a call that computes any expert, us "
                          "(default 0)")
    sim.add_argument("--plot", default=None, metavar="PNG",
                     help="also write the decode hit rate by cache size, one curve per policy, to this PNG "
                          "(needs matplotlib; default: none)")
    sim.set_defaults(func=_cmd_routing_simulate, command_parser=sim)


_DESCRIPTION = """Serve Mixture-of-Experts language models larger than the GPU's memory (experts in
pinned host memory, a GPU slot cache), over the OpenAI API or offline. `moeferry COMMAND
--help` lists a command's flags with their defaults."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeferry", description=_DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="the least severe log lines shown (INFO: start-up plan, one line per request)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,serve,routing}")
    _add_generate(sub)
    _add_serve(sub)
    add_routing_commands(sub)
    return parser


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate text offline, streaming it to the terminal",
                         description="Generate a continuation of --prompt (or, with --chat, a reply to it) and "
                                     "stream it to stdout.", formatter_class=HelpFormatter)
    prompt = gen.add_argument_group("prompt")
    prompt.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    prompt.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the chat template (--chat-template, else "
                             "the tokenizer's)")
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64, help="the most tokens to generate")
    sampling.add_argument("--temperature", type=float, default=None,
                          help="0 is greedy (default: the model's generation_config.json, else 0)")
    sampling.add_argument("--top-p", type=float, default=None,
                          help="sample among the most likely tokens up to this probability mass (default: the "
                               "model's generation_config.json, else 1: off)")
    sampling.add_argument("--top-k", type=int, default=None,
                          help="sample among the k most likely tokens; -1 or 0: off (default: the model's "
                               "generation_config.json, else off)")
    sampling.add_argument("--sampling-seed", type=int, default=None,
                          help="seed of the sampling: the same seed gives the same tokens (default: a random one)")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="keep generating past the end-of-sequence token, up to --max-tokens")
    sampling.add_argument("--stop", action="append", default=None,
                          help="end the text before this string; repeat the flag for several (default: none)")
    add_model_positional(gen)
    add_engine_flags(gen)
    gen.set_defaults(func=_cmd_generate, command_parser=gen)


def _add_serve(sub) -> None:
    from moeferry.reasoning import reasoning_parser_names
    from moeferry.tools import parser_names

    srv = sub.add_parser("serve", help="serve the OpenAI API over HTTP",
                         description="Serve the OpenAI API: /v1/chat/completions, /v1/completions and /v1/responses "
                                     "(streamed or not), /v1/models, /health, /v1/stats, /metrics and "
                                     "/openapi.json.",
                         formatter_class=HelpFormatter)
    server = srv.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    server.add_argument("--port", type=bounded(int, 0, 65535), default=8000, help="the TCP port to listen on")
    server.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on /v1 requests (default: $MOEFERRY_API_KEY, "
                             "else $VLLM_API_KEY, else no key)")
    server.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: the Hugging Face id, the directory's name, or "
                             "the built-in model's name)")
    server.add_argument("--log-interval", type=bounded(float, 0.0), default=10.0,
                        help="seconds between activity lines (requests, tokens/s, KV use); 0: none")
    server.add_argument("--tool-call-parser", default=None, choices=parser_names(),
                        help="how the model writes tool calls (default: its family's: hermes for Qwen and OLMoE, "
                             "mistral for Mixtral, deepseek_v3, openai for gpt-oss's harmony)")
    server.add_argument("--reasoning-parser", default=None, choices=reasoning_parser_names(),
                        help="how the model writes its reasoning (default: its family's: qwen3 for Qwen3, "
                             "deepseek_r1 for DeepSeek with <think> in its vocabulary, openai for gpt-oss)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command lines: tool_choice auto is always served")
    add_model_positional(srv)
    add_engine_flags(srv)
    srv.set_defaults(func=_cmd_serve, command_parser=srv)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, but an unknown flag is refused by its command's parser (its usage
    printed), naming the closest flag that command knows."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = getattr(args, "command_parser", parser)
        known = [s for action in command._actions for s in action.option_strings]
        flag = next((u for u in unknown if u.startswith("-")), unknown[0]).split("=")[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, UsageError) as exc:
        message = " ".join(str(exc).split("\n"))
        print(f"moeferry {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
