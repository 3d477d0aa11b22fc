"""Scripted answers for tests: the engine runs the model as usual, but a request whose prompt
the script knows gets the script's tokens instead of the sampled ones (then the end token).

For tests of what the server does with an answer (tool calls, their parsing and streaming)
where a tiny model cannot be made to write that answer. The model still runs every step, on
the scripted tokens, so batching, KV and finishing are the engine's own; every step is planned
(no async scheduling: a step launched ahead would read the sampled tokens on the device).
"""

from __future__ import annotations

import contextlib
from typing import Callable


@contextlib.contextmanager
def scripted_answers(engine, answer_for: Callable[[str], str | None]):
    """While inside, a request's output is the tokens of `answer_for(prompt text)` and then the
    tokenizer's end token; None leaves the request to the model. Wraps Engine._emit, where
    each step's sampled tokens are appended."""
    original = engine._emit
    scripts: dict[int, list[int]] = {}
    tokenizer = engine.tokenizer

    def emit(reqs, sampled_tokens: list[int], logprobs: list):
        tokens = list(sampled_tokens)
        for row, req in enumerate(reqs):
            if req.rid not in scripts:
                answer = answer_for(tokenizer.decode(req.prompt_ids))
                scripts[req.rid] = [] if answer is None else \
                    tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
            script = scripts[req.rid]
            if len(req.output_ids) < len(script):
                tokens[row] = script[len(req.output_ids)]
        return original(reqs, tokens, logprobs)

    engine._emit = emit
    engine._decodes_ahead = lambda flight: None
    try:
        yield
    finally:
        del engine._emit, engine._decodes_ahead
