"""The MoE block: router (gate logits through layers/linear.py; scores, top-k, normalisation:
kernels/router.py, one Triton launch on CUDA), optional shared expert, and the routed experts
computed by the engine's MoE strategy."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from moeferry.kernels import router
from moeferry.kernels.router import softmax_topk
from moeferry.layers.linear import Linear
from moeferry.layers.norm import RMSNorm


# MOEFERRY_FUSED_ENTRY=0 (or set_fused_entry(False)) keeps a MoE layer's entry as four launches
# (add + norm, gate linear, top-k); a captured CUDA graph keeps what it was captured with.
_fused_entry_enabled = os.environ.get("MOEFERRY_FUSED_ENTRY", "1") != "0"


def set_fused_entry(enabled: bool) -> None:
    """Whether MoEBlock.forward_after_add may run its entry as one launch (add_norm_route)."""
    global _fused_entry_enabled
    _fused_entry_enabled = bool(enabled)


class DenseMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    """Routes each token to top_k of the layer's experts and sums their outputs, weighted.

    The routed experts' weights are not parameters of this module: they live in the banks
    the strategy allocated (GPU memory, pinned host memory, a slot cache), so every strategy
    runs behind the same forward. ``route_ticket`` (a [1] int32 zero, a buffer so it follows
    the module's device) is the arrival counter of the fused entry kernel (forward_after_add);
    each launch leaves it 0.
    """

    def __init__(self, mc, layer_id: int, strategy, renormalize: bool, shared_expert: bool):
        super().__init__()
        h, e = mc.hidden_size, mc.num_experts
        self.layer_id, self.top_k, self.renormalize = layer_id, mc.top_k, renormalize
        self.gate = Linear(h, e, bias=False)  # the skinny kernel at decode sizes; hooks still fire
        self.strategy = strategy
        self.banks = strategy.allocate_banks(layer_id, e, h, mc.moe_intermediate_size)
        if shared_expert:
            self.shared_expert = DenseMLP(h, mc.hf.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        else:
            self.shared_expert = None
        self.register_buffer("route_ticket", torch.zeros(1, dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor, is_decode: bool, sum_routes: bool = True) -> torch.Tensor:
        """[T, H]; with sum_routes=False and no shared expert, the weighted per-route outputs
        [T, K, H] instead, for a caller whose next op sums them anyway (the decoder's residual
        add, RMSNorm.add_and_norm): the MoE then needs no summing launch of its own."""
        weights, ids = softmax_topk(self.gate(x), self.top_k, self.renormalize)
        return self._experts(x, weights, ids, is_decode, sum_routes)

    def forward_after_add(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, is_decode: bool,
                          sum_routes: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(h), x + residual) with h = norm(x + residual): the decoder's post-attention
        add + norm and this block. At decode sizes on CUDA the add, the norm, the gate's linear
        and the top-k run as one launch (kernels/router.add_norm_route), unless hooks on the
        gate ask to see its output (benchmarks/bench_uva.py skews routing with one)."""
        if self._fuses_entry(x):
            h, residual, weights, ids = router.add_norm_route(
                x, residual, norm.weight, norm.eps, self.gate.weight, self.top_k, self.renormalize,
                self.route_ticket)
        else:
            h, residual = norm.add_and_norm(x, residual)
            weights, ids = softmax_topk(self.gate(h), self.top_k, self.renormalize)
        return self._experts(h, weights, ids, is_decode, sum_routes), residual

    def _fuses_entry(self, x: torch.Tensor) -> bool:
        gate = self.gate
        hooked = bool(gate._forward_hooks or gate._forward_pre_hooks or nn.modules.module._global_forward_hooks
                      or nn.modules.module._global_forward_pre_hooks)
        return (_fused_entry_enabled and x.is_cuda and x.dim() == 2 and not hooked and gate.bias is None
                and x.dtype in (torch.bfloat16, torch.float16) and gate.weight.dtype == x.dtype
                and router.fusable(x.shape[0], x.shape[1], gate.weight.shape[0]))

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, is_decode: bool,
                 sum_routes: bool) -> torch.Tensor:
        out = self.strategy.forward(self.layer_id, x, weights, ids, is_decode,
                                    sum_routes=sum_routes or self.shared_expert is not None)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
