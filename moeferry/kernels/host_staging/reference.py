"""Staged copies, plain torch: the oracle for kernels/host_staging/triton.py (the contract:
kernels/host_staging/__init__.py)."""
from __future__ import annotations

import torch

from moeferry.kernels.host_staging import check_pairs, check_routes


def staged_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    check_pairs(pairs)
    for src, dst in pairs:
        dst.copy_(src.reshape(dst.shape))


def staged_routes(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, keep: bool = False) -> None:
    check_routes(src, dst, ids)
    other = dst.clone() if keep else 0.0
    dst.copy_(torch.where((ids >= 0).to(dst.device).unsqueeze(-1), src.to(dst.device), other))
