"""Timestamps on the GPU: one single-program kernel reads %globaltimer (nanoseconds, shared by
every SM) after the kernel before it has finished (kernels/timestamps)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.kernels.triton_common import pdl_launch, wait_for_previous_kernel


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["point"])
def _stamp_kernel(times_ptr, counter_ptr, rows, stride_row, point, ADVANCE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    step = tl.load(counter_ptr)
    tl.store(times_ptr + (step % rows) * stride_row + point, _globaltimer())
    if ADVANCE:
        tl.store(counter_ptr, step + 1)


def stamp(times: torch.Tensor, counter: torch.Tensor, point: int, advance: bool) -> None:
    _stamp_kernel[(1,)](times, counter, times.shape[0], times.stride(0), point, ADVANCE=advance,
                        **pdl_launch(times.device))
