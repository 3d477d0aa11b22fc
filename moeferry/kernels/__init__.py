"""Kernels: each op as a Triton kernel (triton/<op>.py) beside its plain-torch oracle
(reference/<op>.py). Callers go through the dispatchers in moeferry.kernels.ops, which run
the Triton kernel on CUDA tensors and the reference elsewhere."""
