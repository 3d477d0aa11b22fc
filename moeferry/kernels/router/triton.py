"""The MoE router as one Triton launch: fp32 softmax, top-k, optional renormalisation and the
casts, in place of the ~8 small torch kernels of kernels/router/reference.py (the oracle).

Contract of ``softmax_topk`` (the reference's signature and results):
    logits       [T, E] bf16|fp16|fp32, unit last stride, any row stride; read only.
                 1 <= E <= MAX_EXPERTS, 1 <= top_k <= E.
    weights_out  [T, top_k] fp32, contiguous (written; allocated unless given): the softmax
                 probabilities of the chosen experts in descending order, divided by their
                 fp32 sum when ``renormalize``, then rounded to logits.dtype and back.
    ids_out      [T, top_k] int32, contiguous (written; allocated unless given): the experts.
Every element of both outputs is written; neither may overlap logits.

Order and ties: round k takes the largest logit not yet taken (softmax is monotone, so this
is torch.topk's descending order on the probabilities), ties going to the lowest expert
index. Selecting on the logits rather than on the rounded probabilities keeps the order a
function of the inputs alone: two distinct logits never tie. Rows holding NaN give NaN
weights and unspecified, but in-range, ids.

Numerics: max-subtracted exp and an fp32 sum over the row, IEEE division; the weights differ
from torch's by the sum's order and exp's last bit (a few fp32 ulps), so after rounding to
bf16/fp16 they equal the reference's or are one ulp of that dtype away.

The grid is (T,) and nothing is read back, so a call captures in a CUDA graph and replays with
new logits in the same buffers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.kernels.triton_common import output_buffer, pdl_launch, rounded, wait_for_previous_kernel

__all__ = ["MAX_EXPERTS", "softmax_topk"]

MAX_EXPERTS = 4096  # one program holds a whole row: BLOCK_E / (32 * 8 warps) = 16 values a thread
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, E, row_stride,
                         K: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    x = tl.load(logits_ptr + row * row_stride + experts, mask=valid, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    total = tl.sum(tl.where(valid, tl.exp(x - top), 0.0), axis=0)

    slots = tl.arange(0, BLOCK_K)
    chosen_x = tl.full([BLOCK_K], float("-inf"), tl.float32)
    chosen_id = tl.zeros([BLOCK_K], tl.int32)
    free = valid
    for k in range(K):
        best = tl.max(tl.where(free, x, float("-inf")), axis=0)
        # `free &` matters when logits are -inf: a taken -inf must not be taken again.
        pick = tl.min(tl.where(free & (x == best), experts, BLOCK_E), axis=0)
        pick = tl.minimum(pick, E - 1)  # no match only if best is NaN; keep the id in range
        free = free & (experts != pick)
        chosen_x = tl.where(slots == k, best, chosen_x)
        chosen_id = tl.where(slots == k, pick, chosen_id)

    used = slots < K
    w = tl.div_rn(tl.where(used, tl.exp(chosen_x - top), 0.0), total)
    if RENORMALIZE:
        w = tl.div_rn(w, tl.sum(w, axis=0))
    w = rounded(w, logits_ptr.dtype.element_ty)
    out = row * K + slots
    tl.store(weights_ptr + out, w, mask=used)
    tl.store(ids_ptr + out, chosen_id, mask=used)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 weights_out: torch.Tensor | None = None,
                 ids_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] fp32, ids [T, top_k] int32) of logits [T, E] in one launch; see the
    module docstring for the contract."""
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise ValueError(f"logits: expected [T, E] bf16|fp16|fp32, got {tuple(logits.shape)} {logits.dtype}")
    t, e = logits.shape
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"{e} experts: the router kernel holds a row in one program, 1..{MAX_EXPERTS}")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} out of 1..{e}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights_out = output_buffer(weights_out, (t, top_k), torch.float32, logits.device, "weights_out")
    ids_out = output_buffer(ids_out, (t, top_k), torch.int32, logits.device, "ids_out")
    if t == 0:
        return weights_out, ids_out
    block_e = triton.next_power_of_2(e)
    _softmax_topk_kernel[(t,)](
        logits, weights_out, ids_out, e, logits.stride(0),
        K=top_k, RENORMALIZE=bool(renormalize), BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=min(8, max(1, block_e // 256)), **pdl_launch(logits.device))
    return weights_out, ids_out
