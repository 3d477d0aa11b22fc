"""The scheduler alone (no model): chunked prefill under the token budget, the running limit,
FCFS admission, preemption of the latest admission, progress under tight KV, and prefix caching
(a stand-in KV store records what each token slot holds, so a request reading a slot its prefix
did not write, or writing a page it shares, fails the test)."""

import random
from collections import Counter

import pytest

from moeferry.kvcache.paged import PagePool
from moeferry.sampling import SamplingParams
from moeferry.scheduler.request import Request, Status
from moeferry.scheduler.scheduler import Scheduler


def make_scheduler(num_pages=64, page_size=4, max_running=8, max_prefill=32, max_len=4096, prefix_caching=False):
    return Scheduler(PagePool(num_pages), page_size, max_running, max_prefill, max_len, prefix_caching)


def make_request(prompt_len, max_tokens=4, prompt=None):
    prompt = list(range(1, prompt_len + 1)) if prompt is None else prompt
    return Request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))


class FakeKV:
    """What a model would leave in each token slot: the prefix of tokens whose last token's KV
    it computed there, and the request that computed it. A forward reads every slot before its
    first position and writes its own; `shared_reads` counts slots read that another request
    wrote."""

    def __init__(self, s: Scheduler):
        self.s, self.slots, self.shared_reads = s, {}, 0

    def forward(self, req: Request, start: int, end: int) -> None:
        ps = self.s.page_size
        for pos in range(start):
            prefix, writer = self.slots[req.pages[pos // ps], pos % ps]
            assert prefix == tuple(req.tokens[:pos + 1]), "wrong KV read"
            self.shared_reads += writer != req.rid
        for pos in range(start, end):
            assert self.s.pool.refcount(req.pages[pos // ps]) == 1, "a shared page is written"
            self.slots[req.pages[pos // ps], pos % ps] = tuple(req.tokens[:pos + 1]), req.rid


def check_invariants(s: Scheduler) -> None:
    held = Counter(p for r in s.running for p in r.pages)
    assert s.prefix_caching or all(n == 1 for n in held.values()), "a page is owned twice"
    for page, holders in held.items():
        assert s.pool.refcount(page) == holders
    assert s.pool.free_pages + len(held) == s.pool.num_pages
    assert len(s.running) <= s.max_running
    assert not set(map(id, s.running)) & set(map(id, s.waiting))
    for r in s.waiting:
        assert not r.pages and r.status is Status.WAITING
    for r in s.running:
        assert len(r.pages) * s.page_size >= r.num_computed


def run_step(s: Scheduler, kv: FakeKV | None = None) -> tuple[list, list]:
    """What Engine.step does to the requests, with a token of the request's own (its rid and
    length: requests sharing a prompt diverge after it) standing in for the model's output."""
    plan = s.schedule()
    assert sum(n for _, n in plan.prefill) <= s.max_prefill_tokens
    for req, n in plan.prefill:
        assert len(req.pages) * s.page_size >= req.num_computed + n
        if kv is not None:
            kv.forward(req, req.num_computed, req.num_computed + n)
        req.num_computed += n
        if req.num_computed == req.num_tokens:
            _emit(s, req)
    for req in plan.decode:
        assert len(req.pages) * s.page_size >= req.num_tokens
        if kv is not None:
            kv.forward(req, req.num_tokens - 1, req.num_tokens)
        _emit(s, req)
    check_invariants(s)
    return plan.prefill, plan.decode


def _emit(s: Scheduler, req: Request) -> None:
    req.output_ids.append(1000 * req.rid + req.num_tokens)
    req.num_computed = req.num_tokens - 1
    if len(req.output_ids) >= req.params.max_tokens:
        req.status = Status.FINISHED
        s.free(req)


def run_to_completion(s: Scheduler, reqs, max_steps=10_000, kv: FakeKV | None = None) -> int:
    for r in reqs:
        s.add(r)
    steps = 0
    while s.has_work:
        run_step(s, kv)
        steps += 1
        assert steps < max_steps, "the scheduler made no progress"
    assert all(r.finished for r in reqs)
    assert s.pool.free_pages == s.pool.num_pages
    return steps


def test_chunked_prefill_respects_the_token_budget():
    s = make_scheduler(max_prefill=16)
    long, short = make_request(40), make_request(10)
    s.add(long)
    s.add(short)
    prefill, _ = run_step(s)
    assert prefill == [(long, 16)]  # the long prompt takes the whole budget, in one chunk
    prefill, _ = run_step(s)
    assert prefill == [(long, 16)]
    prefill, _ = run_step(s)
    assert prefill == [(long, 8), (short, 8)]  # the remainder, then the next request's first chunk
    prefill, decode = run_step(s)
    assert prefill == [(short, 2)] and decode == [long]


def test_max_running_requests_is_respected():
    s = make_scheduler(max_running=3, max_prefill=1000)
    reqs = [make_request(5, max_tokens=6) for _ in range(7)]
    for r in reqs:
        s.add(r)
    prefill, _ = run_step(s)
    assert [r for r, _ in prefill] == reqs[:3]
    assert len(s.running) == 3 and list(s.waiting) == reqs[3:]
    run_to_completion(s, [])


def test_admission_is_first_come_first_served():
    s = make_scheduler(max_running=2, max_prefill=1000)
    reqs = [make_request(3 + i, max_tokens=2 + i % 3) for i in range(6)]
    admitted = []
    for r in reqs:
        s.add(r)
    while s.has_work:
        prefill, _ = run_step(s)
        admitted += [r for r, _ in prefill if r not in admitted]
    assert admitted == reqs


def test_a_head_that_does_not_fit_blocks_later_requests():
    s = make_scheduler(num_pages=8, page_size=4, max_prefill=1000)
    first, big, small = make_request(20, max_tokens=8), make_request(20, max_tokens=4), make_request(2)
    for r in (first, big, small):
        s.add(r)
    prefill, _ = run_step(s)
    assert [r for r, _ in prefill] == [first]  # big needs 5 pages, 3 are free: small must not overtake it
    assert list(s.waiting) == [big, small]


def test_decode_preempts_the_latest_admitted_request():
    s = make_scheduler(num_pages=4, page_size=4, max_prefill=1000)
    a, b = make_request(8, max_tokens=6), make_request(8, max_tokens=6)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefill: 2 pages each, the pool is full
    assert s.pool.free_pages == 0
    _, decode = run_step(s)  # both decode position 8, which needs a third page each
    assert decode == [a] and s.num_preemptions == 1
    assert b.status is Status.WAITING and b.num_computed == 0 and not b.pages and b.num_preemptions == 1
    assert s.waiting[0] is b
    run_to_completion(s, [])
    assert a.finished and b.finished


def test_prefilling_requests_short_of_pages_do_not_deadlock():
    # Two requests half-way through their prefill (as after a preemption and a recompute) hold
    # every page and each needs more: the older preempts the younger instead of both waiting.
    s = make_scheduler(num_pages=10, page_size=4, max_prefill=12)
    a, b = make_request(30, max_tokens=2), make_request(30, max_tokens=2)
    for req in (a, b):
        req.pages, req.num_computed, req.status = s.pool.allocate(5), 20, Status.RUNNING
        s.running.append(req)
    prefill, _ = run_step(s)
    assert prefill[0] == (a, 10) and s.num_preemptions == 1 and b.num_preemptions == 1
    run_to_completion(s, [], max_steps=100)
    assert a.finished and b.finished


def test_no_admission_while_a_running_prefill_lacks_pages():
    s = make_scheduler(num_pages=6, page_size=4, max_prefill=8)
    a, d = make_request(30, max_tokens=2), make_request(12, max_tokens=8)
    s.add(d)
    run_step(s)  # d: 12 tokens prefilled in two steps (3 pages), then decodes
    run_step(s)
    a.pages, a.num_computed, a.status = s.pool.allocate(2), 8, Status.RUNNING
    s.running.append(a)  # a holds 2 pages, needs 2 more for its next chunk; 1 is free
    c = make_request(2)
    s.add(c)
    prefill, decode = run_step(s)
    assert decode == [d] and prefill == [] and list(s.waiting) == [c]


def test_add_refuses_a_request_that_can_never_fit():
    s = make_scheduler(num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="context limit of 16"):
        s.add(make_request(10, max_tokens=7))
    s.add(make_request(10, max_tokens=6))


def test_free_removes_a_waiting_or_running_request():
    s = make_scheduler()
    a, b = make_request(5), make_request(5)
    s.add(a)
    s.add(b)
    run_step(s)
    s.free(a)
    assert a not in s.running and not a.pages
    c = make_request(5)
    s.add(c)
    s.free(c)
    assert c not in s.waiting
    check_invariants(s)


@pytest.mark.parametrize("seed", range(5))
def test_random_workloads_under_tight_kv_all_finish(seed):
    rng = random.Random(seed)
    s = make_scheduler(num_pages=rng.randint(12, 24), page_size=rng.choice([1, 2, 4]), max_running=rng.randint(1, 6),
                       max_prefill=rng.randint(4, 40))
    limit = s.context_limit
    reqs = []
    for _ in range(rng.randint(5, 15)):
        prompt = rng.randint(1, limit - 1)
        reqs.append(make_request(prompt, max_tokens=rng.randint(1, limit - prompt)))
    run_to_completion(s, reqs)


# ---- prefix caching ---------------------------------------------------------------------------
def test_a_request_sharing_a_prompt_prefix_starts_after_the_cached_pages():
    s = make_scheduler(page_size=4, prefix_caching=True)
    kv = FakeKV(s)
    first = make_request(0, max_tokens=2, prompt=list(range(1, 11)))
    run_step(s, kv)
    run_to_completion(s, [first], kv=kv)
    second = make_request(0, max_tokens=2, prompt=list(range(1, 9)) + [50, 51, 52])
    s.add(second)
    plan = s.schedule()
    assert plan.prefill == [(second, 3)] and second.num_computed == 8
    assert plan.prefix_queried_tokens == 11 and plan.prefix_hit_tokens == 8
    kv.forward(second, 8, 11)  # reads the 8 cached slots: the first request's KV of the same tokens


def test_the_page_of_the_last_prompt_token_is_never_shared():
    s = make_scheduler(page_size=4, prefix_caching=True)
    kv = FakeKV(s)
    run_to_completion(s, [make_request(8, max_tokens=3)], kv=kv)
    again = make_request(8, max_tokens=3)
    s.add(again)
    prefill, _ = run_step(s, kv)
    assert prefill == [(again, 4)]  # page 2 is cached too, but it holds the token whose logits it needs
    assert again.output_ids


def test_without_prefix_caching_an_identical_prompt_is_computed_again():
    s = make_scheduler(page_size=4)
    run_to_completion(s, [make_request(12)])
    again = make_request(12)
    s.add(again)
    plan = s.schedule()
    assert plan.prefill == [(again, 12)] and plan.prefix_queried_tokens == plan.prefix_hit_tokens == 0


def test_requests_running_together_share_the_prefix_the_first_computed():
    s = make_scheduler(page_size=4, max_prefill=8, prefix_caching=True)
    kv = FakeKV(s)
    a = make_request(0, max_tokens=6, prompt=list(range(1, 13)))
    s.add(a)
    run_step(s, kv)  # a: positions 0..7, its first two pages full
    b = make_request(0, max_tokens=6, prompt=list(range(1, 9)) + [60])
    s.add(b)
    prefill, _ = run_step(s, kv)
    assert prefill == [(a, 4), (b, 1)] and b.pages[:2] == a.pages[:2]
    assert [s.pool.refcount(p) for p in a.pages[:2]] == [2, 2]
    run_to_completion(s, [], kv=kv)
    assert s.pool.cached_pages > 0 and s.pool.evictable_pages == s.pool.cached_pages


def test_a_preempted_sharer_leaves_the_pages_it_shares_with_the_request_that_keeps_running():
    s = make_scheduler(num_pages=6, page_size=4, max_prefill=100, prefix_caching=True)
    kv = FakeKV(s)
    a = make_request(0, max_tokens=9, prompt=list(range(1, 10)))
    s.add(a)
    run_step(s, kv)  # a holds 3 pages, 2 of them full and cached
    b = make_request(0, max_tokens=9, prompt=list(range(1, 9)) + [70])
    s.add(b)
    run_step(s, kv)  # b shares a's two full pages and takes one of its own
    assert b.pages[:2] == a.pages[:2] and s.pool.free_pages == 2
    run_to_completion(s, [], kv=kv)  # both decode to 18 tokens: 5 pages each, so b is preempted
    assert b.num_preemptions >= 1 and a.finished and b.finished
    assert a.output_ids == [1000 * a.rid + n for n in range(9, 18)]


def test_an_aborted_sharer_leaves_the_others_pages_intact():
    s = make_scheduler(page_size=4, max_prefill=100, prefix_caching=True)
    kv = FakeKV(s)
    a = make_request(0, max_tokens=6, prompt=list(range(1, 10)))
    s.add(a)
    run_step(s, kv)
    b = make_request(0, max_tokens=6, prompt=list(range(1, 9)) + [80, 81])
    s.add(b)
    run_step(s, kv)
    shared = a.pages[:2]
    s.free(a)  # the client went away
    assert [s.pool.refcount(p) for p in shared] == [1, 1] and b.pages[:2] == shared
    run_to_completion(s, [], kv=kv)
    assert b.finished and not a.pages


def test_a_head_that_does_not_fit_gives_back_the_cached_pages_it_found():
    s = make_scheduler(num_pages=6, page_size=4, max_prefill=100, prefix_caching=True)
    kv = FakeKV(s)
    run_to_completion(s, [make_request(9, max_tokens=1)], kv=kv)  # its first two pages stay cached
    hog = make_request(0, max_tokens=2, prompt=[90] * 13)
    s.add(hog)
    run_step(s, kv)  # the four uncached pages
    late = make_request(12, max_tokens=4)
    s.add(late)
    plan = s.schedule()  # late finds the two cached pages, but its third page is not there
    assert list(s.waiting) == [late] and not late.pages and late.num_computed == 0
    assert plan.prefix_hit_tokens == 0 and s.pool.evictable_pages == 2
    run_step(s, kv)  # (the plan above was not run) hog decodes its last token and finishes
    plan = s.schedule()
    assert plan.prefill == [(late, 4)] and plan.prefix_hit_tokens == 8


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_sharing_prefixes_under_tight_kv_all_finish_reading_the_right_kv(seed):
    rng = random.Random(seed)
    s = make_scheduler(num_pages=rng.randint(12, 24), page_size=rng.choice([1, 2, 4]), max_running=rng.randint(1, 6),
                       max_prefill=rng.randint(4, 40), prefix_caching=True)
    kv = FakeKV(s)
    limit = s.context_limit
    stems = [[rng.randint(1, 5) for _ in range(limit)] for _ in range(3)]
    reqs = []
    for _ in range(rng.randint(5, 15)):
        length = rng.randint(1, limit - 1)
        prompt = rng.choice(stems)[:rng.randint(0, length)]
        prompt += [rng.randint(1, 5) for _ in range(length - len(prompt))]
        reqs.append(make_request(0, max_tokens=rng.randint(1, limit - length), prompt=prompt))
    run_to_completion(s, reqs, kv=kv)
    assert kv.shared_reads > 0  # some request read KV another one computed
