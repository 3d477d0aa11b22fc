"""POST /v1/responses (OpenAI's Responses API) and GET /v1/responses/{id}, over the chat path.

A request's input (a text, or a list of items: messages, function calls and their outputs)
becomes chat messages behind its `instructions` and, with `previous_response_id`, behind the
stored conversation of that response; it renders through the chat template, with the tools,
and its answer is read by the same tool plan as a chat answer (tools/plan.py). The answer
becomes output items (reasoning, message, function_call), whole or as the Responses API's
server-sent events. `text.format` is the chat path's `response_format`, checked as there.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, ClassVar, Literal, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from moeferry.server.engine_loop import SHUTDOWN
from moeferry.server.openai_api import OpenAIEndpoints, read_request, with_tools
from moeferry.server.protocol import (MAX_MESSAGES, MAX_TOOLS, APIError, ChatMessage, FunctionCall, ToolCall,
                                      _FunctionName, SamplingFields, check_metadata, check_tool_choice)
from moeferry.tools.plan import ToolPlan, plan_tools

RESPONSE_STORE_SIZE = 1024  # responses kept for previous_response_id; the oldest go first
RESPONSE_STORE_BYTES = 64 << 20  # and their conversations' text together (the oldest go first past it)
RESPONSE_TTL_S = 3600.0  # and none longer than this


# ---- the request ---------------------------------------------------------------------------
class InputText(BaseModel):
    """A text part of an input message (`output_text`: an earlier answer sent back)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    """A message of the input (`type` may be left out); its text parts join into one string."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class FunctionCallItem(BaseModel):
    """A call the model made in an earlier answer."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """The result of a call, sent back for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class ReasoningText(BaseModel):
    """A part of a reasoning item's summary or content."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["summary_text", "reasoning_text"]
    text: str


class ReasoningItem(BaseModel):
    """An earlier answer's reasoning, in OpenAI's shape and nothing else: accepted, not
    rendered (chat templates drop it), counted in the prompt's characters all the same."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list, max_length=MAX_MESSAGES)
    content: list[ReasoningText] | None = Field(None, max_length=MAX_MESSAGES)
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value) -> str:
    return (value.get("type") or "message") if isinstance(value, dict) else getattr(value, "type", "message")


InputItem = Annotated[Union[Annotated[InputMessage, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]


class FunctionTool(BaseModel):
    """A function tool as the Responses API declares it (flat, unlike chat's)."""

    type: Literal["function"]
    name: _FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    """tool_choice naming the function the answer must call (the Responses API's flat shape)."""

    type: Literal["function"]
    name: _FunctionName


class ReasoningOptions(BaseModel):
    """`reasoning`: its effort reaches the chat template; a summary is refused (none is written)."""

    model_config = ConfigDict(extra="forbid")

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(SamplingFields):
    """POST /v1/responses. Invariants after `check_supported`: one answer (n 1); the tools'
    names are distinct and tool_choice names one of them; `text.format` is checked as chat's
    `response_format` (`response_format` holds it in chat's shape)."""

    honoured: ClassVar[frozenset[str]] = frozenset({"store", "metadata"})

    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, gt=0)
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    reasoning: ReasoningOptions | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    prompt: Any = None
    conversation: Any = None

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, metadata):
        return check_metadata(metadata)

    prompt_param: ClassVar[str] = "input"

    def prompt_chars(self) -> int:
        return len(self.instructions or "") + sum(_chars(item) for item in self.input_items())

    def check_supported(self) -> None:
        self.response_format = chat_response_format(self.text)
        super().check_supported()
        for name, neutral in (("truncation", (None, "disabled")), ("background", (None, False)),
                              ("max_tool_calls", (None,)), ("top_logprobs", (None, 0)), ("prompt", (None,)),
                              ("conversation", (None,)), ("prompt_logprobs", (None,))):
            if getattr(self, name) not in neutral:
                raise APIError(400, f"{name} is not supported by this server yet", param=name)
        if self.include:
            raise APIError(400, "include is not supported by this server yet", param="include")
        if self.reasoning is not None and (self.reasoning.summary or self.reasoning.generate_summary):
            raise APIError(400, "reasoning summaries are not written by this server: the reasoning itself is "
                                "returned as a reasoning item", param="reasoning.summary")
        if self.n != 1:
            raise APIError(400, "a response has one answer: n must be 1", param="n")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise APIError(400, "input must hold at least one item", param="input")
        check_tool_choice(self.tool_dicts, self.tool_choice_value)

    @property
    def tool_dicts(self) -> list[dict] | None:
        """The tools in chat's shape ({"type": "function", "function": {...}})."""
        if not self.tools:
            return None
        return [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in self.tools]

    @property
    def tool_choice_value(self):
        choice = self.tool_choice
        return {"type": "function", "function": {"name": choice.name}} if isinstance(choice, NamedFunction) else choice

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def template_options(self) -> dict:
        """`reasoning.effort` as the chat template's reasoning_effort (gpt-oss's reads it)."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        return {"template_kwargs": {"reasoning_effort": effort}} if effort is not None else {}

    def input_items(self) -> list:
        return [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)


def chat_response_format(text: dict | None):
    """`text.format` in chat's `response_format` shape (None for plain text)."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return dict(fmt)


