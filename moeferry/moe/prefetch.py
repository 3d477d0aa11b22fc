"""Lookahead prefetch: while a decode MoE layer computes, the experts predicted for the next MoE
layer are admitted into the slot cache and copied beside it, so that when the next layer
routes, only the mispredicted misses are left to copy.

One decode MoE layer with prefetch (MoEStrategy.forward; all device work, inside the decode
CUDA graph, no host sync):

    join     the main stream waits for the previous lookahead's copies (the copy engine's done
             word, or the side stream) before this layer admits (nothing of the cache's is
             written twice at once)
    observe  (statistics only) the layer's routes against what was predicted and copied for it
    locate   the layer's own admission and its misses' copies, on the main stream
    ahead    the next MoE layer's predicted experts admitted without a clock step, so this
             layer's slots stay out of the candidates (kernels/admission/reference.py: never
             evicted while it computes); under a route split only the device channel's part
             (`ahead_part`), at most --moe-prefetch-experts misses; their copies posted to the
             store's copy engine (--moe-prefetch-copy dma, SlotStore.copy_engine) or forked
             onto a side stream as a gather (gather)
    compute  this layer's fused MoE on the main stream, beside the copies

A wrong prediction costs copies, never correctness: the next layer's own admission finds what
it routes, hit or miss, as it would without prefetch, and the kernels read the same rows.

Predictors (--moe-prefetch): `router`, the next MoE layer's own router applied to this layer's
MoE input (layers/moe.py predict_experts, measured in routing/predict.py: no weights of its own; the input ready earliest, so the copies
have this layer's whole MoE and the next layer's attention to hide behind). Under generated
routes, which carry no hidden state, a benchmark hands oracle predictions of a stated recall
instead (`predict_from`).
"""

from __future__ import annotations

from typing import Callable

import torch

from moeferry.kernels.gather_copy import GatherTuning
from moeferry.moe.predictors import FittedPredictors

PREFETCH_MODES = ("off", "router", "fitted")
PREFETCH_COPIES = ("gather", "dma")


