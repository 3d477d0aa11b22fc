"""The OpenAI endpoints' logic: read and check a request, turn it into token ids and
SamplingParams, hand it to the engine loop, and answer with one JSON body or an SSE stream.

Every check happens before the request reaches the engine, so a bad request costs the
engine nothing and never disturbs the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from moeferry.server.engine_loop import SHUTDOWN, EngineLoop, RequestHandle
from moeferry.sampling import InvalidRequest, SamplingParams, choice_params
from moeferry.server.pools import WorkPool
from moeferry.server.screen import SCREEN_BYTES, BodyScreen
from moeferry.server.protocol import (APIError, ChatCompletionRequest, ChatFormat, Choice, CompletionFormat,
                                      CompletionRequest, DetokenizeRequest, TokenizeRequest, decode_json,
                                      invalid_request, parse_request, usage)
from moeferry.structured import json_schema_constraint
from moeferry.tokenizer.tokenizer import apply_chat_template
from moeferry.reasoning import (THINK_END, THINK_START, WithoutReasoning, is_think_parser, prompt_opens_thinking,
                                reasoning_parser)
from moeferry.structured import ReasoningTags
from moeferry.tools.plan import ToolPlan, plan_tools

_DISCONNECT_POLL_S = 0.5
# The finish_reason a stream cut short by the server's shutdown ends with: OpenAI's values are
# stop, length, content_filter, tool_calls; "length" is the one that says the text was cut off.
CUT_SHORT_FINISH = "length"
# Work below these sizes runs inline on the event loop (well under a millisecond); above them
# in the prompt pool, so a big body costs its sender a pool place, not everyone the event loop.
_INLINE_PARSE_BYTES = 1 << 14
_INLINE_PROMPT_CHARS = 1 << 13
BODY_READ_TIMEOUT_S = 30.0  # the whole body must arrive within this (408 after)
GRAMMAR_COMPILE_BUDGET_S = 10.0  # a structured-output grammar compiles within this, or a 400


class ClientGone(Exception):
    """The client closed its connection before its answer was ready: nobody to answer (499)."""


@dataclass
class Pools:
    """The front end's worker pools (pools.WorkPool): `prompts` parses big bodies, renders
    chat templates and tokenizes; `grammars` compiles structured-output grammars; and the
    process that screens the biggest bodies before they are parsed (screen.py), started with
    the server (`start`)."""

    prompts: WorkPool
    grammars: WorkPool
    screen: BodyScreen

    @classmethod
    def create(cls, prompt_workers: int = 2, grammar_workers: int = 1, queue_limit: int = 16) -> "Pools":
        return cls(WorkPool("prompts", prompt_workers, queue_limit), WorkPool("grammars", grammar_workers, queue_limit),
                   BodyScreen())

    def start(self) -> None:
        self.screen.start()

    def close(self) -> None:
        self.prompts.close()
        self.grammars.close()
        self.screen.close()


async def read_body(request: Request, limit: int, timeout: float = BODY_READ_TIMEOUT_S) -> bytes:
    """The request body's bytes: 413 past `limit` bytes (declared or actually sent), 408 when
    it has not all arrived within `timeout` seconds, ClientGone when the client left."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")

    async def receive() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        return bytes(body)

    try:
        return await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None


async def read_request(request: Request, model: type[BaseModel], limit: int, pools: Pools,
                       timeout: float = BODY_READ_TIMEOUT_S) -> BaseModel:
    """The request body as `model`: read (read_body), parsed (protocol.decode_json) and
    validated (protocol.parse_request); in the prompts pool when the body is big, and past
    SCREEN_BYTES only once the screening process (screen.py) has passed it."""
    body = await read_body(request, limit, timeout)
    if len(body) <= _INLINE_PARSE_BYTES:
        return parse_request(model, decode_json(body))
    if len(body) > SCREEN_BYTES:
        await pools.prompts.run(pools.screen.check, body, model)
    return await pools.prompts.run(lambda: parse_request(model, decode_json(body)))


