"""The MoE block: router (gate logits through layers/linear.py; scores, top-k, normalisation:
kernels/router.py, one Triton launch on CUDA; or a family's own router module, DeepSeek's
GroupedTopKRouter), optional shared experts, and the routed experts computed by the engine's
MoE strategy."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from moeferry.kernels.fused_moe import SILU, Activation
from moeferry.kernels.router import grouped_topk, softmax_topk
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


class GroupedTopKRouter(nn.Module):
    """DeepSeek's router: fp32 logits of `weight` [E, H], then kernels.router.grouped_topk
    (softmax or sigmoid scores, `e_score_correction_bias` [E] for the choice only when scoring
    by sigmoid, group-limited choice, renormalisation, routed scaling).

    Invariant: its parameters stay float32 whatever the model's dtype (`keeps_fp32`, honoured
    by the runner before loading), as the HF models keep them: the choice between experts whose
    biased scores are close must not depend on bf16 rounding.
    """

    keeps_fp32 = True

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool, *, scoring: str,
                 num_groups: int = 1, topk_groups: int = 1, scaling: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if scoring == "sigmoid" else None
        self.top_k, self.renormalize, self.scoring = top_k, renormalize, scoring
        self.num_groups, self.topk_groups, self.scaling = num_groups, topk_groups, scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, top_k] fp32, ids [T, top_k] int32)."""
        logits = F.linear(x.float(), self.weight.float())
        return grouped_topk(logits, self.top_k, self.renormalize, scoring=self.scoring,
                            correction_bias=self.e_score_correction_bias, num_groups=self.num_groups,
                            topk_groups=self.topk_groups, scaling=self.scaling)


def router_scores(router: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """[T, E] float32 scores whose order is the router's preference: a Linear gate's logits
    (the softmax keeps their order), or a self-routing router's (DeepSeek's) choice scores:
    its logits, or sigmoid(logits) + its correction bias when it scores by sigmoid (its group
    limit is left out: a prediction, not the route). Calls the modules' forward directly, so
    router hooks (benchmarks' forced routes) neither fire nor change the prediction."""
    if isinstance(router, Linear):
        return router.forward(hidden).float()
    logits = F.linear(hidden.float(), router.weight.float())
    if getattr(router, "scoring", "softmax") == "sigmoid":
        bias = router.e_score_correction_bias
        return torch.sigmoid(logits) + (0.0 if bias is None else bias.float())
    return logits


def predict_experts(router: torch.nn.Module, hidden: torch.Tensor, width: int) -> torch.Tensor:
    """The next layer's predicted experts: `router` (layer l+1's MoEBlock.route_module), a
    hidden state [T, H] (routing/predict.py: which) -> ids [T, width] int64, best first.
    Fixed shapes, no host sync: callable inside a captured decode graph."""
    return router_scores(router, hidden).topk(width, dim=1).indices


class MoEBlock(nn.Module):
    """Routes each token to top_k of the layer's experts and sums their outputs, weighted.

    The routed experts' weights are not parameters of this module: they live in the banks
    the strategy allocated (GPU memory, pinned host memory, a slot cache), so every strategy
    runs behind the same forward. Shared experts are dense modules here, resident on the
    device like every dense weight: `shared_expert` (Qwen2-MoE, scaled by a sigmoid gate) or
    `shared_experts` of `shared_experts_size` intermediate rows, added unscaled (DeepSeek).
    `router`, when given, replaces the Linear gate: a Linear (gpt-oss's, with a bias) still
    takes the softmax top-k, another module routes by itself (DeepSeek's); it is named
    `router_name` as in the checkpoint. `expert_bias` and `activation` say what the routed
    experts compute (their banks hold the biases).
    """

    def __init__(self, mc, layer_id: int, strategy, renormalize: bool, shared_expert: bool, *,
                 router: nn.Module | None = None, shared_experts_size: int = 0, router_name: str = "gate",
                 expert_bias: bool = False, activation: Activation = SILU):
        super().__init__()
        h, e = mc.hidden_size, mc.num_experts
        self.layer_id, self.top_k, self.renormalize = layer_id, mc.top_k, renormalize
        # the skinny kernel at decode sizes; hooks still fire
        self.router_name = router_name
        self.add_module(router_name, Linear(h, e, bias=False) if router is None else router)
        self.strategy = strategy
        strategy.attach_predictor(layer_id, partial(predict_experts, self.route_module))
        self.banks = strategy.allocate_banks(layer_id, e, h, mc.moe_intermediate_size, bias=expert_bias,
                                             activation=activation)
        if shared_expert:
            self.shared_expert = DenseMLP(h, mc.hf.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        else:
            self.shared_expert = None
        self.shared_experts = DenseMLP(h, shared_experts_size) if shared_experts_size else None

    @property
    def route_module(self) -> nn.Module:
        """The router, under its checkpoint name (`gate`, gpt-oss's `router`)."""
        return getattr(self, self.router_name)

    def forward(self, x: torch.Tensor, is_decode: bool, sum_routes: bool = True) -> torch.Tensor:
        """[T, H]; with sum_routes=False and no shared expert, the weighted per-route outputs
        [T, K, H] instead, for a caller whose next op sums them anyway (the decoder's residual
        add, RMSNorm.add_and_norm): the MoE then needs no summing launch of its own."""
        router = self.route_module
        if isinstance(router, Linear):
            weights, ids = softmax_topk(router(x), self.top_k, self.renormalize)
        else:
            weights, ids = router(x)
        self.strategy.record_routes(self.layer_id, ids)
        shared = self.shared_expert is not None or self.shared_experts is not None
        out = self.strategy.forward(self.layer_id, x, weights, ids, is_decode, sum_routes=sum_routes or shared)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
