"""OpenAI API shapes: request models (pydantic), the error body, and response builders.

Only what moeferry implements is accepted; unknown fields are ignored (clients send many),
but a field we cannot honour (n > 1, logprobs) is refused with 400 rather than ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moeferry.sampling import SamplingParams

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}


class APIError(Exception):
    """An error the client caused or must know about; rendered as OpenAI's error body
    `{"error": {"message", "type", "param", "code"}}` with `status` as the HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field (`messages.0.role`)."""
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ()) if not _is_union_tag(p)) or None
    message = err.get("msg", "invalid request")
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def _is_union_tag(loc_part) -> bool:
    """pydantic puts the union member tried into an error's location ("str", "list[int]")."""
    return isinstance(loc_part, str) and (loc_part in _SCALAR_TAGS or "[" in loc_part or "-" in loc_part)


_SCALAR_TAGS = {"str", "int", "float", "bool", "none", "TextPart", "StreamOptions"}


# ---- requests ------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    """`stream_options`: with include_usage, a last event (choices []) carries the usage."""

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The sampling fields shared by both endpoints (top_k, ignore_eos, stop_token_ids are
    extensions); `max_tokens` None means "up to the context" (chat) or 16 (completions)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = Field(None, gt=0)
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    user: str | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, "n > 1 is not supported: send one request per completion", param="n")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              max_tokens=max_tokens, stop=self.stop, stop_token_ids=list(self.stop_token_ids or []),
                              ignore_eos=self.ignore_eos)


class TextPart(BaseModel):
    """A text part of a message's content; other part types (images, audio) are refused."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; its content (a string, text parts, or null) becomes one string."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. Invariant after `check_supported`: at least one message;
    `max_completion_tokens` wins over the older `max_tokens`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    """POST /v1/completions: `prompt` is a string, a list of token ids, or a list holding
    one string; `max_tokens` defaults to 16 as in OpenAI's API."""

    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported", param="best_of")

    @property
    def requested_max_tokens(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens

    @property
    def text_or_ids(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


# ---- responses -----------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ChatFormat:
    """Builds chat.completion bodies and chat.completion.chunk events for one request."""

    def __init__(self, model: str):
        self.id, self.model, self.created = f"chatcmpl-{uuid.uuid4().hex}", model, int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def opening(self) -> dict | None:
        """The event sent before any text (the assistant role), or None."""
        return {**self._base("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]}

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        delta = {"content": text} if text else {}
        return {**self._base("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    def usage_chunk(self, used: dict) -> dict:
        return {**self._base("chat.completion.chunk"), "choices": [], "usage": used}

    def full(self, text: str, finish_reason: str, used: dict) -> dict:
        message = {"role": "assistant", "content": text}
        return {**self._base("chat.completion"),
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
                "usage": used}


class CompletionFormat(ChatFormat):
    """Builds text_completion bodies and stream events for one request."""

    def __init__(self, model: str):
        super().__init__(model)
        self.id = f"cmpl-{uuid.uuid4().hex}"

    def opening(self) -> dict | None:
        return None

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        return {**self._base("text_completion"),
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

    def usage_chunk(self, used: dict) -> dict:
        return {**self._base("text_completion"), "choices": [], "usage": used}

    def full(self, text: str, finish_reason: str, used: dict) -> dict:
        return {**self._base("text_completion"),
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
                "usage": used}
