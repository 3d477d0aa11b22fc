"""Configuration: the model's shape (read from config.json through transformers) and the
engine's options (built once from the CLI or from LLM keyword arguments, then frozen), with
the one check of those options (`EngineConfig.check`)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import numbers
import os
import types
import typing
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, NamedTuple

from moeferry.errors import ConfigError

logger = logging.getLogger(__name__)


# ---- choices: every list of names comes from where the names are defined -------------------
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def strategy_names() -> list[str]:
    """The MoE strategies, from their registry (moe/strategies.py)."""
    from moeferry.moe.strategies import strategy_names as names

    return names()


def quantizations() -> tuple[str, ...]:
    """The expert formats a bf16 checkpoint's experts can be quantized to (moe/formats.py)."""
    from moeferry.moe.formats import QUANTIZATIONS

    return QUANTIZATIONS


def cache_policies() -> tuple[str, ...]:
    """The expert cache's admission policies: the one list, kept beside the admission oracle."""
    from moeferry.kernels.admission import POLICIES

    return tuple(POLICIES)


def _choices(module: str, name: str):
    """The choices `name` of `module` (a tuple, or a dict's keys), imported when first asked."""
    def names() -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(module), name))
    return names


KV_CACHE_DTYPES = ("auto",)  # the KV cache is held in --dtype
CHOICES = {"load_format": lambda: LOAD_FORMATS, "device": lambda: DEVICES, "dtype": lambda: DTYPES,
           "kv_cache_dtype": lambda: KV_CACHE_DTYPES,
           "quantization": quantizations,
           "moe_strategy": strategy_names, "moe_cache_policy": cache_policies,
           "moe_host_dispatch": _choices("moeferry.moe.host_channel", "DISPATCHES"),
           "moe_host_staging": _choices("moeferry.moe.host_channel", "STAGINGS"),
           "moe_host_schedule": _choices("moeferry.kernels.fused_moe.host", "SCHEDULES"),
           "moe_host_activations": _choices("moeferry.kernels.fused_moe.host", "ACTIVATIONS_PRECISIONS"),
           "moe_uva_block_assignment": _choices("moeferry.kernels.fused_moe", "BLOCK_ASSIGNMENTS"),
           "moe_prefetch": _choices("moeferry.moe.prefetch", "PREFETCH_MODES"),
           "moe_prefetch_copy": _choices("moeferry.moe.prefetch", "PREFETCH_COPIES"),
           "moe_miss_copy": _choices("moeferry.moe.stores", "MISS_COPIES")}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ---- ranges: every numeric option's, in one table -------------------------------------------
class Bound(NamedTuple):
    """[low, high] (low excluded when `low_open`; no upper bound when `high` is None)."""

    low: float
    high: float | None = None
    low_open: bool = False

    def holds(self, value) -> bool:
        return (value > self.low if self.low_open else value >= self.low) and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}]"


RANGES = {
    "seed": Bound(0, 2**32 - 1),  # the dummy weights' generators take seed * 1000 + layer: keep it in 64 bits
    "tensor_parallel_size": Bound(1),
    "memory_ratio": Bound(0, 1, low_open=True),
    "gpu_memory_utilization": Bound(0, 1, low_open=True),
    "cpu_offload_gb": Bound(0, low_open=True),
    "vram_reserve_mb": Bound(0),
    "kv_reserve_tokens": Bound(1),
    "page_size": Bound(1),
    "num_tokens": Bound(1),
    "max_running_requests": Bound(1),
    "max_prefill_tokens": Bound(1),
    "max_model_len": Bound(2),  # one prompt token and one generated token
    "moe_cache_slots": Bound(1),
    "moe_cache_gb": Bound(0, low_open=True),
    "moe_lrfu_decay": Bound(0, 1, low_open=True),
    "moe_host_threads": Bound(0),
    "moe_host_share": Bound(0, 1),
    "moe_tuner_period": Bound(1),
    "moe_tuner_min_experts": Bound(0),
    "moe_prefetch_programs": Bound(0),
    "moe_prefetch_experts": Bound(0),
}

