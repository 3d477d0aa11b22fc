"""Host-side helpers of the runner's batches (the batch itself: layers/batch.py)."""

from __future__ import annotations


def fill_page_table(table, pages: list[list[int]], scratch_page: int) -> None:
    """Rows [0, len(pages)) of `table` (a numpy int32 [rows, max_pages] array): each request's
    pages in position order, then the scratch page."""
    table[:len(pages)] = scratch_page
    for i, row in enumerate(pages):
        table[i, :len(row)] = row
