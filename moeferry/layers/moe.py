"""The MoE block: router (gate logits through layers/linear.py; scores, top-k, normalisation:
kernels/router.py, one Triton launch on CUDA), optional shared expert, and the routed experts
computed by the engine's MoE strategy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeferry.kernels.router import softmax_topk
from moeferry.layers.linear import Linear


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
    runs behind the same forward.
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

    def forward(self, x: torch.Tensor, is_decode: bool, sum_routes: bool = True) -> torch.Tensor:
        """[T, H]; with sum_routes=False and no shared expert, the weighted per-route outputs
        [T, K, H] instead, for a caller whose next op sums them anyway (the decoder's residual
        add, RMSNorm.add_and_norm): the MoE then needs no summing launch of its own."""
        weights, ids = softmax_topk(self.gate(x), self.top_k, self.renormalize)
        self.strategy.record_routes(self.layer_id, ids)
        out = self.strategy.forward(self.layer_id, x, weights, ids, is_decode,
                                    sum_routes=sum_routes or self.shared_expert is not None)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
