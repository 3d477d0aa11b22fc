"""ForwardBatch: what one model forward needs to know about the requests it runs (built by the
engine's runner, read by the layers)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    """One request's chunk inside a prefill batch: rows [row_start, row_start + length) of the
    batch, at positions [pos_start, pos_start + length); `kv_slots` are the token slots of
    positions [0, pos_start + length) (its cached prefix plus this chunk)."""

    row_start: int
    length: int
    pos_start: int
    kv_slots: torch.Tensor


@dataclass
class ForwardBatch:
    """A batch of tokens for one forward.

    Invariants: `input_ids`, `positions` and `out_slots` have one entry per row; in decode
    mode there is one row per request, and `page_table`/`seq_lens` describe each request's
    cache including the row's own token; `logits_rows` lists the rows whose logits are
    returned (the last row of each prefill chunk, then the rows whose logits give prompt
    log-probs, if any; every row in decode).
    """

    is_decode: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    logits_rows: torch.Tensor
    prefill_seqs: list[PrefillSeq] = field(default_factory=list)
    page_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]
