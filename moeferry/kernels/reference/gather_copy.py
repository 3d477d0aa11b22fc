"""Copy of an admission's misses, plain torch: the oracle for kernels/triton/gather_copy.py.

``gather_copy(src_banks, dst_banks, plan_src, plan_dst, plan_count)`` copies, for every
bank pair and every ``i < plan_count``, row ``plan_src[i]`` of the source bank (``[E, ...]``,
host memory) into row ``plan_dst[i]`` of the destination bank (``[S, ...]``, the slot pool).
Rows are moved as raw bytes, so any dtype works (bf16, fp8 stored as uint8, float32 scales).
Rows outside the plan are untouched. This version reads ``plan_count`` on the host.
"""
from __future__ import annotations

import torch


def check_banks(src_banks: list[torch.Tensor], dst_banks: list[torch.Tensor]) -> None:
    """Each pair must agree on row shape and dtype; both sides contiguous."""
    if len(src_banks) != len(dst_banks):
        raise ValueError(f"{len(src_banks)} source banks for {len(dst_banks)} slot banks")
    for i, (src, dst) in enumerate(zip(src_banks, dst_banks)):
        if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
            raise ValueError(f"bank {i}: rows {tuple(src.shape[1:])} {src.dtype} do not match "
                             f"slot rows {tuple(dst.shape[1:])} {dst.dtype}")
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError(f"bank {i}: banks must be contiguous")


def row_bytes(bank: torch.Tensor) -> int:
    return bank[0].numel() * bank.element_size() if bank.shape[0] else 0


def _byte_rows(bank: torch.Tensor) -> torch.Tensor:
    return bank.view(torch.uint8).view(bank.shape[0], row_bytes(bank))


def gather_copy(src_banks: list[torch.Tensor], dst_banks: list[torch.Tensor],
                plan_src: torch.Tensor, plan_dst: torch.Tensor,
                plan_count: torch.Tensor) -> None:
    check_banks(src_banks, dst_banks)
    count = int(plan_count.item())
    if count == 0:
        return
    for src, dst in zip(src_banks, dst_banks):
        rows = _byte_rows(src)[plan_src[:count].to(src.device).long()]
        _byte_rows(dst).index_copy_(0, plan_dst[:count].to(dst.device).long(),
                                    rows.to(dst.device))
