"""Helpers shared by the Triton kernels' modules: bf16-exact rounding inside a kernel, and the
check of a caller's output buffer on the host."""
import torch
import triton
import triton.language as tl


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
