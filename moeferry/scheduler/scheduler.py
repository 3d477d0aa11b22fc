"""Continuous batching: FCFS admission, chunked prefill under a token budget, every running
request decodes each step, preemption (recompute later) when KV pages run out."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from moeferry.kvcache.paged import PagePool
from moeferry.sampling import InvalidRequest
from moeferry.scheduler.request import Request, Status

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """One step's work: prefill chunks (request, number of tokens) and decoding requests, and
    the requests preempted while planning it (back in `waiting`, their pages released)."""

    prefill: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

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
    """

    def __init__(self, pool: PagePool, page_size: int, max_running: int, max_prefill_tokens: int, max_model_len: int):
        self.pool, self.page_size = pool, page_size
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

    def _preempt(self, req: Request) -> None:
        self.pool.release(req.pages)
        req.pages, req.num_computed = [], 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        self._preempted.append(req)
        logger.info("preempted request %d (KV pages exhausted); it will be recomputed", req.rid)

    def free(self, req: Request) -> None:
        """Return a finished or aborted request's pages to the pool."""
        self.pool.release(req.pages)
        req.pages = []
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

    def _admit_waiting(self, budget: int) -> list[tuple[Request, int]]:
        """FCFS admission: the head of `waiting` joins while the budget, the running limit and
        the free pages allow; a head that does not fit stops admission (no overtaking)."""
        chunks = []
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n):
                if not self.running:
                    raise RuntimeError(f"request {req.rid} does not fit in an empty KV cache")
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            chunks.append((req, n))
            budget -= n
        return chunks

    def schedule(self) -> StepPlan:
        """Plan one step: decode first (every decoding request gets its token's page, later
        admissions are preempted for it), then running prefills, then FCFS admission, the
        prefill chunks sharing `max_prefill_tokens`."""
        self._preempted = []
        decode = self._plan_decode()
        prefill, starved = self._plan_running_prefill(decode, self.max_prefill_tokens)
        if not starved:
            prefill += self._admit_waiting(self.max_prefill_tokens - sum(n for _, n in prefill))
        return StepPlan(prefill=prefill, decode=decode, preempted=self._preempted)
