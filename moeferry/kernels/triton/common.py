"""Helpers shared by the Triton kernels' modules: bf16-exact rounding and an fp32-accumulating
dot inside a kernel, and the check of a caller's output buffer on the host."""
import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def exact_dot(dtype: torch.dtype) -> bool:
    """The IEEE argument of `dot` for inputs of `dtype`: exact fp32 products for fp32 inputs,
    and for every input under the interpreter, whose bf16 tl.dot is wrong in Triton 3.9."""
    return dtype == torch.float32 or INTERPRETED


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b in fp32; IEEE: exact fp32 products (see `exact_dot`)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def rounded(x, dt):
    """fp32 x rounded to the nearest dt value (ties to even), returned as fp32. bf16 is rounded
    on the bits: the same result as the GPU's cvt.rn, and correct under TRITON_INTERPRET, whose
    fp32 -> bf16 cast truncates."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        y = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(dt).to(tl.float32)
    return y


def output_buffer(out: torch.Tensor | None, shape, dtype, device, name: str) -> torch.Tensor:
    """`out` checked to be a contiguous `shape` `dtype` tensor on `device`, or a new one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if (tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != torch.device(device)
            or not out.is_contiguous()):
        raise ValueError(f"{name}: expected contiguous {tuple(shape)} {dtype} on {device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device} contiguous={out.is_contiguous()}")
    return out
