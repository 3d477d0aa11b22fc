"""Staged copies in one Triton launch (the contract: kernels/host_staging/__init__.py).

Program (i, p) copies block i of pair p; a pair shorter than the longest leaves its extra
blocks idle. staged_routes: program (r, i) writes block i of row r, loading it only if the row's
id is >= 0 (a masked load reads nothing). The host side is passed as a bare pointer
(triton_common.kernel_argument)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.kernels.host_staging import MAX_PAIRS, check_pairs, check_routes
from moeferry.kernels.triton_common import kernel_argument, pdl_launch, wait_for_previous_kernel

BLOCK = 1024


@triton.jit
def _copy_from(src_ptr, dst_ptr, start, n, BLOCK: tl.constexpr):
    """Elements start .. start + BLOCK of a pair (those below n), cast to the destination's dtype."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_block(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """The program's block of a pair (staged_copy: a program a block)."""
    _copy_from(src_ptr, dst_ptr, tl.program_id(0).to(tl.int64) * BLOCK, n, BLOCK)


@triton.jit
def copy_pair(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """All n elements of a pair in one program, BLOCK a pass (a posting kernel's staging,
    kernels/host_mailbox)."""
    for start in range(0, n, BLOCK):
        _copy_from(src_ptr, dst_ptr, start, n, BLOCK)


def pair_arguments(pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> list:
    """A kernel's MAX_PAIRS (source, destination, length) arguments for `pairs`, the host side
    as bare pointers on a GPU; the pairs left over copy nothing."""
    on_gpu = device.type == "cuda"
    args = []
    for src, dst in pairs:
        args += [kernel_argument(src, on_gpu), kernel_argument(dst, on_gpu), src.numel()]
    for _ in range(MAX_PAIRS - len(pairs)):  # distinct tensors: the interpreter copies every argument back
        args += [torch.empty(1, device=device), torch.empty(1, device=device), 0]
    return args


@triton.jit
def _staged_copy_kernel(src0, dst0, n0, src1, dst1, n1, src2, dst2, n2, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    pair = tl.program_id(1)
    if pair == 0:
        _copy_block(src0, dst0, n0, BLOCK)
    elif pair == 1:
        _copy_block(src1, dst1, n1, BLOCK)
    else:
        _copy_block(src2, dst2, n2, BLOCK)


def staged_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    check_pairs(pairs)
    device = next((t.device for pair in pairs for t in pair if t.is_cuda), pairs[0][1].device)
    longest = max([1] + [src.numel() for src, _ in pairs])
    _staged_copy_kernel[(triton.cdiv(longest, BLOCK), len(pairs))](*pair_arguments(pairs, device), BLOCK=BLOCK,
                                                                   **pdl_launch(device))


@triton.jit
def _staged_routes_kernel(src_ptr, dst_ptr, ids_ptr, hidden, KEEP: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < hidden
    # the row's flag as a block: the interpreter takes no scalar in a mask
    routed = (tl.zeros([BLOCK], dtype=tl.int64) + tl.load(ids_ptr + row)) >= 0
    values = tl.load(src_ptr + row * hidden + cols, mask=in_row & routed, other=0.0)
    tl.store(dst_ptr + row * hidden + cols, values, mask=in_row & (routed | (not KEEP)))


def staged_routes(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, keep: bool = False) -> None:
    check_routes(src, dst, ids)
    rows, hidden = dst.shape
    if rows == 0:
        return
    _staged_routes_kernel[(rows, triton.cdiv(hidden, BLOCK))](kernel_argument(src, dst.is_cuda), dst, ids, hidden,
                                                             KEEP=keep, BLOCK=BLOCK, **pdl_launch(dst.device))
