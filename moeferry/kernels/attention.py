"""Attention dispatch: plain torch (kernels/reference/attention.py) for now on every device.

A Triton paged decode kernel is the serving issue's; it will slot in here by device.
"""

from moeferry.kernels.reference.attention import decode_attention, prefill_attention

__all__ = ["decode_attention", "prefill_attention"]