class PrefetchCounts:
    """Device counters per MoE layer (int64 [L]), counted inside the decode graph: `predicted`
    distinct experts predicted for the layer, `copied` of them copied ahead (the rest were
    resident), `useful` copied experts the layer then routed, `routed` distinct experts it
    routed, `predicted_hit` routed experts that were predicted. Between a lookahead and the
    layer's routing, [L, E] masks hold what was predicted and copied."""

    FIELDS = ("predicted", "copied", "useful", "routed", "predicted_hit")

    def __init__(self, num_layers: int, num_experts: int, device: torch.device):
        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.counts = {name: zeros(num_layers) for name in self.FIELDS}
        self.predicted_mask = zeros(num_layers, num_experts)
        self.copied_mask = zeros(num_layers, num_experts)
        self.num_experts = num_experts

    def _mark(self, mask: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """mask[e] += 1 for each valid id (times `weight`); ids outside [0, E) are left out."""
        ids = ids.reshape(-1).long()
        valid = ((ids >= 0) & (ids < self.num_experts)).long()
        mask.index_add_(0, ids.clamp(0, self.num_experts - 1), valid if weight is None else valid * weight)

    def ahead(self, moe_layer: int, predicted_ids: torch.Tensor, plan_src: torch.Tensor,
              plan_count: torch.Tensor) -> None:
        predicted = self.predicted_mask[moe_layer]
        self._mark(predicted, predicted_ids)
        predicted.clamp_(max=1)
        planned = (torch.arange(plan_src.numel(), device=plan_src.device) < plan_count).long()
        self._mark(self.copied_mask[moe_layer], plan_src, planned)
        self.counts["predicted"][moe_layer] += predicted.sum()
        self.counts["copied"][moe_layer] += plan_count[0]

    def observe(self, moe_layer: int, topk_ids: torch.Tensor) -> None:
        routed = torch.zeros(self.num_experts, dtype=torch.int64, device=topk_ids.device)
        self._mark(routed, topk_ids)
        routed.clamp_(max=1)
        predicted, copied = self.predicted_mask[moe_layer], self.copied_mask[moe_layer]
        self.counts["routed"][moe_layer] += routed.sum()
        self.counts["predicted_hit"][moe_layer] += (routed * predicted).sum()
        self.counts["useful"][moe_layer] += (routed * copied.clamp(max=1)).sum()
        predicted.zero_()
        copied.zero_()

    def reset(self) -> None:
        for tensor in (*self.counts.values(), self.predicted_mask, self.copied_mask):
            tensor.zero_()

    def snapshot(self, expert_bytes: int) -> dict:
        per_layer = {name: t.tolist() for name, t in self.counts.items()}
        total = {name: sum(values) for name, values in per_layer.items()}
        wasted = total["copied"] - total["useful"]
        recall = [h / r if r else None for h, r in zip(per_layer["predicted_hit"], per_layer["routed"])]
        return {**total, "wasted": wasted, "copied_bytes": total["copied"] * expert_bytes,
                "wasted_bytes": wasted * expert_bytes,
                "recall": total["predicted_hit"] / total["routed"] if total["routed"] else None,
                "per_layer_recall": recall}


def fitted_predictors(path: str, layer_ids: list[int], model_config, device: torch.device) -> dict:
    """The predictors of `moeferry routing fit`'s file at `path`, as Prefetch calls them,
    (hidden, width) -> ids per predicted layer, on `device` (ConfigError for a file that does not
    fit the model)."""
    from moeferry.errors import ConfigError

    try:
        fitted = FittedPredictors.load(path)
        fitted.check(layer_ids, model_config.hidden_size, model_config.num_experts)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--moe-prefetch-predictor {path}: {exc}") from None
    fitted.to(device)
    return {nxt: (lambda hidden, width, nxt=nxt: fitted.predict(nxt, hidden, width)) for nxt in layer_ids}


class Prefetch:
    """The lookahead part of a strategy over a slot-cache store (module docstring). The MoE
    blocks attach their predictors as they are built; `finalize` takes the store once its
    cache exists."""

    def __init__(self, engine_config, model_config, mode: str = "router"):
        if mode not in PREFETCH_MODES[1:]:
            raise ValueError(f"prefetch mode must be one of {PREFETCH_MODES[1:]}, got {mode!r}")
        self.mode, self.width = mode, model_config.top_k
        self.tuning = GatherTuning(max_programs=engine_config.moe_prefetch_programs)  # the lookahead's gather grid
        self.predictor_path = engine_config.moe_prefetch_predictor  # --moe-prefetch fitted's file
        self.copy = engine_config.moe_prefetch_copy
        self.max_misses = engine_config.moe_prefetch_experts  # predicted misses fetched per layer (0: all)
        self.collect_stats = engine_config.moe_collect_stats
        self.predictors: dict[int, Callable[[torch.Tensor, int], torch.Tensor]] = {}
        self.given: torch.Tensor | None = None
        self.store = self.stream = self.counts = None
        # hybrid: which predicted experts the device channel fetches, (moe layer, ids) -> ids with
        # -1 for those left to the host when the layer routes (moe/split_policy.py device_part)
        self.ahead_part: Callable[[int, torch.Tensor], torch.Tensor] | None = None
        self.on_copy_engine = False  # lookahead copies go to the store's copy engine (set at finalize)
        self.in_flight = False  # copies started (side stream or copy engine) and not yet joined
        self.next_layer: dict[int, int] = {}  # model layer id -> the next MoE layer's, whose experts it predicts

    def attach_predictor(self, layer_id: int, predict: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        """Layer `layer_id`'s predictor: (hidden [T, H], width) -> expert ids [T, width]."""
        self.predictors[layer_id] = predict

    def finalize(self, store, device: torch.device) -> None:
        order = sorted(store.banks)
        self.store, self.next_layer = store, dict(zip(order, order[1:]))
        if self.mode == "fitted":
            self.predictors = fitted_predictors(self.predictor_path, order[1:], store.model_config, device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.on_copy_engine = self.stream is not None and self.copy == "dma" and store.has_copy_engine
        self.set_statistics(self.collect_stats)

    def set_statistics(self, on: bool) -> None:
        """Count predictions from now on (fresh counters) or stop counting; recapture decode
        graphs after this."""
        self.counts = PrefetchCounts(len(self.store.banks), self.store.model_config.num_experts,
                                     self.store.device) if on else None

    def predict_from(self, predictions: torch.Tensor | None) -> None:
        """Predictions given by the caller, [L, rows, width] in MoE-layer order, read for the
        next layer at each lookahead (None: back to the routers). Recapture decode graphs."""
        self.given = predictions

    def join(self) -> None:
        """The current stream waits for the lookahead copies in flight, if any were started (a
        capture may only wait on a side stream that joined it)."""
        if self.in_flight:
            if self.on_copy_engine:
                self.store.copy_engine().wait()
            elif self.stream is not None:
                torch.cuda.current_stream().wait_stream(self.stream)
        self.in_flight = False

    def observe(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Count a layer's routes against its prediction (the first MoE layer, which nothing
        predicts, is left out)."""
        if self.counts is not None and self.store.moe_layer_of[layer_id] > 0:
            self.counts.observe(self.store.moe_layer_of[layer_id], topk_ids)

    def ahead(self, layer_id: int, hidden: torch.Tensor, routes: int) -> None:
        """After layer `layer_id` admitted `routes` routes: admit and start copying the next MoE
        layer's predicted experts (nothing for the last layer, or where the cache has no room
        beside this layer's experts)."""
        nxt = self.next_layer.get(layer_id)
        cache = self.store.cache
        width = self.width if self.given is None else self.given.shape[-1]
        if nxt is None or not cache.has_room_ahead(routes, hidden.shape[0] * width):
            return
        moe_layer = self.store.moe_layer_of[nxt]
        predicted = self._predict(nxt, moe_layer, hidden)
        fetched = predicted if self.ahead_part is None else self.ahead_part(moe_layer, predicted)
        cache.admit_ahead(moe_layer, self._capped(moe_layer, fetched) if self.max_misses else fetched)
        if self.counts is not None:
            self.counts.ahead(moe_layer, predicted, cache.ahead_src, cache.ahead_count)
        if self.stream is None:
            self.store.copy_ahead(nxt, self.tuning)
            return
        if self.on_copy_engine:
            self.store.copy_engine().post(moe_layer, cache.ahead_plan)
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self.store.copy_ahead(nxt, self.tuning)
        self.in_flight = True

    def _capped(self, moe_layer: int, ids: torch.Tensor) -> torch.Tensor:
        """`ids` [T, width] (each row best first) with every predicted miss past the first
        `max_misses` set to -1, taken rank by rank (every row's first choice, then every row's
        second...); hits are kept (they cost no copy). A miss two rows predict counts twice."""
        num_experts = self.store.model_config.num_experts
        by_rank = ids.t().reshape(-1)
        valid = (by_rank >= 0) & (by_rank < num_experts)
        resident = self.store.residency()[moe_layer].index_select(0, by_rank.clamp(0, num_experts - 1)) >= 0
        miss = valid & ~resident
        kept = ~miss | (miss.long().cumsum(0) <= self.max_misses)
        return torch.where(kept, by_rank, -1).view(ids.shape[1], ids.shape[0]).t().contiguous()

    def _predict(self, layer_id: int, moe_layer: int, hidden: torch.Tensor) -> torch.Tensor:
        if self.given is not None:
            return self.given[moe_layer, :hidden.shape[0]]
        return self.predictors[layer_id](hidden, self.width)

    def restart(self) -> None:
        if self.counts is not None:
            self.counts.reset()

    def stats(self) -> dict:
        out = {"mode": self.mode, "predictor": "given" if self.given is not None else self.mode,
               "copy": "dma" if self.on_copy_engine else "gather"}
        if self.counts is not None:
            out.update(self.counts.snapshot(self.store.expert_bytes))
        return {"prefetch": out}
