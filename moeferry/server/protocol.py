"""OpenAI API shapes: the limits a request is held to, request models (pydantic), the error
body, and response builders.

Only what moeferry implements is accepted: every field of OpenAI's API and vLLM's extensions is
either honoured or, set away from its neutral value, refused with a 400 naming it
(NEUTRAL_UNSUPPORTED); a field neither knows is a 400 naming it too. Structured output (response_format, vLLM's guided_* and structured_outputs) is read
by moeferry/structured/api.py.
Every check here runs before the request reaches the engine.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moeferry.sampling import (LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, PENALTY_RANGE,
                               REPETITION_PENALTY_RANGE, SEED_RANGE, TEMPERATURE_MAX, TOP_K_MAX, InvalidRequest,
                               SamplingParams)

# ---- limits: every bound on one request's size, in one place ------------------------------
# (the ranges of the sampling values are the values' meaning: moeferry/sampling.py)
MAX_BODY_BYTES = 8 * 2**20  # the request body (413 past it); prompts are bounded by the context anyway
MAX_JSON_DEPTH = 64  # nesting of arrays and objects, checked before parsing: Python's parser recurses
# once per level (RecursionError near 1,000); an OpenAI request nests about 5 deep
MAX_STOP_STRINGS = 16  # OpenAI allows 4, vLLM any number; each is matched on the engine thread per token
MAX_STOP_CHARS = 256  # one stop string; no peer bounds it, real ones are a few characters
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids (a vLLM extension); a model's end tokens are a handful
MAX_LOGIT_BIAS_ENTRIES = MAX_LOGIT_BIAS
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs (OpenAI); chat's top_logprobs go to MAX_LOGPROBS
MAX_TOOLS = 128  # tools of one request (OpenAI's limit)
MAX_MESSAGES = 2048  # chat messages, or Responses input items, of one request
MAX_TOOL_CALLS = 128  # tool calls of one history message
MAX_CHARS_PER_TOKEN = 16  # a prompt's characters per token of the context, checked before tokenizing:
# text past context_limit * this cannot fit (tokenizers average 3-5 characters a token; runs of
# spaces or repeated punctuation reach 16 in code vocabularies)
MAX_METADATA_KEYS = 16  # `metadata` (OpenAI's limits)
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_BATCH_ANSWERS = 64  # a completions batch: prompts x n
MAX_CHAT_TEMPLATE_CHARS = 1 << 16  # a request's own chat template (vLLM's chat_template field)

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "server_error"}


class APIError(Exception):
    """An error the client caused or must know about; rendered as OpenAI's error body
    `{"error": {"message", "type", "param", "code"}}` with `status` as the HTTP status
    (and `headers`, e.g. Retry-After, on the response)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    """The inside of OpenAI's error body (documents APIError.body in /openapi.json)."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field (`messages.0.role`)."""
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ()) if not _is_union_tag(p)) or None
    message = err.get("msg", "invalid request").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        message = "not a field of this request (neither OpenAI's API nor vLLM's extensions have it here)"
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def check_prompt_chars(chars: int, context_limit: int, param: str) -> None:
    """A prompt of `chars` characters can fit `context_limit` tokens (MAX_CHARS_PER_TOKEN), or
    a 400: checked before tokenizing, whose cost grows with the text."""
    limit = context_limit * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise APIError(400, f"This model's maximum context length is {context_limit} tokens; the prompt has {chars} "
                            f"characters, more than {limit} ({MAX_CHARS_PER_TOKEN} per token) can fit.",
                       param=param, code="context_length_exceeded")


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """`metadata` within OpenAI's limits: MAX_METADATA_KEYS keys of MAX_METADATA_KEY_CHARS
    characters, values of MAX_METADATA_VALUE_CHARS."""
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA_KEYS:
        raise ValueError(f"at most {MAX_METADATA_KEYS} keys, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"a key has at most {MAX_METADATA_KEY_CHARS} characters, got one of {len(key)}")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"a value has at most {MAX_METADATA_VALUE_CHARS} characters, got one of {len(value)}")
    return metadata


def invalid_request(exc: InvalidRequest) -> APIError:
    return APIError(400, str(exc), param=exc.param)


# ---- the body ------------------------------------------------------------------------------
_ESCAPED = re.compile(rb"\\.", re.DOTALL)
_DEPTH_STEP = bytes(1 if c in b"[{" else 255 if c in b"]}" else 0 for c in range(256))  # +1, -1 as int8
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest, counted without parsing it (so a
    body nested 100,000 deep costs a scan, not a recursion): brackets inside strings are
    skipped by removing escapes, then every other quote-delimited run."""
    outside = b"".join(_ESCAPED.sub(b"", body).split(b'"')[::2])
    if not outside:
        return 0
    steps = np.frombuffer(outside.translate(_DEPTH_STEP), dtype=np.int8)
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def decode_json(body: bytes) -> object:
    """The body parsed as JSON; a 400 (code invalid_json) when it is not UTF-8 JSON (RFC 8259),
    nests deeper than MAX_JSON_DEPTH, holds NaN or Infinity, or holds a string that is not
    Unicode text (a lone UTF-16 surrogate, which no tokenizer can encode)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the body is not UTF-8 text: {exc}", code="invalid_json") from None
    if json_depth(body) > MAX_JSON_DEPTH:  # exact on UTF-8: its multi-byte sequences hold no ASCII byte
        raise APIError(400, f"the body nests arrays and objects more than {MAX_JSON_DEPTH} deep",
                       code="invalid_json")
    try:
        payload = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(body):
        _check_text(payload, ())
    return payload


def parse_request(model: type[BaseModel], payload: object) -> BaseModel:
    """A decoded body as the request `model`, or the 400 naming what is wrong: its counts
    (check_counts) before its entries are validated."""
    if not isinstance(payload, dict):
        raise APIError(400, "the body must be a JSON object")
    check_counts(payload, model.model_fields)
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise validation_error(exc) from None


def check_counts(payload: object, fields) -> None:
    """The lists a body may hold thousands of (messages, input items), among `fields` (the
    request model's), within MAX_MESSAGES, or a 400 naming the field: checked on the parsed
    JSON, before validating each entry."""
    if not isinstance(payload, dict):
        return
    for name in ("messages", "input"):
        items = payload.get(name) if name in fields else None
        if isinstance(items, list) and len(items) > MAX_MESSAGES:
            raise APIError(400, f"{name}: at most {MAX_MESSAGES} entries, got {len(items)}", param=name)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_text(value, path: tuple) -> None:
    """Every string (and key) under `value` encodes as UTF-8; depth is bounded by MAX_JSON_DEPTH."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            param = ".".join(str(p) for p in path) or None
            raise APIError(400, f"{param or 'the body'}: a string holds a lone UTF-16 surrogate, which is not "
                                f"Unicode text", param=param, code="invalid_json") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path)
            _check_text(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, (*path, i))


def _is_union_tag(loc_part) -> bool:
    """pydantic puts the union member tried into an error's location ("str", "list[int]")."""
    return isinstance(loc_part, str) and (loc_part in _SCALAR_TAGS or "[" in loc_part or "-" in loc_part)


_SCALAR_TAGS = {"str", "int", "float", "bool", "none", "TextPart", "StreamOptions", "NamedToolChoice"}


# ---- requests ------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    """`stream_options`: with include_usage, a last event (choices []) carries the usage."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: refused when true (check_supported)


_Penalty = Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])]
_Bias = Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]
_TokenId = Annotated[int, Field(ge=0)]