def chat_messages(items: list) -> list[ChatMessage]:
    """Input items as chat messages: consecutive function calls join the assistant message
    before them (or a new one), a call's output is a `tool` message, reasoning is dropped."""
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, InputMessage):
            messages.append(ChatMessage(role=item.role, content=_text_of(item.content)))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if not messages or messages[-1].role != "assistant":
                messages.append(ChatMessage(role="assistant", content=None))
            messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_text_of(item.output)))
    return messages


def _text_of(content) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _chars(item) -> int:
    """The characters of text an input item holds (what storing and rendering it cost)."""
    if isinstance(item, InputMessage):
        return len(_text_of(item.content))
    if isinstance(item, FunctionCallItem):
        return len(item.call_id) + len(item.name) + len(item.arguments)
    if isinstance(item, FunctionCallOutputItem):
        return len(item.call_id) + len(_text_of(item.output))
    if isinstance(item, ReasoningItem):
        return len(item.encrypted_content or "") + sum(len(p.text) for p in [*item.summary, *(item.content or [])])
    return 0


# ---- previous responses ----------------------------------------------------------------------
class ResponseStore:
    """The responses `previous_response_id` can name, in memory: each one's body and the whole
    conversation it ended (input items, then its output items).

    Invariants: at most `size` entries, and their sizes (characters of text: the
    conversation's and the body's output and instructions) sum to at most `max_bytes`: storing
    one more drops the oldest until both hold (an entry larger than `max_bytes` alone is not
    kept); an entry older than `ttl_s` is never returned (it is dropped when met); `get` of
    an unknown or expired id raises a 404 naming the parameter."""

    def __init__(self, size: int = RESPONSE_STORE_SIZE, ttl_s: float = RESPONSE_TTL_S, clock=time.monotonic,
                 max_bytes: int = RESPONSE_STORE_BYTES):
        self.size, self.ttl_s, self.clock, self.max_bytes = size, ttl_s, clock, max_bytes
        self.entries: OrderedDict[str, tuple[float, dict, list, list, int]] = OrderedDict()
        self.bytes = 0

    def put(self, body: dict, conversation: list, inputs: list | None = None) -> None:
        """Store a response: its body, the conversation it ended, and its own input items
        (as /input_items lists them); the oldest go first past `size` entries or `max_bytes`."""
        inputs = list(inputs or [])
        cost = _entry_size(body, conversation) + sum(_chars(item) for item in inputs)
        if cost > self.max_bytes:
            return
        self.entries[body["id"]] = (self.clock(), body, conversation, inputs, cost)
        self.bytes += cost
        while len(self.entries) > self.size or self.bytes > self.max_bytes:
            self.bytes -= self.entries.popitem(last=False)[1][4]

    def delete(self, response_id: str) -> None:
        self.get(response_id, "response_id")
        self.bytes -= self.entries.pop(response_id)[4]

    def inputs(self, response_id: str) -> list:
        self.get(response_id, "response_id")
        return self.entries[response_id][3]

    def get(self, response_id: str, param: str) -> tuple[dict, list]:
        """(the body, the conversation) of a stored response."""
        entry = self.entries.get(response_id)
        if entry is not None and self.clock() - entry[0] > self.ttl_s:
            self.bytes -= self.entries.pop(response_id)[4]
            entry = None
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found (unknown, not stored, or older than "
                                f"{self.ttl_s:g} s).", param=param, code="response_not_found")
        return entry[1], entry[2]


def _entry_size(body: dict, conversation: list) -> int:
    """A stored response's size: its conversation's characters, its output items' text and its
    echoed fields (instructions, metadata), plus a fixed cost per item."""
    output = sum(len(item.get("arguments", "")) + sum(len(p.get("text", "")) for p in item.get("content", []))
                 for item in body.get("output", []))
    echoed = len(body.get("instructions") or "") + sum(len(k) + len(v) for k, v in (body.get("metadata") or {}).items())
    return sum(_chars(item) for item in conversation) + output + echoed + 256 * (len(conversation) + 1)


# ---- the answer as output items -----------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_TEXT_KINDS = {  # output item type -> (its id prefix, its part type, the delta / done event types)
    "message": ("msg", "output_text", "response.output_text.delta", "response.output_text.done"),
    "reasoning": ("rs", "reasoning_text", "response.reasoning_text.delta", "response.reasoning_text.done"),
}


