"""Copy of an admission's misses, plain torch: the oracle for kernels/gather_copy/triton.py
(the contract: kernels/gather_copy/__init__.py). Reads ``plan_count`` on the host."""
from __future__ import annotations

import torch

from moeferry.kernels.gather_copy import check_banks, row_bytes


def _byte_rows(bank: torch.Tensor) -> torch.Tensor:
    return bank.view(torch.uint8).view(bank.shape[0], row_bytes(bank))


def gather_copy(src_banks: list[torch.Tensor], dst_banks: list[torch.Tensor],
                plan_src: torch.Tensor, plan_dst: torch.Tensor,
                plan_count: torch.Tensor, tuning=None) -> None:
    """Copy the planned rows (``tuning``, the Triton kernel's, changes nothing here)."""
    check_banks(src_banks, dst_banks)
    count = int(plan_count.item())
    if count == 0:
        return
    for src, dst in zip(src_banks, dst_banks):
        rows = _byte_rows(src)[plan_src[:count].to(src.device).long()]
        _byte_rows(dst).index_copy_(0, plan_dst[:count].to(dst.device).long(),
                                    rows.to(dst.device))
