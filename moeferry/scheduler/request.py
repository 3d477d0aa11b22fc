"""Request: one generation, from prompt to finish, as the scheduler tracks it."""

from __future__ import annotations

import enum
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from moeferry.sampling import InvalidRequest, SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Invariants: `num_computed` tokens of `tokens` have their KV in `pages`; while
    more than one token is pending (or nothing was generated yet) the request is prefilling
    its pending tokens in chunks; after that it decodes one token a step. A preempted request
    drops its pages and sets num_computed to 0: its prompt and the tokens generated so far are
    recomputed when it runs again (less the pages the prefix cache still holds). Its pages
    below `num_computed` may be shared with other requests: it only writes at positions
    >= num_computed. `page_keys` are the prefix cache's chain keys of its first full pages
    (tokens only grow, so they stay valid); its first `num_registered` pages were offered to
    the cache. Requests compare by identity (eq=False), so membership tests in the scheduler's
    queues cost O(1) per element, not a comparison of token lists. `params` has nothing unset
    (the engine filled the model's defaults; a request made elsewhere gets the neutral ones)."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    page_keys: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""
    sent_chars: int = 0  # characters of `text` handed out as deltas (the rest may start a stop string)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    seed: int | None = None
    num_preemptions: int = 0
    logprobs: list = field(default_factory=list)  # TokenLogprobs of each output token, when asked for
    # with params.prompt_logprobs: the PromptLogprobs of prompt positions [0, len) so far, None
    # at position 0 (no token precedes it); filled by the prefill chunks that compute them
    prompt_logprobs: list | None = None
    # structured output: the grammar state (moeferry.structured.GrammarMatcher) of the tokens in
    # output_ids, fed once per generated token; kept through preemption, never fed the recompute
    grammar: Any = None
    # min_tokens: the params to sample with once min_tokens are out (`params` block the end and
    # stop tokens until then); None when there is no such phase, or it is over
    params_after_min: SamplingParams | None = None

    def __post_init__(self):
        if not self.prompt_ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        self.params = self.params.with_defaults()
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        if self.seed is None:  # the key of the request's random stream (its sampler slot's seed)
            self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_tokens - self.num_computed > 1 or not self.output_ids

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probs are asked for and some are still to compute: the prefill must
        compute those positions' logits, so no prompt page may come from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