# The options only some strategies (or policies) read: set away from its default under any
# other, an option would be silently ignored, so it is refused, naming who reads it.
# (--moe-prefill-demand-tokens: moe/prefill_policy.validate_demand_prefill says it the same way.)
READ_BY = {
    "moe_cache_slots": ("moe_strategy", ("offload", "hybrid")),
    "moe_cache_gb": ("moe_strategy", ("offload", "hybrid")),
    "moe_cache_policy": ("moe_strategy", ("offload", "hybrid")),
    "moe_lrfu_decay": ("moe_cache_policy", ("lrfu",)),
    "moe_collect_stats": ("moe_strategy", ("offload", "uva", "hybrid", "cpu")),
    "moe_host_threads": ("moe_strategy", ("hybrid", "cpu")),
    "moe_host_share": ("moe_strategy", ("hybrid",)),
    "moe_host_dispatch": ("moe_strategy", ("hybrid", "cpu")),
    "moe_host_staging": ("moe_strategy", ("hybrid", "cpu")),
    "moe_host_schedule": ("moe_strategy", ("hybrid", "cpu")),
    "moe_host_activations": ("moe_strategy", ("hybrid", "cpu")),
    "moe_timeline": ("moe_strategy", ("hybrid",)),
    "moe_prefetch": ("moe_strategy", ("offload", "hybrid")),
    "moe_prefetch_programs": ("moe_prefetch", ("router", "fitted")),
    "moe_prefetch_copy": ("moe_prefetch", ("router", "fitted")),
    "moe_miss_copy": ("moe_strategy", ("offload", "hybrid")),
    "moe_prefetch_experts": ("moe_prefetch", ("router", "fitted")),
    "moe_prefetch_predictor": ("moe_prefetch", ("fitted",)),
    "moe_tuner_period": ("moe_strategy", ("hybrid",)),
    "moe_tuner_min_experts": ("moe_strategy", ("hybrid",)),
    "moe_uva_block_assignment": ("moe_strategy", ("uva",)),
    "cpu_offload_gb": ("moe_strategy", ("offload", "hybrid")),
}


DEVELOPER = "MoE (developer)"  # the group of options that tune how MoE parts run, not what they compute


@dataclass(frozen=True)
class Alias:
    """Another engine's flag (vLLM's) for an option, whose value means something else here:
    `convert(value, options)` is the option's value, `options` the other parsed options (an
    argparse Namespace); `kind` parses the flag's text."""

    flag: str
    kind: Callable
    convert: Callable[[Any, Any], Any]
    text: str


