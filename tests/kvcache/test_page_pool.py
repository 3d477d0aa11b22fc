"""The page pool and its prefix cache alone: reference counts, the evictable LRU, the hash chain,
checked against a plain-Python model of what requests put in their pages."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from moeferry.kvcache.paged import OutOfPages, PagePool, chain_page_keys

PAGE = 2
NUM_PAGES = 8


def keys_of(tokens: list[int], pages: int | None = None) -> list[bytes]:
    return chain_page_keys([], tokens, PAGE, len(tokens) // PAGE if pages is None else pages)


class PoolAgainstModel(RuleBasedStateMachine):
    """Requests arrive, decode and finish over a small pool; the model keeps each live request's
    tokens and pages, and what each page holds: the token prefix (up to the page's last written
    position) whose KV the request that wrote it left there, since a page's KV depends on every
    token before it. Tokens come from a three-letter alphabet, so prefixes repeat often."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(NUM_PAGES)
        self.requests: list[tuple[list[int], list[int]]] = []
        self.holds: dict[int, tuple[int, ...]] = {}
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}

    def _chain(self, tokens: list[int]) -> list[bytes]:
        keys = keys_of(tokens)
        for i, key in enumerate(keys):
            prefix = tuple(tokens[:(i + 1) * PAGE])
            assert self.prefix_of.setdefault(key, prefix) == prefix, "two prefixes share a key"
        return keys

    def _write(self, tokens: list[int], pages: list[int], pos: int) -> None:
        """The request computes position `pos`: its page must be its own, and uncached."""
        page = pages[pos // PAGE]
        assert self.pool.refcount(page) == 1 and page not in dict(map(reversed, self.pool.cached_items()))
        self.holds[page] = tuple(tokens[:pos + 1])
        if (pos + 1) % PAGE == 0:
            self.pool.register(page, self._chain(tokens)[pos // PAGE])

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def admit(self, tokens):
        keys = self._chain(tokens)
        reusable = (len(tokens) - 1) // PAGE
        shared = self.pool.match(keys[:reusable])
        for i, page in enumerate(shared):
            assert self.holds[page] == tuple(tokens[:(i + 1) * PAGE])
        held = {p for _, pages in self.requests for p in pages}
        self.pool.share(shared)
        need = -(-len(tokens) // PAGE) - len(shared)
        if need > self.pool.free_pages:
            with pytest.raises(OutOfPages):
                self.pool.allocate(need)
            self.pool.release(shared)
            return
        new = self.pool.allocate(need)
        assert len(set(new)) == need and not set(new) & (held | set(shared)), "a page in use was handed out"
        pages = shared + new
        for pos in range(len(shared) * PAGE, len(tokens)):
            self._write(tokens, pages, pos)
        self.requests.append((tokens, pages))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data, token):
        tokens, pages = self.requests[data.draw(st.integers(0, len(self.requests) - 1))]
        if len(tokens) % PAGE == 0:
            if self.pool.free_pages == 0:
                return
            pages += self.pool.allocate(1)
        tokens.append(token)
        self._write(tokens, pages, len(tokens) - 1)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data):
        _, pages = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.pool.release(pages)

    @invariant()
    def refcounts_count_the_requests_holding_each_page(self):
        for page in range(NUM_PAGES):
            assert self.pool.refcount(page) == sum(pages.count(page) for _, pages in self.requests)

    @invariant()
    def free_evictable_and_used_pages_add_up(self):
        used = {p for _, pages in self.requests for p in pages}
        cached = {page for _, page in self.pool.cached_items()}
        assert self.pool.evictable_pages == len(cached - used)
        free = self.pool.free_pages - self.pool.evictable_pages
        assert free + self.pool.evictable_pages + len(used) == NUM_PAGES

    @invariant()
    def a_cached_key_names_a_page_holding_its_prefix(self):
        items = self.pool.cached_items()
        assert len({page for _, page in items}) == len(items)
        for key, page in items:
            assert self.holds[page] == self.prefix_of[key]


TestPoolAgainstModel = PoolAgainstModel.TestCase
TestPoolAgainstModel.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_a_key_names_the_whole_prefix_not_only_the_page():
    assert keys_of([1, 2, 3, 4])[1] != keys_of([5, 6, 3, 4])[1]
    assert keys_of([1, 2, 3, 4]) == keys_of([1, 2, 3, 4, 9])
    assert keys_of([1, 2, 3, 4], pages=1) == keys_of([1, 2, 3, 4])[:1]


def test_releasing_a_page_nobody_holds_raises_and_changes_nothing():
    pool = PagePool(2)
    [page] = pool.allocate(1)
    pool.release([page])
    with pytest.raises(ValueError, match="not held"):
        pool.release([page])
    assert pool.refcount(page) == 0 and pool.free_pages == 2


def test_free_pages_go_out_before_cached_ones_and_cached_ones_least_recently_released_first():
    pool = PagePool(4)
    keys = keys_of([0, 1, 2, 3, 4, 5])
    a, b, c = (pool.allocate(1)[0] for _ in range(3))
    for page, key in zip((a, b, c), keys):
        pool.register(page, key)
    pool.release([c])
    pool.release([a])
    pool.release([b])
    assert pool.free_pages == 4 and pool.evictable_pages == 3
    [fresh] = pool.allocate(1)
    assert fresh not in (a, b, c) and pool.cached_pages == 3
    assert pool.allocate(2) == [c, a]
    assert pool.match(keys) == [] and pool.cached_pages == 1  # page a held the first key
    assert pool.cached_items() == [(keys[1], b)]


def test_a_shared_cached_page_leaves_the_lru_and_returns_when_its_last_holder_releases_it():
    pool = PagePool(2)
    key = keys_of([7, 7])[0]
    [page] = pool.allocate(1)
    pool.register(page, key)
    pool.share(pool.match([key]))
    pool.release([page])
    assert pool.refcount(page) == 1 and pool.evictable_pages == 0
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    pool.release([page])
    assert pool.evictable_pages == 1 and pool.match([key]) == [page]


def test_a_prefix_computed_twice_at_once_keeps_the_first_page_cached_and_frees_the_copy():
    pool = PagePool(2)
    key = keys_of([3, 4])[0]
    first, copy = pool.allocate(2)
    pool.register(first, key)
    pool.register(copy, key)
    pool.release([first, copy])
    assert pool.cached_items() == [(key, first)] and pool.evictable_pages == 1 and pool.free_pages == 2


def test_a_page_nobody_holds_cannot_be_registered():
    pool = PagePool(1)
    with pytest.raises(ValueError, match="not held"):
        pool.register(0, keys_of([1, 2])[0])
