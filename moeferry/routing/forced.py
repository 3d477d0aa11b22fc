"""Generated routes forced on a loaded model (benchmarks' `--routing`): forward hooks on every MoE
router that replace its choice with a RouteGenerator's, inside captured decode graphs too.

The first MoE layer's hook of each forward draws every layer's routes of the forward at once
(`RouteGenerator.generate`), so while layer l runs, layer l+1's true routes already sit in
`routes[l + 1]`. With `oracle_recall` set, the same hook also draws every layer's oracle
prediction (`OraclePredictor`: each true id kept with that probability, the rest replaced by
wrong ids) into `predictions` [L, max_rows, width]: what a prefetcher under generated routes,
which carry no hidden state, reads for layer l+1 while layer l computes. Every later MoE
layer's hook reads its own row of `routes`.

How a router's output is replaced, so the MoE block's own weights rule still applies:
- a Linear gate (logits [T, E], then MoEBlock's softmax top-k): the logits are kept at the
  forced experts and set to FORCED_OFF elsewhere, so the top-k is the forced set and its
  weights are the softmax of the router's own logits over it;
- a router that routes by itself ((weights, ids), DeepSeek's): the ids are replaced and its
  weights kept (its top-k weights, scaling included, now on the forced experts).

The graphs capture the hooks: recapture them after `install` and after `remove`.
"""

from __future__ import annotations

import torch

from moeferry.kernels.generated_routes import FORCED_OFF, force_logits
from moeferry.routing.profiles import OraclePredictor, RouteGenerator, RoutingProfile

__all__ = ["FORCED_OFF", "ForcedRouting"]


class ForcedRouting:
    """Hooks on `model`'s MoE routers forcing `profile`'s routes (see the module). `generator`
    holds the routes of the latest forward, `routes` [L, max_rows, K] in MoE-layer order (index
    i is the i-th MoE layer); `predictions` [L, max_rows, width] the oracle's, with
    `oracle_recall` (None: no oracle)."""

    def __init__(self, model, mc, profile: RoutingProfile, max_rows: int, device: torch.device | str,
                 seed: int = 0, decode_rows: int | None = None, oracle_recall: float | None = None,
                 oracle_width: int | None = None):
        self.profile, self.layer_ids = profile, tuple(mc.moe_layer_ids)
        layers = len(self.layer_ids)
        self.generator = RouteGenerator(profile, layers, mc.num_experts, mc.top_k, max_rows,
                                        device=device, seed=seed, decode_rows=decode_rows)
        self.oracle = self.predictions = None
        if oracle_recall is not None:
            self.oracle = OraclePredictor(layers, mc.num_experts, mc.top_k, oracle_recall,
                                          self.generator.decode_rows, oracle_width, device, seed)
            self.predictions = torch.zeros((layers, max_rows, self.oracle.width), dtype=torch.int64, device=device)
        self.handles = [model.moe_block(layer_id).route_module.register_forward_hook(self._hook(i))
                        for i, layer_id in enumerate(self.layer_ids)]

    @classmethod
    def install(cls, engine, profile: RoutingProfile, seed: int = 0, oracle_recall: float | None = None,
                oracle_width: int | None = None) -> "ForcedRouting":
        """Hooks on `engine`'s model for its widest forward (a prefill chunk or the decode rows)."""
        ec = engine.ec
        return cls(engine.runner.model, engine.mc, profile, max(ec.max_prefill_tokens, ec.max_running_requests),
                   engine.runner.device, seed, decode_rows=ec.max_running_requests, oracle_recall=oracle_recall,
                   oracle_width=oracle_width)

    @property
    def routes(self) -> torch.Tensor:
        return self.generator.routes

    def _hook(self, moe_index: int):
        def force(_module, inputs, out):
            rows = inputs[0].shape[0]
            if moe_index == 0:
                routes = self.generator.generate(rows)
                if self.oracle is not None:
                    self.predictions[:, :rows].copy_(self.oracle.predict(routes))
            ids = self.generator.routes[moe_index, :rows]
            if isinstance(out, tuple):
                weights, _ = out
                return weights, ids.to(torch.int32)
            return force_logits(out, ids)
        return force

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
