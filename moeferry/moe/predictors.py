"""Trained next-layer expert predictors (`--moe-prefetch fitted`): per pair of consecutive MoE
layers, a small module from layer l's MoE input to layer l+1's router scores, fitted on hidden
states recorded from the model (routing/predict.py records them and measures the predictors;
`moeferry routing fit` writes them), loaded by the lookahead (moe/prefetch.py).

The file: safetensors, each map's parameters under "<next layer id>.<name>" (a Linear's
"weight" and "bias", an MLP's "0.*" and "2.*"), PREDICTOR_FORMAT in the metadata.
"""

from __future__ import annotations

import torch

PREDICTOR_FORMAT = "moeferry-next-layer-predictors-1"


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
        """One safetensors file (the module docstring's layout)."""
        from safetensors.torch import save_file

        tensors = {f"{nxt}.{name}": t.detach().contiguous().cpu() for nxt, m in self.maps.items()
                   for name, t in m.state_dict().items()}
        save_file(tensors, path, metadata={"format": PREDICTOR_FORMAT})

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
        if meta.get("format") != PREDICTOR_FORMAT:
            raise ValueError(f"{path}: not a predictors file written by `moeferry routing fit`")
        layers: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            nxt, name = key.split(".", 1)
            layers.setdefault(int(nxt), {})[name] = t
        maps = {}
        for nxt, params in layers.items():
            if "weight" in params:  # a Linear; else an MLP's layers 0 and 2
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
