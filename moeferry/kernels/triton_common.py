"""Helpers shared by the Triton kernels' modules: bf16-exact rounding and an fp32-accumulating
dot inside a kernel, programmatic dependent launch, the check of a caller's output buffer on
the host, and pinned host tensors as kernel arguments (HostPointer)."""
import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _TRITON_HAS_GDC = True
except ImportError:  # a Triton without grid dependency control: PDL stays off
    _TRITON_HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while
# the kernel before it in the stream is still running; it waits for that kernel in
# `wait_for_previous_kernel`. Saves the launch gap between the small kernels of a decode step.
# MOEFERRY_PDL=0 turns it off; `set_pdl` too (a captured CUDA graph keeps what it was captured with).
_pdl_enabled = os.environ.get("MOEFERRY_PDL", "1") != "0"


def set_pdl(enabled: bool) -> None:
    """Launch the kernels with programmatic dependent launch where the GPU has it, or not."""
    global _pdl_enabled
    _pdl_enabled = bool(enabled)


@functools.lru_cache(maxsize=None)
def _triton_has_pdl() -> bool:
    """Triton has both the in-kernel wait and the launch option (3.6 and 3.9 do)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return _TRITON_HAS_GDC and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=None)
def _gpu_has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Launch keywords of a kernel that calls `wait_for_previous_kernel(PDL)` first thing:
    PDL=True and launch_pdl=True on a GPU that has programmatic dependent launch, else PDL=False."""
    device = torch.device(device)
    if (_pdl_enabled and not INTERPRETED and device.type == "cuda" and _triton_has_pdl()
            and _gpu_has_pdl(device.index if device.index is not None else torch.cuda.current_device())):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel in the stream has finished and its writes are
    visible, then let the next kernel start launching. A kernel launched with PDL calls this
    before anything else, an early return included: the next kernel's wait then implies that
    every kernel before it has finished, and nothing is read or written before its inputs exist
    and its outputs' last readers are done."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


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


class HostPointer:
    """A host tensor handed to a kernel as a bare pointer (``data_ptr`` and ``dtype``), for
    launchers that refuse a CPU tensor. Valid only for pinned memory under unified
    addressing, where the host pointer is also the device pointer."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def kernel_argument(t: torch.Tensor, on_gpu: bool):
    """`t` as an argument of a launch on the GPU (`on_gpu`): a host tensor as its bare pointer
    (HostPointer, pinned memory read or written in place), anything else as it is."""
    return HostPointer(t) if on_gpu and t.device.type == "cpu" else t