async def unless_gone(request: Request, work):
    """The result of the awaitable `work`, or ClientGone as soon as the client disconnects
    (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


@dataclass(frozen=True)
class ModelInfo:
    """What the endpoints need to know about the served model (read once at start)."""

    name: str
    context_limit: int  # prompt + generated tokens of one request
    vocab_size: int
    created: int
    tool_parser: str | None = None  # the tools registry's parser of the model's tool-call syntax
    reasoning_parser: str | None = None  # reasoning.py's parser of the model's reasoning syntax


class OpenAIEndpoints:
    """The handlers behind /v1/chat/completions, /v1/completions and /v1/models.

    Invariant: a request reaches `engine_loop.submit` only after every check passed, with
    prompt + max_tokens <= the context limit; a stream that ends early aborts its request.
    """

    def __init__(self, engine_loop: EngineLoop, tokenizer, info: ModelInfo, max_body_bytes: int,
                 pools: Pools | None = None, body_timeout_s: float = BODY_READ_TIMEOUT_S):
        self.loop, self.tokenizer, self.info, self.max_body_bytes = engine_loop, tokenizer, info, max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.pools = pools if pools is not None else Pools.create()
        self._compiler_ready = False

    # ---- endpoints ----------------------------------------------------------------------------
    async def chat(self, request: Request):
        body = await read_request(request, ChatCompletionRequest, self.max_body_bytes, self.pools,
                                  self.body_timeout_s)
        self.check_common(body)
        tools = plan_tools(body.tool_dicts, body.tool_choice_value, body.parallel_tool_calls, self.info.tool_parser)
        messages = [m.as_template_input() for m in body.messages]
        ids = await self.prompt_work(request, body.prompt_chars(), self.chat_ids, messages, tools.template_tools,
                                     body.template_options)
        ids = self.shaped_prompt(body, ids, add_special_tokens=bool(body.add_special_tokens))
        tools = self.with_reasoning(tools, ids, body.include_reasoning)
        fmt = partial(ChatFormat, tools=tools, request_id=body.request_id)
        return await self._generate(request, body, [ids], body.requested_max_tokens, fmt, prompt_param="messages",
                                    adjust=lambda params: self.structured_after_reasoning(ids, with_tools(tools, params)))

    async def completions(self, request: Request):
        body = await read_request(request, CompletionRequest, self.max_body_bytes, self.pools,
                                  self.body_timeout_s)
        self.check_common(body)
        add_special = body.add_special_tokens is not False
        prompts = []
        for prompt in body.prompts:
            ids = await self.prompt_work(request, len(prompt), self._encode, prompt, add_special) \
                if isinstance(prompt, str) else list(prompt)
            self._check_vocab(ids)
            prompts.append(self.shaped_prompt(body, ids, add_special_tokens=False))
        echo = [self.tokenizer.decode(ids) if self.tokenizer is not None else "" for ids in prompts] \
            if body.echo else None
        fmt = partial(CompletionFormat, request_id=body.request_id, echo=echo, n=body.n)
        return await self._generate(request, body, prompts, body.requested_max_tokens, fmt, prompt_param="prompt")

    async def tokenize(self, request: Request):
        """vLLM's /tokenize: the ids a prompt or a conversation becomes, as the generating
        endpoints make them."""
        body = await read_request(request, TokenizeRequest, self.max_body_bytes, self.pools,
                                  self.body_timeout_s)
        self._check_model(body.model)
        body.check()
        if body.messages is not None:
            messages = [m.as_template_input() for m in body.messages]
            chars = sum(len(str(m.get("content") or "")) for m in messages)
            ids = await self.prompt_work(request, chars, self.chat_ids, messages, body.tool_dicts, body.template_options)
            ids = self.shaped_prompt(body, ids, add_special_tokens=bool(body.add_special_tokens))
        else:
            ids = await self.prompt_work(request, len(body.prompt), self._encode, body.prompt,
                                         body.add_special_tokens is not False)
        out = {"count": len(ids), "max_model_len": self.info.context_limit, "tokens": ids, "token_strs": None}
        if body.return_token_strs and self.tokenizer is not None:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    async def detokenize(self, request: Request):
        """vLLM's /detokenize: the text of token ids."""
        body = await read_request(request, DetokenizeRequest, self.max_body_bytes, self.pools,
                                  self.body_timeout_s)
        self._check_model(body.model)
        self._check_vocab(body.tokens, "tokens")
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def prompt_work(self, request: Request, chars: int, fn, *args):
        """`fn(*args)` (templating, tokenizing) of a prompt of `chars` characters: inline when
        small, else in the prompt pool, given up (ClientGone) when the client leaves."""
        if chars <= _INLINE_PROMPT_CHARS:
            return fn(*args)
        return await unless_gone(request, self.pools.prompts.run(fn, *args))

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.info.name, "object": "model", "created": self.info.created, "owned_by": "moeferry",
                "max_model_len": self.info.context_limit}

    # ---- checks -------------------------------------------------------------------------------
    def check_common(self, body) -> None:
        """What every generating endpoint checks first (chat, completions, responses): the model
        named is the one served."""
        self._check_model(body.model)
        body.check(self.info.context_limit)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.info.name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.info.name}`.",
                           param="model", code="model_not_found")

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None, options: dict | None = None) -> list[int]:
        """The prompt ids of a conversation through the chat template (tools rendered when given,
        `options`: ChatCompletionRequest.template_options); a template error is a 400."""
        try:
            return apply_chat_template(self.tokenizer, messages, tools, **(options or {}))
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def shaped_prompt(self, body, ids: list[int], add_special_tokens: bool) -> list[int]:
        """The prompt ids as the request asks: the tokenizer's start token put before them
        (add_special_tokens, for a rendered chat), then only the last truncate_prompt_tokens."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if add_special_tokens and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        keep = getattr(body, "truncate_prompt_tokens", None)
        if keep is not None:
            ids = ids[-keep:]
        return ids

    def structured_after_reasoning(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """A constrained request's params, its constraint applying after the reasoning when the
        model reasons in <think> tags that are single tokens of its vocabulary."""
        if params.structured is None or not is_think_parser(self.info.reasoning_parser):
            return params
        vocab = self.tokenizer.get_vocab()
        if THINK_START not in vocab or THINK_END not in vocab:
            return params
        tags = ReasoningTags(vocab[THINK_START], vocab[THINK_END], prompt_opens_thinking(self.tokenizer, ids))
        return dataclasses.replace(params, reasoning_tags=tags)

    def with_reasoning(self, tools: ToolPlan, ids: list[int], include: bool = True) -> ToolPlan:
        """The tool plan with the model's reasoning parser over the answer (reasoning.py), whose
        reasoning is dropped from the answer when `include` is false."""
        opens = prompt_opens_thinking(self.tokenizer, ids)
        parser = reasoning_parser(self.info.reasoning_parser, tools.parser, opens)
        if parser is not None and not include:
            parser = WithoutReasoning(parser)
        return dataclasses.replace(tools, parser=parser)

    def _check_vocab(self, ids: list[int], param: str = "prompt") -> None:
        bad = next((t for t in ids if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.info.vocab_size})",
                           param=param)

    def max_tokens_for(self, ids: list[int], requested: int | None, prompt_param: str) -> int:
        """The tokens a prompt of `ids` may generate: `requested`, or all the room the context
        leaves; a prompt that does not fit, or a request over the room, is a 400."""
        limit = self.info.context_limit
        if not ids:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        if len(ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but the prompt has "
                                f"{len(ids)} tokens.", param=prompt_param, code="context_length_exceeded")
        room = limit - len(ids)
        if requested is None:
            return room
        if requested > room:
            raise APIError(400, f"This model's maximum context length is {limit} tokens: the prompt's {len(ids)} "
                                f"tokens + max_tokens {requested} exceed it.", param="max_tokens",
                           code="context_length_exceeded")
        return requested

    def _compile_now(self, constraint) -> None:
        try:
            self.loop.engine.grammar_compiler().compile(constraint)
        except InvalidRequest as exc:
            raise invalid_request(exc) from None

    async def compile(self, request: Request, constraint) -> None:
        """Compile a structured output constraint in the grammar pool, off the engine thread: a
        bad one is a 400 before the engine sees the request, a good one is then cached for the
        engine's matcher. One that takes longer than GRAMMAR_COMPILE_BUDGET_S is a 400; a client
        that leaves meanwhile is not answered (ClientGone)."""
        grammars = self.pools.grammars
        if not self._compiler_ready:  # made once (seconds: xgrammar's tokenizer tables), outside the budget
            await unless_gone(request, grammars.run(self.loop.engine.grammar_compiler))
            self._compiler_ready = True
        try:
            await unless_gone(request, grammars.run(self._compile_now, constraint, timeout=GRAMMAR_COMPILE_BUDGET_S))
        except asyncio.TimeoutError:
            raise APIError(400, f"{constraint.param}: the grammar did not compile within "
                                f"{GRAMMAR_COMPILE_BUDGET_S:g} s; send a simpler one", param=constraint.param,
                           code="grammar_too_complex") from None

    # ---- generation ---------------------------------------------------------------------------
    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    async def _generate(self, request: Request, body, prompts: list[list[int]], requested: int | None, fmt_type,
                        prompt_param: str, adjust=None):
        """Submit n choices of each prompt (choice i*n+j: sample j of prompt i) and answer."""
        params = [body.sampling_params(self.max_tokens_for(ids, requested, prompt_param)) for ids in prompts]
        if adjust is not None:
            params = [adjust(p) for p in params]
        if params[0].structured is not None:
            await self.compile(request, params[0].structured)
        fmt = fmt_type(self.info.name, self._token_text, params[0].logprobs is not None)
        handles = []
        try:
            for ids, prompt_params in zip(prompts, params):
                for choice in range(prompt_params.n):
                    handles.append(await self.loop.submit(ids, choice_params(prompt_params, choice)))
        except BaseException:
            for handle in handles:
                self.loop.abort(handle)
            raise
        if body.stream:
            return StreamingResponse(self._sse(handles, fmt, body.include_usage, body.n), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(request, handles, fmt, body.n)

    async def _sse(self, handles: list[RequestHandle], fmt: ChatFormat, include_usage: bool, n: int = 1):
        for index in range(len(handles)):
            opening = fmt.opening(index)
            if opening is not None:
                yield _event(opening)
        last: dict[int, object] = {}
        async for index, delta in _merged(self.loop, handles):
            last[index] = delta
            tokens = list(zip(delta.token_ids, delta.logprobs))
            if delta.finish_reason == SHUTDOWN:
                yield _event(fmt.chunk(index, delta.text, CUT_SHORT_FINISH, tokens))
            elif delta.error is not None:
                yield _event(delta.error.body())
            elif delta.text or delta.finish_reason is not None or tokens:
                chunk = fmt.chunk(index, delta.text, delta.finish_reason, tokens)
                if chunk is not None:
                    yield _event(chunk)
        if include_usage and last:
            yield _event(fmt.usage_chunk(_usage([last[i] for i in sorted(last)], n)))
        yield "data: [DONE]\n\n"

    async def _collect(self, request: Request, handles: list[RequestHandle], fmt: ChatFormat, n: int = 1) -> Response:
        answers = await self.gather_answers(request, handles)
        if answers is None:
            return Response(status_code=499)
        choices, lasts = answers
        return JSONResponse(fmt.full(choices, _usage(lasts, n)))

    async def gather_answers(self, request: Request, handles: list[RequestHandle]) -> tuple[list[Choice], list] | None:
        """Every choice's whole answer and last Delta, or None when the client went away
        meanwhile (every choice is then aborted); a failed choice (500) or one cut short by
        shutdown (503) raises its error: no partial text."""
        watcher = asyncio.create_task(_wait_disconnect(request))
        reader = asyncio.create_task(_gather(self.loop, handles))
        try:
            await asyncio.wait({watcher, reader}, return_when=asyncio.FIRST_COMPLETED)
            disconnected = not reader.done()
        finally:
            watcher.cancel()
            if not reader.done():
                reader.cancel()  # the streams' finally blocks abort the requests
        if disconnected:
            return None
        choices, lasts = reader.result()
        failed = next((last for last in lasts if last.error is not None), None)
        if failed is not None:
            raise failed.error
        return choices, lasts


def with_tools(tools: ToolPlan, params: SamplingParams) -> SamplingParams:
    """The params of a request under its tool plan: special tokens kept where the tool-call
    syntax is made of them, and the answer held to the plan's JSON schema."""
    if tools.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    if tools.schema is not None:
        params = constrain_to_json_schema(params, tools.schema)
    return params


def constrain_to_json_schema(params: SamplingParams, schema: dict) -> SamplingParams:
    """tool_choice "required" and a named function: the answer is held to `schema` (tools/choice.py:
    a JSON array of calls of the offered tools, or the named function's arguments) by the
    grammar the device sampler applies (moeferry/structured/), so even a model that would not
    call a tool answers with a call the parser reads."""
    return dataclasses.replace(params, structured=json_schema_constraint(schema, param="tool_choice"))




def _usage(lasts, n: int = 1) -> dict:
    """The usage of a request's choices (n per prompt, in order): each prompt once, every
    choice's completion tokens."""
    lasts = list(lasts)
    firsts = lasts[::n]
    return usage(sum(last.prompt_tokens for last in firsts), sum(last.completion_tokens for last in lasts),
                 sum(last.cached_tokens for last in firsts))


async def _merged(loop: EngineLoop, handles: list[RequestHandle]):
    """(choice index, Delta) of every choice's stream as they come; when the consumer stops
    early every choice's request is aborted."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle):
        async for delta in loop.stream(handle):
            await queue.put((index, delta))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        for _ in range(len(handles)):
            while True:
                index, delta = await queue.get()
                yield index, delta
                if delta.finish_reason is not None:
                    break
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            loop.abort(handle)


async def _gather(loop: EngineLoop, handles: list[RequestHandle]) -> tuple[list[Choice], list]:
    """Every choice whole: (Choices in index order, each choice's last Delta)."""
    parts = [[] for _ in handles]
    tokens = [[] for _ in handles]
    prompts = [None] * len(handles)
    lasts = [None] * len(handles)
    async for index, delta in _merged(loop, handles):
        parts[index].append(delta.text)
        tokens[index] += zip(delta.token_ids, delta.logprobs)
        if delta.prompt_logprobs is not None:
            prompts[index] = delta.prompt_logprobs
        lasts[index] = delta
    choices = [Choice("".join(p), last.finish_reason, t, prompt)
               for p, last, t, prompt in zip(parts, lasts, tokens, prompts)]
    return choices, lasts


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
