"""Paged KV cache: fixed-size pages of tokens, a reference-counted page pool with a prefix cache,
and per-request page tables.

Layout: k[layer] and v[layer] are [num_pages * page_size, kv_heads, head_dim] (a cache without
values, multi-head latent attention's, has only k: one latent row per token); token slot
`page * page_size + offset` holds the token at position `page_index * page_size + offset` of
the requests that hold `page`. A request's page table lists its pages in position order.

Prefix caching: a full page is keyed by a hash chain over the token ids (`chain_page_keys`), so
its key names the whole prefix up to the page's last token, which is what its KV depends on.
A later request whose prompt starts with the same pages finds them by key and shares them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

KEY_BYTES = 16  # a 128-bit digest: a collision among 2^40 cached pages has probability ~2^-49


def chain_page_keys(keys: list[bytes], tokens: list[int], page_size: int, count: int) -> list[bytes]:
    """The hash-chain keys of the first `count` full pages of `tokens`, extending `keys` (the
    keys of its first len(keys) pages) in place. Page i's key is the BLAKE2b digest of page
    i-1's key and page i's token ids: equal keys mean equal prefixes, not only equal pages."""
    for i in range(len(keys), count):
        digest = hashlib.blake2b(keys[i - 1] if i else b"", digest_size=KEY_BYTES)
        digest.update(array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes())
        keys.append(digest.digest())
    return keys


class OutOfPages(RuntimeError):
    """Raised when an allocation needs more pages than are free or evictable."""


class PagePool:
    """Reference-counted allocator over page ids [0, num_pages), with an index of cached pages:
    full pages registered under their chain key, found again by later requests.

    Every page is in exactly one state:
      used       refcount >= 1, held by that many requests; it may also be cached;
      evictable  refcount 0 and cached: kept in an LRU (least recently released first);
      free       refcount 0 and not cached.
    Invariants: used + evictable + free == num_pages; `allocate` hands out only free pages,
    then evictable ones (dropping their keys), so a page in use is never handed out again;
    a refcount never goes below zero (releasing an unheld page raises); `_page_of` and
    `_key_of` are inverse maps of the cached pages. The caller registers a page only once the
    KV of its key's tokens is written, and never writes to a page it shares.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}

    @property
    def free_pages(self) -> int:
        """Pages `allocate` can hand out: the free ones and the evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def evictable_pages(self) -> int:
        return len(self._evictable)

    @property
    def cached_pages(self) -> int:
        """Pages holding a registered prefix, used or evictable."""
        return len(self._page_of)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def cached_items(self) -> list[tuple[bytes, int]]:
        """(key, page) of every cached page."""
        return list(self._page_of.items())

    def allocate(self, count: int) -> list[int]:
        """`count` pages with refcount 1: free pages first, then the least recently released
        cached ones, which leave the cache."""
        if count > self.free_pages:
            raise OutOfPages(f"need {count} KV pages, {self.free_pages} free")
        pages = [self._free.pop() for _ in range(min(count, len(self._free)))]
        while len(pages) < count:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            pages.append(page)
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each of `pages` (cached pages a request found by `match`)."""
        for page in pages:
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1

    def release(self, pages: list[int]) -> None:
        """One holder fewer for each of `pages`; a page nobody holds becomes evictable if cached,
        else free. A request's later pages are released first, so they are evicted first: its
        leading pages are the ones other prompts are likeliest to share."""
        for page in reversed(pages):
            if self._refs[page] <= 0:
                raise ValueError(f"KV page {page} released but not held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def register(self, page: int, key: bytes) -> None:
        """Cache a used, full `page` under `key`. A key already cached keeps its page (two
        requests computed the same prefix at once: the later copy stays private)."""
        if self._refs[page] <= 0:
            raise ValueError(f"KV page {page} registered but not held")
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key], self._key_of[page] = page, key

    def match(self, keys: list[bytes]) -> list[int]:
        """The cached pages of the longest leading run of `keys` (not yet shared: see `share`)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages


class PagedKVCache:
    """The KV tensors of every attention layer plus the page pool that hands out their pages.

    Invariant: the tensors are allocated once; a captured decode graph that reads them by
    page table stays valid for the life of the cache. Page `scratch_page` (one past the pool)
    is never handed out: padded decode rows write there.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, values: bool = True):
        self.page_size = page_size
        self.num_pages = num_pages
        self.scratch_page = num_pages
        shape = ((num_pages + 1) * page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)] if values else []
        self.pool = PagePool(num_pages)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, values: bool = True) -> int:
        return (2 if values else 1) * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def token_slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """Flat token slots of positions [start, end) of a request holding `pages`."""
        pos = torch.arange(start, end)
        page_ids = torch.tensor(pages, dtype=torch.int64)[pos // self.page_size]
        return page_ids * self.page_size + pos % self.page_size
