"""The next-layer expert predictor: layer l+1's own router applied early, to a hidden state that
exists before layer l+1 routes, so its experts can be moved while layer l computes. No
training, no weights of its own.

Inputs it can be given (`INPUTS`, measured by benchmarks/bench_predictor.py):
- `moe_input`: layer l's MoE input, the normed stream after layer l's attention (ready when
  layer l's experts start: the whole of layer l's MoE and layer l+1's attention to hide a
  copy behind);
- `residual`: the stream entering layer l+1 (layer l's MoE output added), normed by layer
  l+1's post-attention norm, the norm its router is trained behind (ready when layer l ends:
  layer l+1's attention to hide behind);
- `residual_input_norm`: the same stream normed by layer l+1's input norm, as its attention
  sees it.

`predict_experts(router, hidden, width)` (layers/moe.py, beside the routers it reads) is the
predictor: the `width` experts the router scores highest (width >= top_k predicts more than it
will route: more recall, more bytes).

`FittedPredictors` (moe/predictors.py) is the trained alternative, measured beside it: per pair of consecutive MoE
layers a map from layer l's MoE input (the earliest input) to layer l+1's router scores, a
Linear by ridge regression or a small MLP, fitted on hidden states a probe recorded
(`PredictorProbe(collect=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.layers.linear import Linear
from moeferry.layers.moe import predict_experts, router_scores
from moeferry.moe.predictors import FittedPredictors

INPUTS = ("moe_input", "residual", "residual_input_norm")


def routed_ids(block, hidden: torch.Tensor) -> torch.Tensor:
    """The experts `block` (a MoEBlock) routes `hidden` [T, H] to, [T, K], by its own rule
    (softmax top-k, or its router's), without firing router hooks."""
    router = block.route_module
    if isinstance(router, Linear):
        return router.forward(hidden).float().topk(block.top_k, dim=1).indices
    return router.forward(hidden)[1].long()


# ---- measuring it on a model's own routing ----------------------------------------------------
@dataclass
class Recall:
    """Counts over every (token, predicted layer) pair: `hits` true experts predicted, `routed`
    true experts in all, `predicted` predictions made; per prediction width."""

    width: int
    hits: int = 0
    routed: int = 0
    predicted: int = 0

    @property
    def recall(self) -> float:
        return self.hits / self.routed if self.routed else float("nan")

    @property
    def wasted(self) -> int:
        """Predicted experts the layer did not route: a prefetch's wasted copies."""
        return self.predicted - self.hits


class PredictorProbe:
    """Forward hooks on a model that capture, in every forward, each MoE layer's input and the
    stream entering the next MoE layer, and count how well each of INPUTS predicts the next
    MoE layer's routes at each width in `widths` (multiples of top_k, e.g. (1, 2)), and so do
    `fitted` predictors if given (counted as "fitted"). With `collect`, each pair's (MoE input,
    next router scores) is also kept in `samples`, keyed by the next layer, for
    `FittedPredictors.fit`. Pairs are consecutive MoE layers (a dense layer between two is
    skipped over). `remove()` ends it."""

    def __init__(self, model, mc, widths=(1, 2), fitted: FittedPredictors | None = None, collect: bool = False):
        self.model, self.mc = model, mc
        self.widths = tuple(w * mc.top_k for w in widths)
        self.fitted, self.collect = fitted, collect
        self.names = INPUTS + (("fitted",) if fitted is not None else ())
        self.counts = {(name, w): Recall(w) for name in self.names for w in self.widths}
        self.samples: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._moe_in: dict[int, torch.Tensor] = {}
        self._stream: dict[int, torch.Tensor] = {}
        ids = list(mc.moe_layer_ids)
        self.pairs = list(zip(ids, ids[1:]))
        layers = model.model.layers
        self.handles = [layers[i].mlp_module.register_forward_pre_hook(self._on_moe(i)) for i in ids]
        self.handles += [layers[j].register_forward_pre_hook(self._on_layer(j)) for _, j in self.pairs]

    def _on_layer(self, layer_id: int):
        def capture(_module, args):
            x, residual = args[0], args[1]
            if residual is not None:
                self._stream[layer_id] = (x.sum(dim=1) if x.dim() == 3 else x) + residual
        return capture

    def _on_moe(self, layer_id: int):
        def capture(_module, args):
            self._moe_in[layer_id] = args[0]
            for prev, nxt in self.pairs:
                if nxt == layer_id and prev in self._moe_in and nxt in self._stream:
                    self._count(prev, nxt, args[0])
        return capture

    @torch.no_grad()
    def _count(self, prev: int, nxt: int, next_input: torch.Tensor) -> None:
        layer = self.model.model.layers[nxt]
        block = layer.mlp_module
        stream = self._stream[nxt].to(next_input.dtype)
        hidden = {"moe_input": self._moe_in[prev], "residual": layer.post_attention_layernorm(stream),
                  "residual_input_norm": layer.input_layernorm(stream)}
        true = routed_ids(block, next_input)
        if self.collect:
            self.samples.setdefault(nxt, []).append(
                (self._moe_in[prev].float().cpu(), router_scores(block.route_module, next_input).cpu()))
        for name in self.names:
            for width in self.widths:
                w = min(width, self.mc.num_experts)
                pred = (self.fitted.predict(nxt, self._moe_in[prev], w) if name == "fitted"
                        else predict_experts(block.route_module, hidden[name], w))
                c = self.counts[name, width]
                c.hits += int((pred[:, :, None] == true[:, None, :]).any(dim=2).sum())
                c.routed += true.numel()
                c.predicted += pred.numel()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def windows(ids: list[int], count: int, length: int) -> list[list[int]]:
    """Up to `count` windows of `length` tokens spread evenly over `ids`."""
    stride = max(length, (len(ids) - length) // max(1, count))
    return [ids[s:s + length] for s in range(0, len(ids) - length, stride)][:count]


def probe_prefills(llm, prompts: list[list[int]], fitted: FittedPredictors | None = None,
                   collect: bool = False) -> tuple[PredictorProbe, int]:
    """A PredictorProbe over one prefill of each prompt (an LLM's engine), and the tokens counted."""
    from moeferry.sampling import SamplingParams

    engine = llm.engine
    probe = PredictorProbe(engine.runner.model, engine.mc, fitted=fitted, collect=collect)
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    finally:
        probe.remove()
    return probe, sum(len(p) for p in prompts)


def fit_on(llm, prompts: list[list[int]], hidden: int = 512, ridge: float = 1e-3) -> FittedPredictors:
    """Predictors fitted on one prefill of each of `prompts`: an MLP of `hidden` per layer pair
    (`FittedPredictors.fit_mlp`), or with hidden 0 a Linear by ridge regression (`fit`)."""
    probe, _ = probe_prefills(llm, prompts, collect=True)
    if hidden:
        return FittedPredictors.fit_mlp(probe.samples, llm.engine.mc.top_k, hidden=hidden)
    return FittedPredictors.fit(probe.samples, ridge)
