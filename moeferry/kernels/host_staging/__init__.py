"""Copies between device memory and pinned host memory made by a kernel, not by a memcpy.

``staged_copy(pairs)``: for each (src, dst) pair (at most MAX_PAIRS; equal numel, both
contiguous), dst = src: floating pairs of one dtype, bit for bit; integers may change width
(a route id int64 -> int32), values in range. On a GPU one side is a CUDA tensor and the
other pinned host memory, which the Triton kernel reads or writes in place over PCIe (unified
addressing), every pair in one launch. A CUDA graph captured around it holds a kernel node
where `Tensor.copy_` would put memcpy nodes: the host channel (moe/host_channel.py) stages its
inputs and outputs this way, so its graph branch is kernels and a host function, ordered by
the step's own kernels instead of by the copy engines' queues. The reference is `copy_`.

``staged_routes(src, dst, ids, keep=False)``: the host channel's outputs back, route by route:
dst[r] = src[r] where ids[r] >= 0, zeros elsewhere, or with `keep` dst's own rows left as they
are there (the device's routes, merged in place: no separate combine); src, dst [N, H] of one
floating dtype, src pinned on a GPU; ids [N] on dst's device. Only the rows the host computed
cross PCIe: pinned memory read in place costs a PCIe round trip every few rows, and a decode
layer gives the host few routes.
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation

__all__ = ["MAX_PAIRS", "check_pairs", "check_routes", "staged_copy", "staged_routes"]

MAX_PAIRS = 3


def check_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """At most MAX_PAIRS pairs, each of equal numel, contiguous on both sides, one floating
    dtype or integers on both."""
    if not 0 < len(pairs) <= MAX_PAIRS:
        raise ValueError(f"staged_copy takes 1 to {MAX_PAIRS} pairs, got {len(pairs)}")
    for i, (src, dst) in enumerate(pairs):
        if src.numel() != dst.numel():
            raise ValueError(f"pair {i}: {src.numel()} source elements for {dst.numel()} destination elements")
        if (src.dtype.is_floating_point or dst.dtype.is_floating_point) and src.dtype != dst.dtype:
            raise ValueError(f"pair {i}: {src.dtype} to {dst.dtype}; floating values are copied, not converted")
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError(f"pair {i}: both sides must be contiguous")


def staged_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], *, impl: str | None = None) -> None:
    """dst = src for every pair; dispatched on the device side of the first pair."""
    check_pairs(pairs)
    device_side = next((t for t in pairs[0] if t.is_cuda), pairs[0][1])
    implementation("host_staging", device_side, impl).staged_copy(pairs)


def check_routes(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor) -> None:
    """src, dst [N, H] contiguous, one floating dtype; ids [N] integers."""
    if src.dim() != 2 or src.shape != dst.shape or ids.shape != src.shape[:1]:
        raise ValueError(f"staged_routes takes src, dst [N, H] and ids [N], got {tuple(src.shape)}, "
                         f"{tuple(dst.shape)}, {tuple(ids.shape)}")
    if src.dtype != dst.dtype or not src.dtype.is_floating_point or ids.dtype.is_floating_point:
        raise ValueError(f"staged_routes copies one floating dtype by integer ids, got {src.dtype} to {dst.dtype} "
                         f"by {ids.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous() and ids.is_contiguous()):
        raise ValueError("staged_routes: src, dst and ids must be contiguous")


def staged_routes(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, *, keep: bool = False,
                  impl: str | None = None) -> None:
    """dst[r] = src[r] where ids[r] >= 0, else zeros (or, with `keep`, dst[r] as it is);
    dispatched on dst's device."""
    check_routes(src, dst, ids)
    implementation("host_staging", dst, impl).staged_routes(src, dst, ids, keep)
