"""Continuous batching: FCFS admission, chunked prefill under a token budget, every running
request decodes each step, preemption (recompute later) when KV pages run out, and prefix
caching: an admitted request starts after the cached pages of its longest known prefix."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from moeferry.kvcache.paged import PagePool, chain_page_keys
from moeferry.sampling import InvalidRequest
from moeferry.scheduler.request import Request, Status

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """One step's work: prefill chunks (request, number of tokens) and decoding requests, the
    requests preempted while planning it (back in `waiting`, their pages released), and the
    tokens the requests admitted in it looked up in the prefix cache and found there."""

    prefill: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    """Owns the waiting queue and the running set, and the KV pages each request holds.

    Invariants: a request is in exactly one of `waiting` (FCFS order, preempted requests at
    the front) or `running`; a running request holds pages for every token it has computed;
    at most `max_running` requests run at once; a step's prefill chunks total at most
    `max_prefill_tokens`; admission is FCFS (no request overtakes the head of `waiting`).
    Progress: a request that `add` accepted fits alone in the KV cache, and preemption takes
    the latest-admitted request first, so the oldest running request always advances.
    With `prefix_caching`, a running request's computed full pages are registered in the pool's
    cache (at each step's planning, and when it is preempted or freed), and a request being
    admitted shares the cached pages of its longest known prefix, never the page of its last
    token: its prefill computes at least that token, whose logits it samples from; a request
    still owing prompt log-probs shares none (it needs the logits of every prompt position;
    the pages it computes are registered as anyone's). Cached pages nobody holds count as free:
    the pool evicts them when it needs the room.
    """

    def __init__(self, pool: PagePool, page_size: int, max_running: int, max_prefill_tokens: int, max_model_len: int,
                 prefix_caching: bool = False):
        self.pool, self.page_size, self.prefix_caching = pool, page_size, prefix_caching
        self.max_running, self.max_prefill_tokens, self.max_model_len = max_running, max_prefill_tokens, max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._preempted: list[Request] = []

    @property
    def context_limit(self) -> int:
        """The most tokens (prompt + generated) one request may hold."""
        return min(self.max_model_len, self.pool.num_pages * self.page_size)

    def add(self, req: Request) -> None:
        limit = self.context_limit
        if len(req.prompt_ids) + req.params.max_tokens > limit:
            raise InvalidRequest(
                f"prompt of {len(req.prompt_ids)} tokens + max_tokens {req.params.max_tokens} exceeds the "
                f"context limit of {limit} tokens", "max_tokens")
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(req.pages))

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self._pages_needed(req, num_tokens)
        if need > self.pool.free_pages:
            return False
        req.pages.extend(self.pool.allocate(need))
        return True

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Give running `req` pages for `num_tokens` tokens from the free ones, preempting
        nobody: False when there are too few (a decode step launched ahead of its
        predecessor's tokens takes the page of a token the host has not seen yet)."""
        return self._grow(req, num_tokens)

    def _register_computed(self, req: Request) -> None:
        """Offer the prefix cache `req`'s full pages whose KV is computed (prompt or generated)."""
        full = req.num_computed // self.page_size
        if not self.prefix_caching or full <= req.num_registered:
            return
        keys = chain_page_keys(req.page_keys, req.tokens, self.page_size, full)
        for i in range(req.num_registered, full):
            self.pool.register(req.pages[i], keys[i])
        req.num_registered = full

    def _drop_pages(self, req: Request) -> None:
        """Release `req`'s pages (its computed full pages stay cached for whoever comes next)."""
        self._register_computed(req)
        self.pool.release(req.pages)
        req.pages, req.num_computed, req.num_registered = [], 0, 0

    def _attach_cached_prefix(self, req: Request) -> int:
        """Give `req` (holding no pages) the cached pages of its longest known prefix, short of
        the page holding its last token; returns the tokens they cover."""
        if not self.prefix_caching:
            return 0
        reusable = (req.num_tokens - 1) // self.page_size
        keys = chain_page_keys(req.page_keys, req.tokens, self.page_size, reusable)
        req.pages = self.pool.match(keys[:reusable])
        self.pool.share(req.pages)
        req.num_registered = len(req.pages)
        req.num_computed = len(req.pages) * self.page_size
        if not req.num_preemptions:  # a recomputation after preemption is not the prompt's reuse
            req.num_cached_tokens = req.num_computed
        return req.num_computed

    def _preempt(self, req: Request) -> None:
        self._drop_pages(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        self._preempted.append(req)
        logger.info("preempted request %d (KV pages exhausted); it will be recomputed", req.rid)

    def free(self, req: Request) -> None:
        """Return a finished or aborted request's pages to the pool."""
        self._drop_pages(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _grow_or_preempt(self, req: Request, num_tokens: int, protected: set[int], yield_self: bool) -> bool:
        """Give `req` pages for `num_tokens` tokens, preempting the latest-admitted running
        requests after it (never one whose rid is in `protected`) until they fit. With no
        victim left, `req` itself is preempted if `yield_self`. True when the pages are there."""
        while not self._grow(req, num_tokens):
            later = self.running[self.running.index(req) + 1:]
            victims = [r for r in later if r.rid not in protected]
            if not victims:
                if yield_self:
                    self._preempt(req)
                return False
            self._preempt(victims[-1])
        return True

    def _plan_decode(self) -> list[Request]:
        decoding = [r for r in self.running if not r.in_prefill]
        for req in decoding:
            if req in self.running:
                self._grow_or_preempt(req, req.num_tokens, protected=set(), yield_self=True)
        return [r for r in decoding if r in self.running]

    def _plan_running_prefill(self, decode: list[Request], budget: int) -> tuple[list[tuple[Request, int]], bool]:
        """Next chunks of requests already running their prefill, and whether one of them was
        left without pages (then nobody new is admitted: it would only take pages from it).
        A request short of pages may preempt later prefilling requests, never one planned to
        decode this step; so when every running request is prefilling, the oldest advances."""
        protected = {r.rid for r in decode}
        chunks, starved = [], False
        for req in [r for r in self.running if r.in_prefill]:
            if budget <= 0:
                break
            if req not in self.running:  # preempted by an earlier request of this loop
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if self._grow_or_preempt(req, req.num_computed + n, protected, yield_self=False):
                chunks.append((req, n))
                budget -= n
            else:
                starved = True
        return chunks, starved

    def _admit_waiting(self, plan: StepPlan) -> None:
        """FCFS admission into `plan`: the head of `waiting` joins, after the cached pages of its
        prefix, while the prefill budget, the running limit and the free pages allow; a head
        that does not fit stops admission (no overtaking) and gives its cached pages back."""
        budget = self.max_prefill_tokens - sum(n for _, n in plan.prefill)
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            looks_up = self.prefix_caching and not req.needs_prompt_logprobs
            hit = self._attach_cached_prefix(req) if looks_up else 0
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n):
                self._drop_pages(req)
                if not self.running:
                    raise RuntimeError(f"request {req.rid} does not fit in an empty KV cache")
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            plan.prefill.append((req, n))
            if looks_up:
                plan.prefix_queried_tokens += req.num_tokens
                plan.prefix_hit_tokens += hit
            budget -= n

    def schedule(self) -> StepPlan:
        """Plan one step: decode first (every decoding request gets its token's page, later
        admissions are preempted for it), then running prefills, then FCFS admission, the
        prefill chunks sharing `max_prefill_tokens`. The KV the previous step computed is
        registered in the prefix cache first, so this step's admissions can share it."""
        self._preempted = []
        for req in self.running:
            self._register_computed(req)
        decode = self._plan_decode()
        prefill, starved = self._plan_running_prefill(decode, self.max_prefill_tokens)
        plan = StepPlan(prefill=prefill, decode=decode, preempted=self._preempted)
        if not starved:
            self._admit_waiting(plan)
        return plan
