"""Kernels: one folder per op, the same four parts in each.

    kernels/<op>/__init__.py   the contract (shapes, dtypes, aliasing, invariants), the types and
                               constants every implementation shares, and the public functions,
                               which dispatch through `implementation`
    kernels/<op>/triton.py     the Triton kernels (CUDA; on CPU tensors under TRITON_INTERPRET=1)
    kernels/<op>/reference.py  plain torch: the oracle every other implementation is tested against
    kernels/<op>/host.py       (where an op has one) the fast CPU implementation

One rule picks the implementation of every op (`implementation`): the caller may name it
(`impl=`, tests and benchmarks do); otherwise a CUDA call takes Triton when the op's shape rule
admits it, and a CPU call takes the op's host kernel when it has one, the reference otherwise.
Implementations are imported only when chosen, so CPU-only callers never import Triton.
Helpers shared by the Triton kernels (programmatic dependent launch, exact rounding) live in
kernels/triton_common.py.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

IMPLEMENTATIONS = ("triton", "host", "reference")


@functools.lru_cache(maxsize=None)
def _has(op: str, impl: str) -> bool:
    return importlib.util.find_spec(f"moeferry.kernels.{op}.{impl}") is not None


def choose(op: str, tensor, impl: str | None = None, *, triton_eligible: bool = True) -> str:
    """The name of the implementation that runs `op` on `tensor`'s device (see the module)."""
    if impl is not None:
        if impl not in IMPLEMENTATIONS or not _has(op, impl):
            raise ValueError(f"kernel {op!r} has no {impl!r} implementation")
        return impl
    if tensor.is_cuda:
        return "triton" if triton_eligible else "reference"
    return "host" if _has(op, "host") else "reference"


def implementation(op: str, tensor, impl: str | None = None, *, triton_eligible: bool = True):
    """The module kernels/<op>/<choose(...)>.py. Triton on CPU tensors needs TRITON_INTERPRET=1,
    set before triton is first imported."""
    return importlib.import_module(f"moeferry.kernels.{op}.{choose(op, tensor, impl, triton_eligible=triton_eligible)}")


def size_of(tensor_field: str, axis: int) -> property:
    """A read-only size of a state dataclass: dimension `axis` of its tensor `tensor_field`
    (the sizes of a device state are its tensors' shapes, never stored twice)."""
    return property(lambda self: getattr(self, tensor_field).shape[axis],
                    doc=f"{tensor_field}.shape[{axis}]")
