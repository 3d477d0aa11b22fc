"""Stored expert weights' bits as values, and the gated activation: the pieces both fused MoE
kernels (the grouped GEMM on tensor cores, kernels/fused_moe/triton.py, and the decode route GEMV
on CUDA cores, kernels/fused_moe/gemv.py) share, so the two read every format alike."""
import triton
import triton.language as tl

__all__ = ["activate", "e2m1_bits", "e2m1_value", "e8m0_value"]


@triton.jit
def e2m1_bits(code):
    """The float32 bit patterns (int32) of FP4 E2M1 codes (int32 0..15: bit 3 the sign, bits 2-1
    the exponent e, bit 0 the mantissa m): e > 0 is (1 + m/2) 2^(e-1), a float32 biased exponent
    of 126 + e; e = 0 is m/2, exponent 126 (0.5) or zero. The low 16 bits are zero, so the high
    half is the same value in bf16."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    biased = tl.where(exponent == 0, 126 * mantissa, 126 + exponent)
    fraction = tl.where(exponent == 0, 0, mantissa << 22)
    return ((code >> 3) << 31) | (biased << 23) | fraction


@triton.jit
def e2m1_value(code):
    """float32 values of FP4 E2M1 codes (e2m1_bits)."""
    return e2m1_bits(code).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_value(scale):
    """float32 2^(s - 127) of E8M0 bytes s (int32): s is float32's exponent field; s = 0 the
    subnormal 2^-127."""
    return tl.where(scale == 0, 1 << 22, scale << 23).to(tl.float32, bitcast=True)


@triton.jit
def activate(gate, up, alpha, limit, CLAMPED: tl.constexpr):
    """silu(gate) * up, or (CLAMPED) gpt-oss's clamped SwiGLU; fp32 in and out."""
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * (gate / (1.0 + tl.exp(-gate * alpha)))
    else:
        return gate / (1.0 + tl.exp(-gate)) * up
