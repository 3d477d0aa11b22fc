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

`FittedPredictors` is the trained alternative, measured beside it: per pair of consecutive MoE
layers a map from layer l's MoE input (the earliest input) to layer l+1's router scores, a
Linear by ridge regression or a small MLP, fitted on hidden states a probe recorded
(`PredictorProbe(collect=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.layers.linear import Linear
from moeferry.layers.moe import predict_experts, router_scores

INPUTS = ("moe_input", "residual", "residual_input_norm")
PREDICTOR_FORMAT = "moeferry-next-layer-predictors-1"


def routed_ids(block, hidden: torch.Tensor) -> torch.Tensor:
    """The experts `block` (a MoEBlock) routes `hidden` [T, H] to, [T, K], by its own rule
    (softmax top-k, or its router's), without firing router hooks."""
    router = block.route_module
    if isinstance(router, Linear):
        return router.forward(hidden).float().topk(block.top_k, dim=1).indices
    return router.forward(hidden)[1].long()


class FittedPredictors:
    """Trained next-layer predictors: `maps[nxt]`, a module from layer prev's MoE input [T, H]
    to MoE layer `nxt`'s router scores [T, E] (or logits ranking the same way); the prediction is
    their top `width`. Fitted from recorded pairs, by ridge regression (`fit`: one Linear) or
    by a small MLP trained on the routed experts (`fit_mlp`), so they cost a GEMV or two a layer
    and no change to the model."""

    def __init__(self, maps: dict[int, torch.nn.Module]):
        self.maps = maps

    @staticmethod
    def _pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([h for h, _ in pairs]).float(), torch.cat([t for _, t in pairs]).float()

    @classmethod
    def fit(cls, samples: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], ridge: float = 1e-3) -> "FittedPredictors":
        """Ridge regression per layer, in float64: W = (X'X + lambda D)^-1 X'Y over the recorded
        (MoE input [T, H], next router scores [T, E]) pairs, X with a ones column, lambda =
        `ridge` times the mean of X'X's diagonal, D the identity with the bias's entry 0."""
        maps = {}
        for nxt, pairs in samples.items():
            h, y = cls._pairs(pairs)
            x = torch.cat([h.double(), torch.ones(h.shape[0], 1, dtype=torch.float64)], dim=1)
            gram = x.T @ x
            shrink = torch.ones(gram.shape[0], dtype=x.dtype)
            shrink[-1] = 0.0
            gram += torch.diag(shrink) * ridge * gram.diagonal()[:-1].mean()
            w = torch.linalg.solve(gram, x.T @ y.double()).float()
            linear = torch.nn.Linear(h.shape[1], y.shape[1])
            with torch.no_grad():
                linear.weight.copy_(w[:-1].T)
                linear.bias.copy_(w[-1])
            maps[nxt] = linear
        return cls(maps)

    @classmethod
    def fit_mlp(cls, samples: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], top_k: int, hidden: int = 512,
                steps: int = 600, lr: float = 3e-3, seed: int = 0) -> "FittedPredictors":
        """Per layer an MLP (Linear, GELU, Linear) trained full-batch with Adam for `steps` on
        the binary cross-entropy of each expert being among the next layer's top-k scored
        (the routed experts, for a softmax router), from a seeded initialisation."""
        maps = {}
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            for nxt, pairs in samples.items():
                x, y = cls._pairs(pairs)
                target = torch.zeros_like(y).scatter_(1, y.topk(top_k, dim=1).indices, 1.0)
                mlp = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.GELU(),
                                          torch.nn.Linear(hidden, y.shape[1]))
                opt = torch.optim.Adam(mlp.parameters(), lr=lr, weight_decay=1e-4)
                for _ in range(steps):
                    opt.zero_grad()
                    torch.nn.functional.binary_cross_entropy_with_logits(mlp(x), target).backward()
                    opt.step()
                maps[nxt] = mlp.requires_grad_(False)
        return cls(maps)

    def save(self, path: str) -> None:
        """One safetensors file: each map's parameters under "<next layer id>.<name>", the kind
        of map (linear or mlp) in the metadata."""
        from safetensors.torch import save_file

        kinds = {"linear" if isinstance(m, torch.nn.Linear) else "mlp" for m in self.maps.values()}
        tensors = {f"{nxt}.{name}": t.detach().contiguous().cpu() for nxt, m in self.maps.items()
                   for name, t in m.state_dict().items()}
        save_file(tensors, path, metadata={"kind": kinds.pop(), "format": PREDICTOR_FORMAT})

    @classmethod
    def load(cls, path: str) -> "FittedPredictors":
        """What `save` wrote (ValueError, one line, for a file that is not one)."""
        from safetensors import safe_open

        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # safetensors raises its own error types for a bad header
            raise ValueError(f"{path}: not a predictors file ({str(exc).splitlines()[0]})") from None
        if meta.get("format") != PREDICTOR_FORMAT or meta.get("kind") not in ("linear", "mlp"):
            raise ValueError(f"{path}: not a predictors file written by `moeferry routing fit`")
        layers: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            nxt, name = key.split(".", 1)
            layers.setdefault(int(nxt), {})[name] = t
        maps = {}
        for nxt, params in layers.items():
            if meta["kind"] == "linear":
                out, inp = params["weight"].shape
                module = torch.nn.Linear(inp, out)
            else:
                hidden, inp = params["0.weight"].shape
                module = torch.nn.Sequential(torch.nn.Linear(inp, hidden), torch.nn.GELU(),
                                             torch.nn.Linear(hidden, params["2.weight"].shape[0]))
            module.load_state_dict(params)
            maps[nxt] = module.requires_grad_(False)
        return cls(maps)

    def check(self, layer_ids: list[int], hidden_size: int, num_experts: int) -> None:
        """ValueError (one line) unless the maps predict exactly `layer_ids` (every MoE layer
        but the first) from `hidden_size` inputs to `num_experts` scores."""
        if sorted(self.maps) != sorted(layer_ids):
            raise ValueError(f"the predictors are for layers {sorted(self.maps)}, the model's MoE layers after the "
                             f"first are {sorted(layer_ids)}")
        for nxt, m in self.maps.items():
            first, last = (m, m) if isinstance(m, torch.nn.Linear) else (m[0], m[-1])
            if first.in_features != hidden_size or last.out_features != num_experts:
                raise ValueError(f"the predictor of layer {nxt} maps {first.in_features} to {last.out_features}, "
                                 f"the model needs {hidden_size} to {num_experts}")

    def to(self, device) -> "FittedPredictors":
        self.maps = {nxt: m.to(device) for nxt, m in self.maps.items()}
        return self

    @torch.no_grad()
    def predict(self, nxt: int, hidden: torch.Tensor, width: int) -> torch.Tensor:
        """Layer `nxt`'s predicted experts [T, width], best first, from the previous MoE layer's input."""
        return self.maps[nxt](hidden.float()).topk(width, dim=1).indices


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
