"""Paged KV cache: fixed-size pages of tokens, a free list, and per-request page tables.

Layout: k[layer] and v[layer] are [num_pages * page_size, kv_heads, head_dim]; token slot
`page * page_size + offset` holds the token at position `page_index * page_size + offset` of
the request that owns `page`. A request's page table lists its pages in position order.
"""

from __future__ import annotations

import torch


class OutOfPages(RuntimeError):
    """Raised when an allocation needs more free pages than the pool has."""


class PagePool:
    """Free-list allocator over page ids [0, num_pages).

    Invariant: a page id is either in the free list or owned by exactly one request;
    `free_pages + sum(pages owned) == num_pages` at all times.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"need {count} KV pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class PagedKVCache:
    """The KV tensors of every attention layer plus the page pool that hands out their pages.

    Invariant: the tensors are allocated once; a captured decode graph that reads them by
    page table stays valid for the life of the cache. Page `scratch_page` (one past the pool)
    is never handed out: padded decode rows write there.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.page_size = page_size
        self.num_pages = num_pages
        self.scratch_page = num_pages
        shape = ((num_pages + 1) * page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.pool = PagePool(num_pages)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def token_slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """Flat token slots of positions [start, end) of a request holding `pages`."""
        pos = torch.arange(start, end)
        page_ids = torch.tensor(pages, dtype=torch.int64)[pos // self.page_size]
        return page_ids * self.page_size + pos % self.page_size
