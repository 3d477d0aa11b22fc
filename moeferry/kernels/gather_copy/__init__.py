"""Copy of an admission's misses: host rows -> slot rows, sized on the device.

``gather_copy(src_banks, dst_banks, plan_src, plan_dst, plan_count)`` copies, for every bank
pair and every ``i < plan_count``, row ``plan_src[i]`` of the source bank (``[E, ...]``, pinned
host memory) into row ``plan_dst[i]`` of the destination bank (``[S, ...]``, the slot pool).
Rows move as raw bytes, so any dtype works (bf16, fp8 stored as uint8, float32 scales); rows
outside the plan are untouched. The Triton kernel reads the count on the device (CUDA-graph
capturable, no host sync); the reference reads it on the host. Full contract:
kernels/gather_copy/triton.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.kernels import implementation

__all__ = ["GatherTuning", "check_banks", "gather_copy", "row_bytes"]


@dataclass(frozen=True)
class GatherTuning:
    """How the Triton gather runs (the reference ignores it); every value copies the same
    bytes. Defaults: the measured best on an H200 (benchmarks/RESULTS.md, copy), swept by
    `python -m benchmarks.sweep_gather`.

    chunk_bytes: the work item, a chunk of one row; block_bytes: bytes one loop step moves;
    programs_per_sm: the fixed grid (a call with no misses still launches it), at most
    max_programs (0: no cap) programs; num_warps.
    """

    chunk_bytes: int = 64 * 1024
    block_bytes: int = 16 * 1024
    programs_per_sm: int = 1
    max_programs: int = 0
    num_warps: int = 8


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
    """Bytes of one row (one expert) of a bank."""
    return bank[0].numel() * bank.element_size() if bank.shape[0] else 0


def gather_copy(src_banks: list[torch.Tensor], dst_banks: list[torch.Tensor], plan_src: torch.Tensor,
                plan_dst: torch.Tensor, plan_count: torch.Tensor, *, tuning: GatherTuning = GatherTuning(),
                impl: str | None = None) -> None:
    """Copy the planned rows of every bank pair (see the module); dispatched on the slot banks."""
    implementation("gather_copy", dst_banks[0], impl).gather_copy(src_banks, dst_banks, plan_src, plan_dst,
                                                                 plan_count, tuning)
