"""Rounding helpers shared by the Triton kernels."""
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