class ResponseOutput:
    """A response's output items, built from its answer's text as it grows, and the stream
    events that say so.

    Invariants: items are appended in the order their first text comes (reasoning, a message,
    function calls); one item at a time is open, and every event's item or part is a snapshot;
    the items after the final push are those of the non-streamed response of the same text
    (one push of it), except that text after a call opens a second message when streamed."""

    def __init__(self, tools: ToolPlan):
        self.output = tools.output_stream()
        self.items: list[dict] = []
        self.open = False
        self.call_items: dict[int, int] = {}  # tool call index -> output index

    def push(self, text: str, final: bool, status: str = "completed") -> list[dict]:
        """The events of `text` (more of the answer); `final` closes the open item with `status`."""
        delta = self.output.push(text, final) if self.output is not None else ({"content": text} if text else {})
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", []):
            events += self._call(call)
        if final:
            events += self._close(status)
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if not (self.open and self.items[-1]["type"] == kind):
            events += self._close("completed") + self._open_text(kind)
        index, item = len(self.items) - 1, self.items[-1]
        item["content"][0]["text"] += text
        delta_type = _TEXT_KINDS[kind][2]
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [{"type": delta_type, "item_id": item["id"], "output_index": index, "content_index": 0,
                          "delta": text, **extra}]

    def _open_text(self, kind: str) -> list[dict]:
        prefix, part_type = _TEXT_KINDS[kind][:2]
        item = {"type": kind, "id": _new_id(prefix), "status": "in_progress", "content": []}
        item.update({"role": "assistant"} if kind == "message" else {"summary": []})
        part = {"type": part_type, "text": "", **({"annotations": []} if kind == "message" else {})}
        events = self._add(item)
        item["content"].append(part)
        return events + [{"type": "response.content_part.added", "item_id": item["id"],
                          "output_index": len(self.items) - 1, "content_index": 0, "part": copy.deepcopy(part)}]

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = True
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def _call(self, call: dict) -> list[dict]:
        events = []
        if "id" in call:
            events += self._close("completed")
            item = {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
            events += self._add(item)
            self.call_items[call["index"]] = len(self.items) - 1
        index = self.call_items[call["index"]]
        fragment = call["function"].get("arguments", "")
        if fragment:
            self.items[index]["arguments"] += fragment
            events.append({"type": "response.function_call_arguments.delta", "item_id": self.items[index]["id"],
                           "output_index": index, "delta": fragment})
        return events

    def _close(self, status: str) -> list[dict]:
        if not self.open:
            return []
        self.open = False
        index, item = len(self.items) - 1, self.items[-1]
        item["status"] = status
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                       "name": item["name"], "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events = [{"type": _TEXT_KINDS[item["type"]][3], "item_id": item["id"], "output_index": index,
                       "content_index": 0, "text": part["text"], **extra},
                      {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "part": copy.deepcopy(part)}]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]


# ---- the endpoint ----------------------------------------------------------------------------------
class ResponsesEndpoint:
    """The handlers of /v1/responses, over the chat endpoints' checks, template and engine loop.

    Invariant: a response is stored (when `store`) only once it completed or stopped at its
    token limit, with the whole conversation it ended; a failed one is never stored."""

    def __init__(self, chat: OpenAIEndpoints, store: ResponseStore | None = None):
        self.chat, self.store = chat, store if store is not None else ResponseStore()

    async def create(self, request: Request):
        chat = self.chat
        body = await read_request(request, ResponsesRequest, chat.max_body_bytes, chat.pools,
                                  chat.body_timeout_s)
        chat.check_common(body)
        previous = self.store.get(body.previous_response_id, "previous_response_id")[1] \
            if body.previous_response_id is not None else []
        conversation = previous + body.input_items()
        tools = plan_tools(body.tool_dicts, body.tool_choice_value, body.parallel_tool_calls, chat.info.tool_parser)
        chars = len(body.instructions or "") + sum(_chars(item) for item in conversation)
        ids = await chat.prompt_work(request, chars, chat.chat_ids, self._messages(body, conversation),
                                     tools.template_tools, body.template_options)
        tools = chat.with_reasoning(tools, ids)
        params = with_tools(tools, body.sampling_params(chat.max_tokens_for(ids, body.requested_max_tokens, "input")))
        params = chat.structured_after_reasoning(ids, params)
        if params.structured is not None:
            await chat.compile(request, params.structured)
        handle = await chat.loop.submit(ids, params)
        answer = _Answer(self, body, tools, conversation)
        if body.stream:
            return StreamingResponse(answer.events(handle), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        answers = await self.chat.gather_answers(request, [handle])
        if answers is None:
            return Response(status_code=499)
        (choice,), (last,) = answers
        answer.output.push(choice.text, final=True, status=_status(last.finish_reason)[0])
        return JSONResponse(answer.finish(last))

    async def retrieve(self, response_id: str) -> dict:
        return self.store.get(response_id, "response_id")[0]

    async def delete(self, response_id: str) -> dict:
        self.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def input_items(self, response_id: str, order: Literal["asc", "desc"] = "desc", limit: int = 20,
                          after: str | None = None) -> dict:
        """OpenAI's list of a stored response's input items (newest first unless order=asc)."""
        items = list(self.store.inputs(response_id))
        if order == "desc":
            items.reverse()
        if after is not None:
            at = next((i for i, item in enumerate(items) if item["id"] == after), None)
            if at is None:
                raise APIError(404, f"no input item {after!r} in response {response_id}", param="after")
            items = items[at + 1:]
        page = items[:max(1, min(limit, 100))]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}

    @staticmethod
    def _messages(body: ResponsesRequest, conversation: list) -> list[dict]:
        """The chat template's messages: the instructions (this request's only: they are not
        carried over from a previous response), then the conversation."""
        system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
        return [m.as_template_input() for m in system + chat_messages(conversation)]


