"""Kernels: each op as a Triton kernel (triton/<op>.py) beside its plain-torch oracle
(reference/<op>.py). Callers go through the dispatchers (ops.py, attention.py, norm_rope.py),
which pick the implementation with `implementation`."""

import importlib


def implementation(op: str, use_triton: bool | None, tensor):
    """The module holding `op`: kernels/triton/<op>.py when `tensor` is on CUDA, else
    kernels/reference/<op>.py; `use_triton` forces either (Triton on CPU tensors needs
    TRITON_INTERPRET=1, set before triton is imported). Triton is imported only when chosen,
    so CPU-only callers never pay for it."""
    chosen = tensor.is_cuda if use_triton is None else use_triton
    return importlib.import_module(f"moeferry.kernels.{'triton' if chosen else 'reference'}.{op}")