class SamplingFields(BaseModel):
    """The sampling fields shared by both endpoints (top_k, min_p, repetition_penalty,
    ignore_eos, stop_token_ids are vLLM's extensions); `max_tokens` None means "up to the
    context" (chat) or 16 (completions); temperature, top_p, top_k, min_p and
    repetition_penalty left out (or null) take the model's generation_config.json values, else
    the OpenAI API's (sampling.MODEL_DEFAULTED). Numbers must be finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    honoured: ClassVar[frozenset[str]] = frozenset()  # names of NEUTRAL_UNSUPPORTED this endpoint serves

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=TEMPERATURE_MAX)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=TOP_K_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: _Penalty = 0.0
    frequency_penalty: _Penalty = 0.0
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    logit_bias: dict[int, _Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None  # bounded by _bounded_stop (and so documented in server/openapi.py)
    stop_token_ids: list[_TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    max_tokens: int | None = Field(None, gt=0)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None  # an end user's identifier: OpenAI's, for abuse monitoring; no effect on the answer
    # vLLM's output controls
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    add_special_tokens: bool | None = None  # None: completions add the tokenizer's, chat does not
    request_id: str | None = Field(None, max_length=128)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # not computed for a stream (vLLM's)
    # refused unless neutral (NEUTRAL_UNSUPPORTED)
    use_beam_search: Any = None
    length_penalty: Any = None
    best_of: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    priority: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    # structured output (moeferry/structured/api.py): OpenAI's, and vLLM's extra-body names
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    structured_outputs: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """A field sent as null takes its default (OpenAI's API documents n, stream,
        presence_penalty, echo, ... as nullable)."""
        if isinstance(data, dict) and None in data.values():
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].default is None}
        return data

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        longest = max(map(len, strings), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got one of {longest}")
        return stop

    def check(self, context_limit: int | None = None) -> None:
        """Every check that needs only the body, before any work is done for the request: what
        the server cannot honour, the prompt's characters against what `context_limit` tokens
        can hold, then each sampling value against its range (SamplingParams)."""
        self.check_supported()
        if context_limit is not None:
            check_prompt_chars(self.prompt_chars(), context_limit, self.prompt_param)
        self.sampling_params(max_tokens=max(1, self.min_tokens))

    prompt_param: ClassVar[str] = "prompt"  # the field a prompt-size error names

    def prompt_chars(self) -> int:
        """The characters of text the prompt is made of (what tokenizing costs)."""
        return 0

    def check_supported(self) -> None:
        for name, neutral in NEUTRAL_UNSUPPORTED.items():
            if name in type(self).model_fields and name not in self.honoured and not neutral(getattr(self, name)):
                raise APIError(400, f"{name} is not supported by this server yet", param=name)
        if self.stream and self.prompt_logprobs:
            raise APIError(400, "prompt_logprobs are not available when stream is true (a stream returns none)",
                           param="prompt_logprobs")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise APIError(400, "stream_options.continuous_usage_stats is not supported by this server yet",
                           param="stream_options.continuous_usage_stats")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def logprob_count(self) -> int | None:
        """SamplingParams.logprobs: None, or how many top log-probs each token reports."""
        return None

    def structured_constraint(self):
        """The moeferry.structured.Constraint the request asks for, or None (400 when malformed)."""
        from moeferry.structured.api import constraint_from_request

        try:
            return constraint_from_request(self.response_format, self.guided_json, self.guided_regex,
                                           self.guided_choice, self.structured_outputs)
        except InvalidRequest as exc:
            raise invalid_request(exc) from None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        structured = self.structured_constraint()
        try:
            return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
                                  seed=self.seed, max_tokens=max_tokens, stop=self.stop,
                                  stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                                  logprobs=self.logprob_count, n=self.n, structured=structured,
                                  prompt_logprobs=None if self.stream else self.prompt_logprobs,
                                  min_tokens=self.min_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
                                  skip_special_tokens=self.skip_special_tokens,
                                  spaces_between_special_tokens=self.spaces_between_special_tokens)
        except InvalidRequest as exc:
            raise invalid_request(exc) from None


# The neutral values of the fields not honoured yet (what a client sends when it means "none").
NEUTRAL_UNSUPPORTED = {
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "use_beam_search": lambda v: not v,
    "length_penalty": lambda v: v in (None, 1, 1.0),
    "best_of": lambda v: v in (None, 1),
    "allowed_token_ids": lambda v: v is None,
    "bad_words": lambda v: not v,
    "priority": lambda v: v in (None, 0),
    "logits_processors": lambda v: not v,
    "return_tokens_as_token_ids": lambda v: not v,
    "return_token_ids": lambda v: not v,
    "cache_salt": lambda v: v is None,
    "kv_transfer_params": lambda v: v is None,
    "vllm_xargs": lambda v: not v,
    "guided_grammar": lambda v: v is None,
    "guided_decoding_backend": lambda v: v is None,
    "guided_whitespace_pattern": lambda v: v is None,
    "structural_tag": lambda v: v is None,
    "metadata": lambda v: not v,
    "store": lambda v: not v,
    "service_tier": lambda v: v in (None, "auto", "default"),
    "safety_identifier": lambda v: v is None,
    "prompt_cache_key": lambda v: v is None,
    "echo": lambda v: not v,  # chat's (vLLM); completions honour theirs
    "documents": lambda v: v is None,
    "mm_processor_kwargs": lambda v: not v,
    "verbosity": lambda v: v in (None, "medium"),
    "suffix": lambda v: not v,
    "prompt_embeds": lambda v: v is None,
}


class TextPart(BaseModel):
    """A text part of a message's content; other part types (images, audio) are refused."""

    type: Literal["text"]
    text: str


_FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]  # OpenAI's names (and dots, colons)


class FunctionDefinition(BaseModel):
    """A tool's function: its name, what it does, and the JSON schema of its parameters."""

    name: _FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    """One entry of `tools` (only functions exist)."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    """The function a named tool_choice names."""

    name: _FunctionName


class NamedToolChoice(BaseModel):
    """tool_choice naming the function the answer must call."""

    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    """A call an earlier assistant message made: `arguments` is its JSON text."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One entry of an assistant message's `tool_calls`; a `tool` message answers its `id`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat message; its content (a string, text parts, or null) becomes one string. An
    assistant message may carry the `tool_calls` it made, a `tool` message the
    `tool_call_id` it answers."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = None

    def chars(self) -> int:
        """The characters of text this message renders (content and calls)."""
        content = self.content
        text = len(content) if isinstance(content, str) else sum(len(p.text) for p in content or ())
        return text + sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())

    def as_template_input(self) -> dict:
        """The message as chat templates take it (transformers' convention): a message without
        tool fields is exactly {"role", "content"}; a call's arguments are a dict when their
        JSON text is an object (templates write them with `tojson`), else the text itself."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments_value(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


def _arguments_value(arguments: str):
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. Invariant after `check_supported`: at least one message;
    `max_completion_tokens` wins over the older `max_tokens`."""

    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # the chat template's inputs (vLLM's)
    chat_template: str | None = Field(None, max_length=MAX_CHAT_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None  # gpt-oss's template reads it
    include_reasoning: bool = True  # false: no reasoning_content in the answer
    echo: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    verbosity: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt set to false (the reply "
                                "continues the last message instead of starting a new one)",
                           param="continue_final_message")
        if self.continue_final_message and self.messages and self.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                           param="continue_final_message")
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        check_tool_choice(self.tool_dicts, self.tool_choice_value)

    prompt_param: ClassVar[str] = "messages"

    def prompt_chars(self) -> int:
        return sum(m.chars() for m in self.messages)

    @property
    def template_options(self) -> dict:
        """The chat template's rendering options (tokenizer.apply_chat_template's keywords)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "chat_template": self.chat_template,
                "template_kwargs": kwargs}

    @property
    def tool_dicts(self) -> list[dict] | None:
        """`tools` as the chat template and the tool plan take them (OpenAI's shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def tool_choice_value(self):
        """tool_choice as plain values: None, "none", "auto", "required" or the named dict."""
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    @property
    def logprob_count(self) -> int | None:
        """SamplingParams.logprobs: None, or how many top log-probs each token reports."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def check_tool_choice(tools: list[dict] | None, choice) -> None:
    """tool_choice other than "none" needs tools, a named one a function among them, and the
    tools' names are distinct (a call names one)."""
    names = [t["function"]["name"] for t in tools or []]
    if len(set(names)) != len(names):
        raise APIError(400, "two tools have the same name", param="tools")
    if choice in (None, "none", "auto"):
        return
    if not names:
        raise APIError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise APIError(400, f"tool_choice names the function `{choice['function']['name']}`, which is not among "
                            f"the tools", param="tool_choice")


class CompletionRequest(SamplingFields):
    """POST /v1/completions: `prompt` is a string, a list of token ids, or a batch of prompts (a
    list of strings or of token-id lists: choice i*n+j is sample j of prompt i); `echo` puts
    each prompt's text before its answer; `max_tokens` defaults to 16 as in OpenAI's API."""

    prompt: str | list[int] | list[Annotated[str, Field(min_length=1)]] | list[list[int]]
    honoured: ClassVar[frozenset[str]] = frozenset({"echo"})

    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: Any = None
    tools: Any = None  # a chat field: refused here rather than ignored
    prompt_embeds: Any = None

    def check_supported(self) -> None:
        if self.tools:
            raise APIError(400, "tools are taken by /v1/chat/completions, not /v1/completions", param="tools")
        super().check_supported()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) * self.n > MAX_BATCH_ANSWERS:
                raise APIError(400, f"a batch of {len(self.prompt)} prompts x n {self.n} exceeds "
                                    f"{MAX_BATCH_ANSWERS} answers", param="prompt")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs (the prompt's log-probs inside `logprobs`) is not supported "
                                "by this server yet: prompt_logprobs returns them", param="echo")

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_chars(self) -> int:
        """The longest text prompt's characters (each prompt of a batch must fit the context)."""
        return max((len(p) for p in self.prompts if isinstance(p, str)), default=0)

    @property
    def requested_max_tokens(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt a text or token ids."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a `prompt`, or chat `messages` rendered as the chat endpoint
    renders them (the template's options and tools included)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = Field(None, max_length=MAX_CHAT_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if self.messages is not None and not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")

    @property
    def template_options(self) -> dict:
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "chat_template": self.chat_template,
                "template_kwargs": dict(self.chat_template_kwargs or {})}

    @property
    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids to text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[_TokenId]


# ---- responses -----------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts the prompt tokens
    whose KV the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Choice:
    """One finished choice of a request: its text, why it stopped, its tokens' log-probs
    ([(token id, TokenLogprobs)], empty when not asked for), and its prompt's log-probs (the
    Request's: None first, then a PromptLogprobs per prompt token; None when not asked for)."""

    text: str
    finish_reason: str
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None


def prompt_logprobs_body(entries: list | None, token_text) -> list | None:
    """vLLM's `prompt_logprobs` of a prompt: null first, then per token {token id:
    {"logprob", "rank", "decoded_token"}}, the prompt token's entry first, then the most likely
    tokens' by rank (engine/sampler.py: PromptLogprobs.as_dict); None when not asked for."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(token): dataclasses.asdict(lp) for token, lp in entry.as_dict(token_text).items()}
            for entry in entries]


class ChatFormat:
    """Builds chat.completion bodies and chat.completion.chunk events for one request of
    `n` choices. `token_text(id)` is a token's text, for the log-probs. With a `tools` plan
    (tools/plan.py) that reads the answer, each choice's text goes through its own
    OutputStream: content, reasoning_content and tool_calls deltas, and finish_reason
    "tool_calls" for an answer that called a tool and stopped."""

    def __init__(self, model: str, token_text, with_logprobs: bool, tools=None, request_id: str | None = None):
        self.id, self.model, self.created = f"chatcmpl-{request_id or uuid.uuid4().hex}", model, int(time.time())
        self.token_text, self.with_logprobs = token_text, with_logprobs
        self.tools, self.outputs = tools, {}

    def _output(self, index: int):
        """Choice `index`'s OutputStream, or None when its text is the content."""
        if self.tools is None:
            return None
        if index not in self.outputs:
            self.outputs[index] = self.tools.output_stream()
        return self.outputs[index]

    @staticmethod
    def _finish_reason(output, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" and output is not None and output.called else finish_reason

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def opening(self, index: int) -> dict | None:
        """The event sent before a choice's text (the assistant role), or None."""
        return {**self._base("chat.completion.chunk"),
                "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]}

    def chunk(self, index: int, text: str, finish_reason: str | None, logprobs: list) -> dict | None:
        """The event of a choice's new text, or None when it says nothing yet (text held back)."""
        output = self._output(index)
        if output is None:
            delta = {"content": text} if text else {}
        else:
            delta = output.push(text, final=finish_reason is not None)
            finish_reason = self._finish_reason(output, finish_reason)
        if not delta and finish_reason is None and not logprobs:
            return None
        return {**self._base("chat.completion.chunk"),
                "choices": [{"index": index, "delta": delta, "logprobs": self.logprobs(logprobs),
                             "finish_reason": finish_reason}]}

    def usage_chunk(self, used: dict) -> dict:
        return {**self._base("chat.completion.chunk"), "choices": [], "usage": used}

    def full(self, choices: list[Choice], used: dict) -> dict:
        """The whole answer; with prompt log-probs, vLLM's `prompt_logprobs` beside `choices`."""
        body = {**self._base("chat.completion"), "choices": [self._whole(i, c) for i, c in enumerate(choices)],
                "usage": used}
        if choices and choices[0].prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_body(choices[0].prompt_logprobs, self.token_text)
        return body

    def _whole(self, index: int, choice: Choice) -> dict:
        output = self._output(index)
        message = {"content": choice.text} if output is None else output.message(choice.text)
        return {"index": index, "message": {"role": "assistant", **message}, "logprobs": self.logprobs(choice.logprobs),
                "finish_reason": self._finish_reason(output, choice.finish_reason)}

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def logprobs(self, tokens: list) -> dict | None:
        """OpenAI's chat `logprobs` of these (token id, TokenLogprobs), or None when not asked for."""
        if not self.with_logprobs:
            return None
        return {"content": [{**self._entry(t, lp.logprob), "top_logprobs": [self._entry(i, v) for i, v in lp.top]}
                            for t, lp in tokens], "refusal": None}


class CompletionFormat(ChatFormat):
    """Builds text_completion bodies and stream events for one request's choices, `n` per
    prompt; with `echo` (each prompt's text), a choice's text starts with its prompt's."""

    def __init__(self, model: str, token_text, with_logprobs: bool, request_id: str | None = None,
                 echo: list[str] | None = None, n: int = 1):
        super().__init__(model, token_text, with_logprobs)
        self.id = f"cmpl-{request_id or uuid.uuid4().hex}"
        self.offsets: dict[int, int] = {}  # choice -> characters of its text so far (text_offset)
        self.echo, self.n = echo, n

    def _echoed(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo is not None else ""

    def opening(self, index: int) -> dict | None:
        if not self._echoed(index):
            return None
        return {**self._base("text_completion"),
                "choices": [{"index": index, "text": self._echoed(index), "logprobs": None, "finish_reason": None}]}

    def chunk(self, index: int, text: str, finish_reason: str | None, logprobs: list) -> dict:
        return {**self._base("text_completion"),
                "choices": [{"index": index, "text": text, "logprobs": self.logprobs(logprobs, index),
                             "finish_reason": finish_reason}]}

    def usage_chunk(self, used: dict) -> dict:
        return {**self._base("text_completion"), "choices": [], "usage": used}

    def full(self, choices: list[Choice], used: dict) -> dict:
        """The whole answer; with prompt log-probs, each choice has vLLM's `prompt_logprobs`
        (its prompt's: choice i * n computed them)."""
        body = {**self._base("text_completion"),
                "choices": [{"index": i, "text": self._echoed(i) + c.text, "logprobs": self.logprobs(c.logprobs, i),
                             "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
                "usage": used}
        for i, choice in enumerate(body["choices"]):
            prompt = choices[i - i % self.n].prompt_logprobs
            if prompt is not None:
                choice["prompt_logprobs"] = prompt_logprobs_body(prompt, self.token_text)
        return body

    def logprobs(self, tokens: list, index: int = 0) -> dict | None:
        """OpenAI's completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset)."""
        if not self.with_logprobs:
            return None
        texts = [self.token_text(t) for t, _ in tokens]
        offsets, at = [], self.offsets.get(index, 0)
        for text in texts:
            offsets.append(at)
            at += len(text)
        self.offsets[index] = at
        return {"tokens": texts, "token_logprobs": [lp.logprob for _, lp in tokens],
                "top_logprobs": [{self.token_text(i): v for i, v in lp.top} for _, lp in tokens],
                "text_offset": offsets}