def _status(finish_reason: str | None) -> tuple[str, dict | None]:
    """A response's status and incomplete_details after its answer's finish_reason."""
    if finish_reason in ("length", SHUTDOWN):
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


class _Answer:
    """One response being answered: its id, its output, its body, and storing it when done."""

    def __init__(self, endpoint: ResponsesEndpoint, body: ResponsesRequest, tools: ToolPlan, conversation: list):
        self.endpoint, self.body, self.conversation = endpoint, body, conversation
        self.id, self.created = _new_id("resp"), int(time.time())
        self.output = ResponseOutput(tools)

    def response(self, status: str, usage: dict | None = None, incomplete: dict | None = None,
                 error: dict | None = None) -> dict:
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.endpoint.chat.info.name, "output": copy.deepcopy(self.output.items), "error": error,
                "incomplete_details": incomplete, "instructions": body.instructions, "metadata": body.metadata or {},
                "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
                "top_p": body.top_p, "tool_choice": _echo(body.tool_choice) or "auto",
                "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
                "max_output_tokens": body.max_output_tokens, "previous_response_id": body.previous_response_id,
                "store": body.store, "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled",
                "usage": usage}

    def finish(self, last) -> dict:
        """The finished response's body (stored when asked) after the answer's last Delta."""
        status, incomplete = _status(last.finish_reason)
        usage = {"input_tokens": last.prompt_tokens, "input_tokens_details": {"cached_tokens": last.cached_tokens},
                 "output_tokens": last.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": last.prompt_tokens + last.completion_tokens}
        done = self.response(status, usage, incomplete)
        if self.body.store:
            outputs = [_as_input_item(item) for item in self.output.items]
            inputs = [_input_item_body(item) for item in self.body.input_items()]
            self.endpoint.store.put(done, self.conversation + [item for item in outputs if item is not None], inputs)
        return done

    async def events(self, handle):
        """The response's server-sent events; a stream the client leaves aborts the request."""
        sequence = itertools.count()

        def sse(event: dict) -> str:
            event["sequence_number"] = next(sequence)
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        yield sse({"type": "response.created", "response": self.response("in_progress")})
        yield sse({"type": "response.in_progress", "response": self.response("in_progress")})
        async for delta in self.endpoint.chat.loop.stream(handle):
            if delta.error is not None and delta.finish_reason != SHUTDOWN:
                error = {"code": "server_error", "message": delta.error.message}
                yield sse({"type": "response.failed", "response": self.response("failed", error=error)})
                return
            final = delta.finish_reason is not None
            for event in self.output.push(delta.text, final, _status(delta.finish_reason)[0]):
                yield sse(event)
            if final:
                done = self.finish(delta)
                kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
                yield sse({"type": kind, "response": done})


def _input_item_body(item) -> dict:
    """An input item as GET /v1/responses/{id}/input_items lists it: with an id, and a message's
    text as content parts."""
    body = item.model_dump(exclude_none=True)
    if body.get("type", "message") == "message":
        body["type"] = "message"
        if isinstance(body["content"], str):
            body["content"] = [{"type": "input_text", "text": body["content"]}]
    return {"id": _new_id("msg" if body["type"] == "message" else "fc"), **body}


def _echo(value):
    return value.model_dump() if isinstance(value, BaseModel) else value


def _as_input_item(item: dict):
    """An output item as the input item that sends it back (reasoning is not sent back)."""
    if item["type"] == "message":
        return InputMessage(role="assistant", content=[InputText(type="output_text", text=item["content"][0]["text"])])
    if item["type"] == "function_call":
        return FunctionCallItem(type="function_call", call_id=item["call_id"], name=item["name"],
                                arguments=item["arguments"])
    return None
