"""SamplingParams: how one request picks its tokens and when it stops, and the check its values
pass before the request joins a batch (the server's requests and the offline API's alike).

The ranges below are the values' meaning, shared with the server's request models (which
declare them in /openapi.json); the server's limits on a request's size live in
server/protocol.py.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
import os
from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass, field

from moeferry.errors import ConfigError, InvalidRequest

SAMPLING_EPS = 1e-5  # a temperature below it is greedy (vLLM's _SAMPLING_EPS): 1/T would overflow
TOP_P_FLOOR = 1e-8  # a smaller top_p is raised to it: float32 rounds 1e-46 to 0.0, which keeps no token;
# at 1e-8 exactly the top token remains for any vocabulary under 10**8 (its probability is >= 1/V)
TOP_K_MAX = 2**31 - 1  # a device sampler holds top_k in an int32 (SGLang's "all" is 1 << 30)
TEMPERATURE_MAX = 100.0  # OpenAI caps at 2, vLLM not at all; past ~10 the draw is uniform already, and the
# sampler holds T and 1/T in float32 (1e300 does not fit)
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # vLLM and HF need > 0; beyond these, z / r leaves float32's range
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty (OpenAI)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # each logit_bias value (OpenAI)
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit signed integer (vLLM: torch.long)

MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI)
MAX_LOGPROBS = 20  # top log-probs per token (OpenAI's top_logprobs limit)
MAX_N = 16  # samples of one prompt per request

# The fields a checkpoint's generation_config.json may give defaults for, with the value a
# request that leaves one unset gets when the checkpoint gives none (the OpenAI API's: off).
MODEL_DEFAULTED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclass
class SamplingParams:
    """Sampling options of one request (the OpenAI API's fields, plus vLLM's extensions).

    temperature 0 (or below SAMPLING_EPS) is greedy; top_k 0 or -1 means off; top_p 1.0 means
    off. temperature, top_p, top_k, min_p and repetition_penalty may be left unset (None): the
    engine gives them the model's generation_config.json values, else MODEL_DEFAULTED's
    (`with_defaults`), so a value the caller set, even the neutral one, always wins over the
    model's. `seed` makes a sampled request reproducible; `stop` strings end the text before
    them; `stop_token_ids` end it after them, `ignore_eos` or not; `ignore_eos` keeps going past
    the end-of-sequence token until max_tokens. Penalties, min_p and logit_bias at their
    neutral values do nothing. `logprobs` None: no log-probs; k >= 0: each token's log-prob
    and the k most likely tokens' (engine/sampler.py says of which distribution).
    `prompt_logprobs` None: none; k >= 0: each prompt token's log-prob given the tokens before
    it, its rank, and the k most likely tokens' there (the model's raw distribution; the first
    token has none); such a request computes its whole prompt (no prefix cache). `n`: the
    number of samples of the prompt (the server makes one request of each). `structured`: a
    moeferry.structured.Constraint the output must match (a JSON schema, any JSON object, a
    regex, a choice of strings): the sampler only draws tokens that keep the text inside it,
    and the request stops once the text is complete.
    `skip_special_tokens` False keeps special tokens in the text (a tool-call syntax made of
    them is read from it), all but the end or stop token that finishes the request;
    `spaces_between_special_tokens` is the tokenizer's decode option of that name (slow
    tokenizers read it). `min_tokens`: no end token, stop token or stop string ends the request
    before that many tokens (the sampler cannot draw the end and stop tokens until then).
    `include_stop_str_in_output`: the stop string that ended the text stays at its end.
    `reasoning_tags`: a moeferry.structured.ReasoningTags; `structured` then applies to the
    answer after the model's reasoning (structured.ReasoningGate).

    Invariant after construction: every value is unset (MODEL_DEFAULTED's fields only) or in
    its range (else InvalidRequest naming the field), finite, and normalised (tiny temperature
    -> 0, tiny top_p -> TOP_P_FLOOR). A Request holds params with nothing unset.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    structured: "Constraint | None" = None  # noqa: F821 - moeferry.structured imports this module
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    reasoning_tags: "ReasoningTags | None" = None  # noqa: F821 - moeferry.structured imports this module

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()
        self.stop = [s for s in self.stop if s]
        if self.temperature is not None and self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        if self.top_p is not None:
            self.top_p = max(self.top_p, TOP_P_FLOOR)

    def validate(self) -> None:
        """Raise InvalidRequest for the first field out of its range (an unset one passes)."""
        if self.temperature is not None:
            _number("temperature", self.temperature, 0.0, TEMPERATURE_MAX)
        if self.top_p is not None:
            _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k is not None:
            _integer("top_k", self.top_k, -1, TOP_K_MAX)
        if self.min_p is not None:
            _number("min_p", self.min_p, 0.0, 1.0)
        _number("presence_penalty", self.presence_penalty, *PENALTY_RANGE)
        _number("frequency_penalty", self.frequency_penalty, *PENALTY_RANGE)
        if self.repetition_penalty is not None:
            _number("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        if len(self.logit_bias or {}) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias holds {len(self.logit_bias)} entries, at most {MAX_LOGIT_BIAS}",
                                 "logit_bias")
        for token, bias in (self.logit_bias or {}).items():
            _integer("logit_bias", token, 0, None)
            _number("logit_bias", bias, *LOGIT_BIAS_RANGE)
        if self.seed is not None:
            _integer("seed", self.seed, *SEED_RANGE)
        _integer("max_tokens", self.max_tokens, 1, None)
        _integer("min_tokens", self.min_tokens, 0, self.max_tokens)
        if not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequest("stop must be a string or a list of strings", "stop")
        for token in self.stop_token_ids:
            _integer("stop_token_ids", token, 0, None)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        _integer("n", self.n, 1, MAX_N)
        if self.structured is not None:
            from moeferry.structured import Constraint

            if not isinstance(self.structured, Constraint):
                raise InvalidRequest("structured must be a moeferry.structured.Constraint", "structured")

    def with_defaults(self, defaults: Mapping[str, float] | None = None) -> "SamplingParams":
        """These params with every unset field given its default: from `defaults` (checked and
        normalised values, as GenerationDefaults.sampling holds), else MODEL_DEFAULTED's.
        Returns self when none is unset; the set fields are not checked again."""
        unset = [name for name in MODEL_DEFAULTED if getattr(self, name) is None]
        if not unset:
            return self
        out = copy.copy(self)
        for name in unset:
            setattr(out, name, (defaults or {}).get(name, MODEL_DEFAULTED[name]))
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationDefaults:
    """What a checkpoint's generation_config.json says about serving it: `eos_token_ids` end
    every request (beside config.json's and the tokenizer's end token), and `sampling` holds
    the values of MODEL_DEFAULTED's fields a request that leaves them unset gets.

    Invariant: every value in `sampling` passed SamplingParams' checks. Other fields
    (do_sample, max_new_tokens, ...) are not read: like vLLM, a temperature given is used
    whatever do_sample says.
    """

    eos_token_ids: tuple[int, ...] = ()
    sampling: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def load(cls, model_dir: str, source: str = "auto", overrides: Mapping | None = None) -> "GenerationDefaults":
        """The defaults --generation-config `source` names (auto: the model's file; vllm: none;
        else the directory's file), with --override-generation-config's values over them
        (checked as the file's)."""
        base = cls() if source == "vllm" else cls.from_dir(model_dir if source == "auto" else source)
        if not overrides:
            return base
        unknown = sorted(set(overrides) - set(MODEL_DEFAULTED))
        if unknown:
            raise ConfigError(f"--override-generation-config: {', '.join(unknown)} not among "
                              f"{', '.join(MODEL_DEFAULTED)}")
        try:
            checked = SamplingParams(**overrides)
        except (InvalidRequest, TypeError) as exc:
            raise ConfigError(f"--override-generation-config: {exc}") from None
        return cls(base.eos_token_ids, {**base.sampling, **{name: getattr(checked, name) for name in overrides}})

    @classmethod
    def from_dir(cls, path: str) -> "GenerationDefaults":
        """Read `path`/generation_config.json (none: no defaults); ConfigError naming the file
        and the field when a value is not one a request could have."""
        file = os.path.join(path, "generation_config.json")
        if not os.path.isfile(file):
            return cls()
        try:
            with open(file, encoding="utf-8") as f:
                raw = json.load(f)
        except (ValueError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ConfigError(f"{file} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{file}: not a JSON object")
        given = [name for name in MODEL_DEFAULTED if raw.get(name) is not None]
        try:
            checked = SamplingParams(**{name: raw[name] for name in given})
        except InvalidRequest as exc:
            raise ConfigError(f"{file}: {exc}") from None
        eos = raw.get("eos_token_id")
        ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ConfigError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
        return cls(tuple(ids), {name: getattr(checked, name) for name in given})


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """The params of choice `choice` of an n-sample request: the same, but a seed of its own
    (derived from the request's, so a seeded request still gives the same n answers); the
    prompt's log-probs are computed by choice 0 alone (the others may use the prefix cache)."""
    if choice == 0:
        return params
    seed = None if params.seed is None else (params.seed + choice * _SEED_STRIDE + 2**63) % 2**64 - 2**63
    return dataclasses.replace(params, seed=seed, prompt_logprobs=None)


_SEED_STRIDE = 0x9E3779B97F4A7C15  # the golden ratio in 64 bits: choices' seeds far apart


def _number(name: str, value, low: float, high: float | None, low_open: bool = False) -> None:
    """`value` is a finite real number in [low, high] ((low, high] when `low_open`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}", name)
    if value < low or (low_open and value == low) or (high is not None and value > high):
        bound = f"in {'(' if low_open else '['}{low}, {high}]" if high is not None else \
            f"{'>' if low_open else '>='} {low}"
        raise InvalidRequest(f"{name} must be {bound}, got {value!r}", name)


def _integer(name: str, value, low: int, high: int | None) -> None:
    """`value` is an integer in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}", name)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(f"{name} must be {bound}, got {value}", name)