def option(default, group: str, text: str, aliases: tuple[str | Alias, ...] = ()):
    """An EngineConfig field with its CLI help `text` and argument `group` beside it (the CLI
    builds its flags from them); a callable `default` is a default factory. `aliases`: vLLM's
    names of the same flag (a string: the same value; an Alias: a value converted)."""
    metadata = {"help": text, "group": group, "aliases": aliases}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option; CLI flags and `LLM(**kwargs)` map one to one onto these fields,
    each declared with its help text and argument group (`option`).

    Invariant: built once and never mutated; derived values are properties. `check()` is
    the one validation of the options (the Engine runs it before building anything; with the
    ModelConfig, it also fits them to the model).
    """

    model: str | None = option(None, "model", "a checkpoint directory, a Hugging Face model id found in the local "
                               "Hugging Face cache (HF_HUB_CACHE or HF_HOME; nothing is downloaded), or the built-in "
                               "model's name (default: moeferry-tiny-moe, the built-in model trained on Austen; moeferry-tiny-random: a random one)")
    load_format: str = option("auto", "model", "auto or safetensors: the checkpoint's *.safetensors; dummy: random "
                                               "weights of config.json's shape (benchmarks, no weights needed)")
    hf_overrides: dict[str, Any] = option(dict, "model", "a JSON object merged into config.json, e.g. "
                                                         "'{\"num_hidden_layers\": 4}'")
    tokenizer: str | None = option(None, "model", "the tokenizer's directory or cached Hugging Face id (default: "
                                                  "the model's)")
    revision: str | None = option(None, "model", "the snapshot of a Hugging Face model id to serve from the local "
                                                 "cache: a branch, tag or commit (default: main)")
    trust_remote_code: bool = option(False, "model", "accepted for vLLM's command lines; no checkpoint code is ever "
                                                     "run (every family is built in)")
    generation_config: str = option("auto", "model", "sampling defaults: auto reads the model's "
                                                     "generation_config.json, vllm uses none, a directory reads its "
                                                     "generation_config.json")
    override_generation_config: dict[str, Any] = option(dict, "model", "a JSON object over those defaults, e.g. "
                                                                       "'{\"temperature\": 0.6}'")
    chat_template: str | None = option(None, "model", "a Jinja chat template file used instead of the tokenizer's by "
                                                      "the chat endpoint, generate --chat and LLM.chat (default: the "
                                                      "tokenizer's)")
    quantization: str | None = option(None, "model", "quantize the routed experts of a bf16 checkpoint at load: fp8 "
                                                     "(block FP8, 128x128 scales, as FP8 checkpoints store them; half "
                                                     "the bytes per expert), int4 (W4A16, groups of 128, "
                                                     "compressed-tensors' layout; about a quarter) or mxfp4 "
                                                     "(FP4 E2M1 values with an E8M0 scale per 32, gpt-oss's layout; "
                                                     "as many bytes as int4); a quantized checkpoint is read in its own "
                                                     "format without it")
    dtype: str = option("auto", "runtime", "the weights' and activations' dtype; auto: bfloat16 on a GPU, float32 "
                                           "on the CPU")
    device: str = option("auto", "runtime", "auto: cuda when torch sees a GPU, else cpu")
    tensor_parallel_size: int = option(1, "runtime", "vLLM's name: ranks (one process and one GPU each) serving "
                                                     "together; the dense part (attention, dense layers, KV cache, "
                                                     "router, shared experts) is replicated on every rank and the "
                                                     "routed experts are split across ranks, each holding 1/N of "
                                                     "every MoE layer's experts under its own --moe-strategy "
                                                     "(docs/multi_gpu.md)", aliases=("-tp",))
    seed: int = option(0, "model", "seed of the dummy weights (--load-format dummy) and of torch")
    moe_strategy: str = option("gpu", "MoE", "where the routed experts live: gpu keeps them on the GPU; offload in "
                                             "pinned host memory behind a GPU slot cache; uva reads them from pinned "
                                             "host memory in place; cpu computes them on the host; hybrid is offload "
                                             "with the host computing a share of the misses (docs/offload.md)")
    moe_cache_slots: int | None = option(None, "MoE", "offload or hybrid: experts the GPU slot cache holds (default: as many "
                                                      "as the memory plan leaves room for, at most every expert)")
    moe_cache_gb: float | None = option(None, "MoE", "offload or hybrid: the slot cache's size in GiB, instead of "
                                                     "--moe-cache-slots (default: what the memory plan leaves)")
    moe_cache_policy: str = option("layer_lru", "MoE", "offload or hybrid: which cached expert a miss replaces "
                                                       "(docs/offload.md, Policies)")
    moe_lrfu_decay: float = option(0.5, "MoE", "--moe-cache-policy lrfu: how much a past use still counts, in "
                                               "(0, 1]")
    moe_prefetch: str = option("off", "MoE", "offload or hybrid: while a decode layer computes, copy the experts "
                                             "the next layer's router predicts from this layer's input (router), "
                                             "or fitted predictors do (fitted: --moe-prefetch-predictor), or not "
                                             "(off); a wrong guess costs copies, never tokens (docs/offload.md, "
                                             "Prefetch)")
    moe_prefetch_predictor: str | None = option(None, "MoE", "--moe-prefetch fitted: the predictors file `moeferry "
                                                             "routing fit` wrote for this model")
    moe_collect_stats: bool = option(False, "MoE", "offload, uva, hybrid or cpu: count the expert cache's hits, misses and routes "
                                                   "(in /v1/stats and /metrics); a little time per step")
    moe_host_threads: int = option(0, "MoE", "cpu or hybrid: threads of the host expert kernel (0: one per "
                                             "physical core, less the one that drives the GPU, shared among "
                                             "the ranks of --tensor-parallel-size)")
    moe_host_share: float | None = option(None, "MoE", "hybrid: the share of each step's missed experts computed on "
                                                       "the host (default: from the two channels' speeds, measured "
                                                       "at start-up)")
    moe_host_activations: str = option("int8", "MoE", "cpu or hybrid: the tokens' precision in the host kernel's "
                                                      "dots over int4 and mxfp4 experts: int8 (quantized per group, "
                                                      "integer dots: 4-bit weights read at memory speed; held-out "
                                                      "perplexity within a thousandth of the GPU path's) or bf16 "
                                                      "(exact, the GPU's arithmetic; docs/host_channel.md)")
    moe_prefill_demand_tokens: int | str = option(0, "MoE", "offload, hybrid or cpu: a prefill chunk of at most this many tokens "
                                                            "loads only the experts it routes to, a longer one streams "
                                                            "every expert not resident; 0: always stream; auto: decided "
                                                            "per chunk from the routing and the cache")
    moe_record_routing: str | None = option(None, "MoE", "a file: every step's routed experts per MoE layer, "
                                                         "recorded under any strategy, for `moeferry routing "
                                                         "simulate` (docs/offload.md; at most 1 GiB)")
    memory_ratio: float = option(0.9, "memory", "share of the GPU memory free after the weights that the plan may "
                                                "use (expert slots, KV cache, buffers)")
    gpu_memory_utilization: float | None = option(None, "memory", "vLLM's: share of the GPU's whole memory this "
                                                                  "engine may hold, weights included, instead of "
                                                                  "--memory-ratio (default: --memory-ratio's plan)")
    cpu_offload_gb: float | None = option(None, "memory", "vLLM's: GiB of experts kept in host memory instead of on "
                                                          "the GPU; the expert cache holds the rest (--moe-strategy "
                                                          "offload unless hybrid is given; default: "
                                                          "--moe-cache-gb's plan)")
    kv_cache_dtype: str = option("auto", "memory", "the KV cache's dtype; auto: --dtype's (the only choice)")
    vram_reserve_mb: int = option(1024, "memory", "MiB of GPU memory the plan leaves free, for CUDA graphs and "
                                                  "allocator slack")
    kv_reserve_tokens: int | None = option(None, "memory", "KV cache tokens reserved before the expert cache is sized "
                                                           "(default: --max-running-requests contexts of "
                                                           "--max-model-len; of at most 8192 tokens when not given)")
    page_size: int = option(16, "memory", "tokens per KV cache page")
    num_tokens: int | None = option(None, "memory", "the KV cache's size in tokens (default: from the memory plan; "
                                                    "16384 on the CPU)",
                                    aliases=(Alias("--num-gpu-blocks-override", int, lambda n, o: n * o.page_size,
                                                   "vLLM's: the KV cache's size in pages of --page-size tokens, "
                                                   "as --num-tokens pages x --page-size"),))
    max_running_requests: int = option(8, "scheduling", "requests decoded together in one step (and the largest "
                                                        "CUDA graph's batch)", aliases=("--max-num-seqs",))
    max_prefill_tokens: int = option(2048, "scheduling", "prompt tokens prefilled in one step; a longer prompt is "
                                                         "prefilled in chunks", aliases=("--max-num-batched-tokens",))
    max_model_len: int | None = option(None, "scheduling", "the most tokens (prompt + output) one request may hold "
                                                           "(default: the model's max_position_embeddings, lowered "
                                                           "with a warning to what the KV cache holds)")
    enable_prefix_caching: bool = option(True, "scheduling", "reuse the KV pages of a prompt prefix another "
                                                             "request computed (docs/requests.md)")
    async_scheduling: bool = option(True, "scheduling", "while every running request decodes and none waits to "
                                                        "be admitted, launch each decode step before the host reads "
                                                        "the previous one's tokens (the device reads them itself), "
                                                        "so the host's work between steps runs beside the device's "
                                                        "(docs/performance.md)")
    disable_cuda_graph: bool = option(False, "runtime", "decode eagerly instead of replaying captured CUDA graphs "
                                                        "(to debug or compare)", aliases=("--enforce-eager",))

    # developer options: how the MoE parts run, for benchmarks and debugging (--help shows them apart)
    moe_host_dispatch: str = option("mailbox", DEVELOPER, "cpu or hybrid on a GPU: how the host kernel is run: "
                                                          "mailbox (a worker thread polls pinned memory; kernels "
                                                          "post and wait) or host_function (a CUDA host function "
                                                          "on a side stream)")
    moe_host_staging: str = option("kernel", DEVELOPER, "cpu or hybrid on a GPU: how the host kernel's inputs and "
                                                        "outputs cross: kernel (a Triton kernel on the main "
                                                        "stream) or copy (copy_ on the side stream; host_function "
                                                        "dispatch only)")
    moe_host_schedule: str = option("dynamic", DEVELOPER, "cpu or hybrid: how the host kernel deals its work units "
                                                          "to its threads: dynamic (to whichever is free) or static "
                                                          "(in fixed blocks)")
    moe_prefetch_programs: int = option(0, DEVELOPER, "--moe-prefetch: at most this many programs in the gather "
                                                      "kernel that copies ahead (0: its full grid, one per SM); "
                                                      "fewer slow the compute beside them less (RESULTS "
                                                      "copy/beside-compute)")
    moe_prefetch_experts: int = option(0, DEVELOPER, "--moe-prefetch: at most this many of a layer's predicted "
                                                     "misses copied ahead, each row's most likely experts first "
                                                     "(0: all): copies ahead hide only behind one layer's compute, "
                                                     "and a wrong one delays the next layer's own copies")
    moe_prefetch_copy: str = option("dma", DEVELOPER, "--moe-prefetch on a GPU: how the lookahead's copies run: "
                                                      "dma (the copy engine, issued by a worker thread, so the SMs "
                                                      "stay with the compute) or gather (the gather kernel on a "
                                                      "side stream)")
    moe_miss_copy: str = option("dma", DEVELOPER, "offload or hybrid on a GPU: how a layer's missed experts are "
                                                  "copied into their slots: dma (the copy engine, one DMA copy a "
                                                  "row issued by a worker thread, at the link's speed; the gather "
                                                  "where there is no GPU) or gather (the gather kernel, every SM "
                                                  "reading pinned memory)")
    moe_timeline: bool = option(False, DEVELOPER, "hybrid: stamp the points of every decode MoE layer inside the "
                                                  "decode graph, read back by benchmarks (moe/timeline.py)")
    moe_tuner_period: int = option(8, DEVELOPER, "hybrid: decode steps between two updates of the host's share "
                                                 "from the host kernel's measured speed")
    moe_tuner_min_experts: int = option(8, DEVELOPER, "hybrid: the fewest host experts in a period that move the "
                                                      "host's share")
    moe_uva_block_assignment: str = option("auto", DEVELOPER, "uva: how the fused MoE assigns routes to blocks: "
                                                              "auto (the kernel's choice), sorted (each expert read "
                                                              "once per step) or naive (a block per route where "
                                                              "the small-batch rule allows it)")

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def check(self, mc: "ModelConfig | None" = None) -> "EngineConfig":
        """The one check of the options, before anything heavy is built; ConfigError (one line
        naming the flag) on the first mistake. Without `mc`: each option's type, choice and
        range, and the options together (a flag the chosen strategy would ignore is refused).
        With the model's config also: a dense model drops its MoE options (with a warning), the
        context is capped at the model's and said so, an expert cache under one layer's
        experts is refused. Returns the config to run with: --cpu-offload-gb under the default
        strategy chooses offload, as it does in vLLM."""
        for f in dataclasses.fields(self):
            _check_option(f.name, getattr(self, f.name))
        ec = self
        if ec.cpu_offload_gb is not None and ec.moe_strategy == _DEFAULTS["moe_strategy"]:
            ec = ec.replace(moe_strategy="offload")
        _check_together(ec)
        return ec if mc is None else _fit_to_model(ec, mc)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**kwargs)

    @cached_property
    def torch_device(self):
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda asked for, but torch sees no CUDA GPU")
        return torch.device(self.device)

    @cached_property
    def torch_dtype(self):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        return getattr(torch, self.dtype)

    @property
    def use_cuda_graph(self) -> bool:
        return self.torch_device.type == "cuda" and not self.disable_cuda_graph


_HINTS: dict[str, Any] = {}
_KIND_NAMES = {numbers.Integral: "an integer", numbers.Real: "a number", bool: "true or false", str: "a string",
               dict: "a JSON object"}


def _hint(name: str):
    """The option's type, X for `X | None` (None is checked by the caller)."""
    if not _HINTS:
        _HINTS.update(typing.get_type_hints(EngineConfig))
    hint = _HINTS[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else tuple(args)
    return hint


def _check_option(name: str, value) -> None:
    """One option alone: its type, its choice from the registry, its range."""
    if value is None and _DEFAULTS[name] is None:
        return
    if name == "moe_prefill_demand_tokens":
        from moeferry.moe.prefill_policy import parse_demand_tokens

        if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
            raise ConfigError(f"--moe-prefill-demand-tokens must be a token count or 'auto', got {value!r}")
        parse_demand_tokens(value)
        return
    hint = _hint(name)
    wanted = {int: numbers.Integral, float: numbers.Real, bool: bool, str: str}.get(hint, hint)
    if typing.get_origin(wanted) is dict:
        wanted = dict
    if not isinstance(value, wanted) or (isinstance(value, bool) and wanted is not bool):
        raise ConfigError(f"{flag(name)} must be {_KIND_NAMES.get(wanted, wanted)}, got {value!r}")
    if name in CHOICES and value not in CHOICES[name]():
        raise ConfigError(f"{flag(name)} {value!r} is unknown; choose one of: {', '.join(CHOICES[name]())}")
    bound = RANGES.get(name)
    if bound is not None and not (math.isfinite(value) and bound.holds(value)):
        raise ConfigError(f"{flag(name)} must be {bound}, got {value!r}")


def _check_together(ec: EngineConfig) -> None:
    """The options against each other."""
    if ec.num_tokens is not None and ec.num_tokens < ec.page_size:
        raise ConfigError(f"--num-tokens {ec.num_tokens} is less than one KV page of {ec.page_size} tokens "
                          f"(--page-size): give at least {ec.page_size}")
    if ec.chat_template is not None and not os.path.isfile(ec.chat_template):
        raise ConfigError(f"--chat-template {ec.chat_template}: no such file")
    predictor = ec.moe_prefetch_predictor
    if ec.moe_prefetch == "fitted" and (predictor is None or not os.path.isfile(predictor)):
        missing = "" if predictor is None else f" ({predictor}: no such file)"
        raise ConfigError(f"--moe-prefetch fitted needs --moe-prefetch-predictor, a file `moeferry routing fit` "
                          f"wrote{missing}")
    sizes = [flag(n) for n in ("moe_cache_slots", "moe_cache_gb", "cpu_offload_gb") if getattr(ec, n) is not None]
    if len(sizes) > 1:
        raise ConfigError(f"{' and '.join(sizes)} each size the expert cache: give one of them")
    if ec.gpu_memory_utilization is not None and ec.memory_ratio != _DEFAULTS["memory_ratio"]:
        raise ConfigError("--gpu-memory-utilization and --memory-ratio both size the memory plan: give one of them")
    if ec.generation_config not in ("auto", "vllm") and not os.path.isdir(ec.generation_config):
        raise ConfigError(f"--generation-config {ec.generation_config!r}: give auto, vllm or a directory")
    for name, (chooser, readers) in READ_BY.items():
        if getattr(ec, name) != _DEFAULTS[name] and getattr(ec, chooser) not in readers:
            raise ConfigError(f"{flag(name)} is read only by {flag(chooser)} {' or '.join(readers)}; under "
                              f"{flag(chooser)} {getattr(ec, chooser)} it would be ignored: drop it, or choose "
                              f"{' or '.join(readers)}")
    _check_ranks(ec)
    trace = ec.moe_record_routing
    if trace is not None and (not trace or os.path.isdir(trace)
                              or not os.path.isdir(os.path.dirname(os.path.abspath(trace)))):
        raise ConfigError(f"--moe-record-routing {trace!r}: give a file path in an existing directory")
    from moeferry.moe.host_compute import channel_options
    from moeferry.moe.prefill_policy import validate_demand_prefill

    validate_demand_prefill(ec)
    channel_options(ec)  # the host channel's options together (the mailbox stages by kernel only)
    ec.torch_dtype  # noqa: B018 - resolves --device and --dtype (ConfigError: cuda asked for, none seen)


# What the ranks of --tensor-parallel-size do not split yet: refused, naming the option.
NOT_SPLIT_ACROSS_RANKS = {"moe_prefetch": ("router", "fitted")}


def _check_ranks(ec: EngineConfig) -> None:
    """--tensor-parallel-size against the other options (and against the GPUs torch sees)."""
    ranks = ec.tensor_parallel_size
    if ranks == 1:
        return
    for name, values in NOT_SPLIT_ACROSS_RANKS.items():
        if getattr(ec, name) in values:
            raise ConfigError(f"--tensor-parallel-size {ranks} with {flag(name)} {getattr(ec, name)} is not built "
                              f"yet: use one rank, or another {flag(name)}")
    if ec.moe_record_routing is not None:
        raise ConfigError(f"--moe-record-routing with --tensor-parallel-size {ranks} is not built yet: record with "
                          f"one rank")
    if ec.torch_device.type == "cuda":
        import torch

        if torch.cuda.device_count() < ranks:
            raise ConfigError(f"--tensor-parallel-size {ranks} needs {ranks} GPUs, torch sees "
                              f"{torch.cuda.device_count()}")


def _fit_to_model(ec: EngineConfig, mc: "ModelConfig") -> EngineConfig:
    ranks = ec.tensor_parallel_size
    if ranks > 1 and (not mc.is_moe or mc.num_experts % ranks):
        raise ConfigError(f"--tensor-parallel-size {ranks} splits each MoE layer's routed experts evenly across "
                          f"ranks, but the model has {mc.num_experts}: give a size that divides them")
    if not mc.is_moe:
        ec = reset_moe_options_for_dense(ec)
    limit = mc.max_position_embeddings
    if ec.max_model_len is not None and ec.max_model_len > limit:
        logger.warning("--max-model-len %d exceeds the model's max_position_embeddings %d: serving a context of %d "
                       "tokens", ec.max_model_len, limit, limit)
        ec = ec.replace(max_model_len=limit)
    layer_experts = mc.num_experts // ranks  # a rank's cache holds its own share of each layer
    if mc.is_moe and ec.moe_cache_slots is not None and ec.moe_cache_slots < layer_experts:
        raise ConfigError(f"--moe-cache-slots {ec.moe_cache_slots}: the expert cache would hold fewer than one "
                          f"layer's {layer_experts} experts{' on a rank' if ranks > 1 else ''}; give at least "
                          f"{layer_experts}")
    return ec


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
# Options that only mean something for a model with routed experts.
_MOE_OPTION_DEFAULTS = {k: v for k, v in _DEFAULTS.items() if k.startswith("moe_")}


def reset_moe_options_for_dense(config: EngineConfig) -> EngineConfig:
    """A dense model ignores every MoE flag: reset them to their defaults, with a warning."""
    changed = {k: v for k, v in _MOE_OPTION_DEFAULTS.items() if getattr(config, k) != v}
    if not changed:
        return config
    logger.warning("dense model: ignoring MoE option(s) %s", ", ".join(f"--{k.replace('_', '-')}" for k in changed))
    return config.replace(**changed)


def _hf_field(name: str) -> property:
    """A ModelConfig attribute read straight from the transformers config's field `name`."""
    return property(lambda self: getattr(self.hf, name), doc=f"config.json's {name}")


def first_line(exc: BaseException) -> str:
    """An exception's message cut to one line (for a one-line ConfigError)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one checkpoint, read from its config.json by transformers.

    `hf` is the transformers PretrainedConfig (with --hf-overrides merged in); the fields
    here are the values the engine needs, normalised across families.
    """

    path: str
    hf: Any

    @classmethod
    def from_dir(cls, path: str, overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """Read and check `path`/config.json (with `overrides` merged in); ConfigError naming
        the file and the field on any mistake."""
        if not os.path.isdir(path):
            raise ConfigError(f"model directory {path!r} does not exist")
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ConfigError(f"{path!r} has no config.json: not a Hugging Face checkpoint directory")
        try:
            with open(cfg_file, encoding="utf-8") as f:
                raw = json.load(f)
        except (ValueError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ConfigError(f"{cfg_file} is not valid JSON: {exc}") from None
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        from moeferry.models.registry import CONFIG_ALIASES, family_names

        if model_type not in family_names():
            raise ConfigError(
                f"{cfg_file}: model_type {model_type!r} is not supported; supported: {', '.join(family_names())}"
            )
        from transformers import CONFIG_MAPPING, AutoConfig

        reader = CONFIG_MAPPING[CONFIG_ALIASES[model_type]] if model_type in CONFIG_ALIASES else AutoConfig
        try:
            hf = reader.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers rejects a bad field with any exception type
            raise ConfigError(f"{cfg_file}: transformers cannot read it: {first_line(exc)}") from None
        for key, value in (overrides or {}).items():
            setattr(hf, key, value)
        if "num_hidden_layers" in (overrides or {}) and getattr(hf, "layer_types", None):
            hf.layer_types = list(hf.layer_types)[: hf.num_hidden_layers]
        config = cls(path=path, hf=hf)
        config.check(cfg_file + (" with --hf-overrides" if overrides else ""))
        return config

    def check(self, source: str) -> None:
        """The shape the engine needs: positive sizes, kv heads grouping the query heads, and
        a router that picks at most every expert; ConfigError naming `source` and the field."""
        sizes = {"num_hidden_layers": self.hf.num_hidden_layers, "hidden_size": self.hidden_size,
                 "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                 "head_dim": self.head_dim, "vocab_size": self.vocab_size,
                 "max_position_embeddings": self.max_position_embeddings}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{source}: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{source}: num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")
        if self.num_experts:
            top_k = getattr(self.hf, "num_experts_per_tok", None)
            if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= self.num_experts:
                raise ConfigError(f"{source}: num_experts_per_tok must be in [1, {self.num_experts}] (the number of "
                                  f"experts), got {top_k!r}")
            self._check_groups(source)

    def _check_groups(self, source: str) -> None:
        """DeepSeek's group-limited routers: n_group divides the experts, topk_group picks
        among the groups."""
        groups = getattr(self.hf, "n_group", None)
        if not groups or groups <= 1:
            return
        if self.num_experts % groups:
            raise ConfigError(f"{source}: n_group {groups} does not divide the {self.num_experts} routed experts")
        top_groups = getattr(self.hf, "topk_group", None)
        if isinstance(top_groups, bool) or not isinstance(top_groups, int) or not 1 <= top_groups <= groups:
            raise ConfigError(f"{source}: topk_group must be in [1, {groups}] (n_group), got {top_groups!r}")

    model_type = _hf_field("model_type")
    hidden_size = _hf_field("hidden_size")
    num_layers = _hf_field("num_hidden_layers")
    num_heads = _hf_field("num_attention_heads")

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf, "num_key_value_heads", None) or self.num_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.hf, "head_dim", None) or self.hidden_size // self.num_heads

    vocab_size = _hf_field("vocab_size")

    @property
    def num_experts(self) -> int:
        return getattr(self.hf, "num_experts", None) or getattr(self.hf, "num_local_experts", 0) or 0

    def with_layer_experts(self, num_experts: int) -> "ModelConfig":
        """This model as an expert store holding `num_experts` of each MoE layer sees it (one
        rank's share under --tensor-parallel-size, moe/shard.py): every other field the model's."""
        return _LayerShareConfig(self.path, self.hf, num_experts)

    top_k = _hf_field("num_experts_per_tok")

    @property
    def moe_intermediate_size(self) -> int:
        return getattr(self.hf, "moe_intermediate_size", None) or self.hf.intermediate_size

    @property
    def max_position_embeddings(self) -> int:
        return getattr(self.hf, "max_position_embeddings", 4096)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = getattr(self.hf, "eos_token_id", None)
        if eos is None:
            return ()
        ids = eos if isinstance(eos, (list, tuple)) else [eos]
        return tuple(int(i) for i in ids if 0 <= int(i) < self.vocab_size)

    def is_moe_layer(self, layer_id: int) -> bool:
        if self.num_experts == 0:
            return False
        if layer_id in (getattr(self.hf, "mlp_only_layers", None) or []):
            return False
        if layer_id < (getattr(self.hf, "first_k_dense_replace", None) or 0):
            return False
        step = getattr(self.hf, "decoder_sparse_step", 1) or 1
        return (layer_id + 1) % step == 0

    @cached_property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layer_ids)

    @property
    def kv_cache_layout(self) -> tuple[int, int, bool]:
        """What one layer caches per token: (heads, head width, whether values are cached apart).
        Grouped-query attention caches K and V of its kv heads; multi-head latent attention
        (a `kv_lora_rank` in the config) one row of latent + rope key and no values."""
        rank = getattr(self.hf, "kv_lora_rank", None)
        if rank:
            return 1, rank + self.hf.qk_rope_head_dim, False
        return self.num_kv_heads, self.head_dim, True

    def sliding_window_of(self, layer_id: int) -> int | None:
        """The attention window of a layer in tokens, or None for full attention."""
        window = getattr(self.hf, "sliding_window", None)
        if not window:
            return None
        layer_types = getattr(self.hf, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[layer_id] == "sliding_attention" else None
        if getattr(self.hf, "use_sliding_window", True) is False:
            return None
        return window


@dataclass(frozen=True)
class _LayerShareConfig(ModelConfig):
    """A ModelConfig whose `num_experts` is a share of each layer's (ModelConfig.with_layer_experts)."""

    layer_experts: int = 0

    @property
    def num_experts(self) -> int:
        return self.layer_experts
