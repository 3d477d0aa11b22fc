"""Offline API: `LLM(model_dir, **engine_options).generate(prompts, SamplingParams(...))`, and
`.chat(messages)` for conversations through the chat template. Structured output as on the
server: `SamplingParams(structured=json_schema_constraint(schema))`, or a
`moeferry.structured.Constraint` of kind json_object, regex or choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moeferry.config import EngineConfig
from moeferry.sampling import InvalidRequest, SamplingParams, choice_params
from moeferry.threads import engine_threads

if TYPE_CHECKING:
    from moeferry.engine.sampler import Logprob


@dataclass
class CompletionOutput:
    """One sample of a prompt: its index among the prompt's n, as RequestOutput's fields."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list = field(default_factory=list)


@dataclass
class RequestOutput:
    """One prompt's result: the generated token ids, their text, why generation stopped, and
    (with SamplingParams.logprobs) each token's TokenLogprobs (engine/sampler.py), of its first
    sample; `outputs` holds every sample (SamplingParams.n of them), as vLLM's does. With
    SamplingParams.prompt_logprobs, `prompt_logprobs` is vLLM's: per prompt position None (the
    first) or {token id: Logprob(logprob, rank, decoded_token)}, the prompt token's entry first,
    then the most likely tokens' by rank."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list = field(default_factory=list)
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class LLM:
    """Loads a model once; `generate` runs a list of prompts through continuous batching,
    `chat` a list of conversations.

    Engine options are the CLI flags as keyword arguments (moe_strategy="gpu",
    load_format="dummy", dtype="float32", ...); an unknown one is refused. With
    tensor_parallel_size=N it starts N-1 more processes (spawn: a script that makes an LLM
    guards its top level with `if __name__ == "__main__":`).
    """

    def __init__(self, model: str | None = None, **engine_options):
        from moeferry.engine.ranks import create_engine

        self.engine = create_engine(EngineConfig.from_kwargs(model=model, **engine_options))

    def close(self) -> None:
        """Stop what the engine started (the other ranks under tensor_parallel_size; also done at
        exit)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 on_output=None) -> list[RequestOutput]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest(f"{len(params)} SamplingParams for {len(prompts)} prompts", "sampling_params")
        reqs = []  # per prompt, its n samples (each with a seed of its own, as the server's choices)
        try:
            for prompt, sp in zip(prompts, params):
                reqs.append([])
                for choice in range(sp.n):
                    reqs[-1].append(self.engine.add_request(prompt, choice_params(sp, choice)))
        except ValueError:  # one refused prompt refuses the call: drop the ones already queued
            for req in (r for samples in reqs for r in samples):
                self.engine.abort(req)
            raise
        with engine_threads():
            while any(not r.finished for samples in reqs for r in samples):
                for out in self.engine.step():
                    if on_output is not None:
                        on_output(out)
        return [_output(samples, self._token_text) for samples in reqs]

    def _token_text(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             on_output=None) -> list[RequestOutput]:
        """Reply to conversations: `messages` is one conversation (a list of {"role", "content"}
        dicts) or a list of them. Each goes through the chat template (--chat-template, else the
        tokenizer's) with the generation prompt, then runs as `generate` runs its prompts: one
        RequestOutput per conversation. InvalidRequest (param "messages") when a conversation
        is empty or the template cannot render it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations or not all(isinstance(c, list) and c for c in conversations):
            raise InvalidRequest("messages must be a conversation (a non-empty list of {'role', 'content'} "
                                 "dicts) or a list of them", "messages")
        from moeferry.tokenizer.tokenizer import apply_chat_template

        try:
            prompts = [apply_chat_template(self.tokenizer, conversation) for conversation in conversations]
        except ValueError as exc:
            raise InvalidRequest(str(exc), "messages") from None
        return self.generate(prompts, sampling_params, on_output)


def _output(samples, token_text) -> RequestOutput:
    outputs = [CompletionOutput(i, list(r.output_ids), r.text, r.finish_reason, list(r.logprobs))
               for i, r in enumerate(samples)]
    first, prompt = outputs[0], samples[0].prompt_logprobs
    if prompt is not None:
        prompt = [None if entry is None else entry.as_dict(token_text) for entry in prompt]
    return RequestOutput(samples[0].prompt_ids, first.token_ids, first.text, first.finish_reason, first.logprobs,
                         outputs, prompt)
