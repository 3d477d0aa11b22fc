"""MoEStrategy: one MoE layer's routed experts through the parts a strategy is composed of
(moe/strategies.py names the compositions).

Decode step of one MoE layer, all on the device and inside the decode CUDA graph:
  without host compute: the store locates the routes' experts (a slot cache admits them and
  copies its misses), then fused_moe over the banks it names;
  with host compute: the route split gives each route to the host or the device; the host's
  are posted to the host channel, the device's located and computed meanwhile; then the
  host's are joined and the two combined by selection (a route is computed by exactly one).
With a prefetch part (moe/prefetch.py), a decode layer over a slot cache also admits the next
MoE layer's predicted experts after its own admission and copies them on a side stream while
it computes.
A prefill chunk takes the same path (on demand) or streams every expert the device does not
hold through the store's layer buffers (the prefill route decides).
"""

from __future__ import annotations

import torch

from moeferry.kernels.fused_moe import SILU, Activation, fused_moe
from moeferry.kernels.fused_moe.common import sum_route_partials
from moeferry.moe.banks import ExpertBanks, ExpertNeeds
from moeferry.moe.timeline import HYBRID_POINTS, LayerTimeline


def _summed(per_route: torch.Tensor, dtype: torch.dtype, sum_routes: bool) -> torch.Tensor:
    """[T, K, H] route outputs, or their fixed-order float32 sum cast once (fused_moe's sum)."""
    return sum_route_partials(per_route).to(dtype) if sum_routes else per_route


class MoEStrategy:
    """Interface between the MoE layers and their experts: a store, and optionally a prefill
    route, a host compute and a route split, and a prefetch (module docstring).

    Life cycle, driven by the engine's runner: `allocate_banks` once per MoE layer (the loader
    then fills the banks), `memory_needs` for the plan, `finalize` with the plan, then per step
    `begin_decode_step` (host side, before a decode step, replayed or not) or `begin_forward`
    (before an eager forward), and `forward` per layer.
    """

    recorder = None  # a routing.RoutingRecorder under --moe-record-routing, set before any forward

    def __init__(self, name: str, engine_config, model_config, store, *, prefill=None, host=None, split=None,
                 prefetch=None):
        if (host is None) != (split is None):
            raise ValueError("a host compute comes with a route split")
        self.name = name
        self.engine_config, self.model_config = engine_config, model_config
        self.store, self.prefill, self.host, self.split = store, prefill, host, split
        self.prefetch = prefetch
        if prefill is not None:
            prefill.attach(store)
        self.device, self.dtype = engine_config.torch_device, engine_config.torch_dtype
        self.timeline: LayerTimeline | None = None
        self.shard = None  # an ExpertShard (moe/shard.py) when the experts are split across ranks
        self.layer_experts = model_config.num_experts  # a layer's routed experts (all ranks')

    def split_across(self, shard, layer_experts: int) -> None:
        """Hold only `shard`'s share of each layer of `layer_experts` experts (its parts were
        built over a model of that share: ModelConfig.with_layer_experts); `forward` then adds
        every rank's route outputs. Called once, before any bank is allocated."""
        self.shard, self.layer_experts = shard, layer_experts

    def owned_experts(self, num_experts: int) -> range:
        """The experts of a layer of `num_experts` whose weights this strategy holds (global ids):
        every one, or the rank's share."""
        return range(num_experts) if self.shard is None else self.shard.owned(num_experts)

    # ---- what the store derives from its banks -----------------------------------------------
    @property
    def banks(self) -> dict[int, ExpertBanks]:
        return self.store.banks

    @property
    def moe_layer_of(self) -> dict[int, int]:
        return self.store.moe_layer_of

    @property
    def expert_bytes(self) -> int:
        return self.store.expert_bytes

    @property
    def total_experts(self) -> int:
        return self.store.total_experts

    def format_description(self) -> str:
        return self.store.format_description()

    # ---- life cycle ---------------------------------------------------------------------------
    def allocate_banks(self, layer_id: int, num_experts: int, hidden: int, inter: int, bias: bool = False,
                       activation: Activation = SILU) -> ExpertBanks:
        """The banks of the layer's experts this strategy holds (`owned_experts`), in that order."""
        held = len(self.owned_experts(num_experts))
        return self.store.allocate(layer_id, held, hidden, inter, bias=bias, activation=activation)

    def attach_predictor(self, layer_id: int, predict) -> None:
        """A MoE layer's expert predictor, `predict(hidden, width) -> ids [T, width]` (its router
        applied early: layers/moe.py predict_experts), for the prefetch part if there is one."""
        if self.prefetch is not None:
            self.prefetch.attach_predictor(layer_id, predict)

    def memory_needs(self) -> ExpertNeeds:
        return self.store.memory_needs()

    def finalize(self, plan) -> None:
        """Called once after every bank is filled, with the engine's memory plan
        (engine/planner.py: MemoryPlan; not imported here, so moe/ never imports the engine)."""
        self.store.finalize(plan)
        if self.prefetch is not None:
            self.prefetch.finalize(self.store, self.device)
        if self.host is not None:
            self.host.finalize(self.banks, self.device, self.dtype)
            self.split.start(self.host.speeds, self.device)
            if self.prefetch is not None:
                self.prefetch.ahead_part = self._ahead_part
        if self.engine_config.moe_timeline:
            self.timeline = LayerTimeline(HYBRID_POINTS, len(self.moe_layer_of), self.device)

    def _ahead_part(self, moe_layer: int, predicted_ids: torch.Tensor) -> torch.Tensor:
        """The predicted experts the lookahead fetches under a split: the device channel's part."""
        return self.split.device_part(predicted_ids, self.store.residency()[moe_layer])

    def begin_forward(self, is_decode: bool, num_tokens: int) -> None:
        """Called before every eager model forward (a replayed decode graph runs none)."""
        if is_decode:
            return
        if self.split is not None:
            self.split.interrupt()
        if self.prefill is not None:
            self.prefill.begin(num_tokens)

    def begin_decode_step(self) -> None:
        """Called on the host before every decode step, a graph's replay or an eager forward
        alike: host-side bookkeeping only (a failed copy engine request raises EngineFailed here)."""
        if self.split is not None:
            self.split.decode_step()
        self.store.check()

    def restart_cache(self) -> None:
        """Back to the state after `finalize`, statistics zeroed, in place (captured graphs stay
        valid): a measured run starts from here."""
        self.store.restart()
        if self.prefetch is not None:
            self.prefetch.restart()
        if self.host is not None:
            self.host.restart()

    def set_statistics(self, on: bool) -> None:
        """Count the slot cache's admissions and the prefetch's predictions from now on (fresh
        counters), or stop counting, as --moe-collect-stats would have it. Both are compiled into
        the decode graphs: recapture them after this."""
        if self.store.admits:
            self.store.cache.set_statistics(on)
        if self.prefetch is not None:
            self.prefetch.set_statistics(on)

    def record_routes(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Hand a layer's routes, before `forward` sees them, to the routing recorder if there
        is one: device work only, so it runs inside a decode graph (routing/recorder.py)."""
        if self.recorder is not None:
            self.recorder.record(self.moe_layer_of[layer_id], topk_ids)

    def admits_prefill(self) -> bool:
        """Whether the last prefill forward admitted its routes through a slot cache."""
        return self.prefill is not None and self.prefill.admits

    # ---- one layer ----------------------------------------------------------------------------
    def forward(self, layer_id: int, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                is_decode: bool, sum_routes: bool = True) -> torch.Tensor:
        """The routed experts' output [T, H] (sum_routes=False: the weighted per-route outputs
        [T, K, H], as fused_moe gives them). Split across ranks: this rank's routes (the others
        left out of admission; whatever their rows compute, all_routes zeroes them), then every
        rank's added (moe/shard.py)."""
        if self.shard is None:
            return self._forward(layer_id, hidden, topk_weights, topk_ids, is_decode, sum_routes)
        local_ids, owned = self.shard.localize(topk_ids, self.layer_experts)
        routes = self._forward(layer_id, hidden, topk_weights, local_ids, is_decode, sum_routes=False)
        return _summed(self.shard.all_routes(routes, owned), hidden.dtype, sum_routes)

    def _forward(self, layer_id, hidden, topk_weights, topk_ids, is_decode, sum_routes):
        if not is_decode and self.prefill is not None and self.prefill.streams(layer_id, topk_ids):
            return self._streamed(layer_id, hidden, topk_weights, topk_ids, sum_routes)
        phase = "decode" if is_decode else "prefill"
        ahead = self._lookahead(layer_id, topk_ids, is_decode)
        if self.host is None or self.store.holds_all:
            banks, rows = self.store.locate(layer_id, topk_ids, phase)
            if ahead is not None:
                ahead.ahead(layer_id, hidden, topk_ids.numel())
            return self._on_device(hidden, banks, topk_weights, rows, sum_routes)
        return self._split(layer_id, hidden, topk_weights, topk_ids, phase, sum_routes, ahead)

    def _lookahead(self, layer_id: int, topk_ids: torch.Tensor, is_decode: bool):
        """The prefetch part for a decode layer that can miss, joined and shown its routes;
        None where there is no lookahead."""
        ahead = self.prefetch
        if ahead is None or not is_decode or self.store.holds_all:
            return None
        ahead.join()
        ahead.observe(layer_id, topk_ids)
        return ahead

    def _on_device(self, hidden, banks: ExpertBanks, topk_weights, rows, sum_routes: bool) -> torch.Tensor:
        if self.shard is not None:  # another rank's routes (row -1) read row 0, zeroed by all_routes
            rows = rows.clamp(min=0)
        # tiles sized by the layer's expert count, a rank's share or not: the same bits either way
        return fused_moe(hidden, banks.w13, banks.w2, topk_weights, rows,
                         num_routed_experts=self.layer_experts, sum_routes=sum_routes,
                         **banks.kernel_args(), **self.store.kernel_options(rows))

    def _streamed(self, layer_id, hidden, topk_weights, topk_ids, sum_routes):
        """The chunk's layer over the slots and the stream buffer at once (moe/layer_stream.py)."""
        banks, row_of = self.prefill.streamed(layer_id)
        # (-1: another rank's route, read at row 0 and zeroed by all_routes)
        rows = row_of.index_select(0, topk_ids.reshape(-1).clamp(min=0)).view(topk_ids.shape)
        out = self._on_device(hidden, banks, topk_weights, rows, sum_routes)
        self.prefill.release(layer_id)
        return out

    def _split(self, layer_id, hidden, topk_weights, topk_ids, phase, sum_routes, ahead=None):
        """Host and device at once; the points of `HYBRID_POINTS` stamped under --moe-timeline."""
        moe_layer = self.moe_layer_of[layer_id]
        mark = self._marker(moe_layer, phase)
        mark("start")
        residency = self.store.residency()
        host_ids, device_ids, device_weights = self.split.routes(
            moe_layer, topk_ids, None if residency is None else residency[moe_layer], self.host.tally(moe_layer, phase),
            topk_weights)
        mark("split")
        self.host.begin(layer_id, hidden, topk_weights, host_ids)
        mark("posted")
        if device_ids is None:  # every route on the host
            return _summed(self.host.finish(), hidden.dtype, sum_routes)
        banks, rows = self.store.locate(layer_id, device_ids, phase)
        if ahead is not None:
            ahead.ahead(layer_id, hidden, device_ids.numel())
        mark("copied")
        device_routes = self._on_device(hidden, banks, device_weights, rows.clamp(min=0), sum_routes=False)
        mark("computed")
        routes = self.host.finish(into=device_routes)  # the host's routes merged into the device's
        mark("joined")
        out = _summed(routes, hidden.dtype, sum_routes)
        mark("combined")
        return out

    def _marker(self, moe_layer: int, phase: str):
        """Stamps a decode layer's points (moe/timeline.py) when a timeline is kept."""
        timeline = self.timeline
        if timeline is None or phase != "decode":
            return lambda point: None
        return lambda point: timeline.mark(moe_layer, point)

    # ---- statistics ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """The store's figures, the prefill route's, the host channel's and the split's; under a
        split with a slot cache also `decode_split`: the decode steps' distinct routed experts by
        channel (hit: resident; copied: over PCIe; host), totals and per step, with the bytes
        each channel moved."""
        out = {"strategy": self.name, "expert_format": self.format_description(), "expert_bytes": self.expert_bytes,
               **self.store.stats()}
        if self.prefill is not None:
            out.update(self.prefill.stats())
        if self.prefetch is not None:
            out.update(self.prefetch.stats())
        if self.host is not None:
            out.update(self.host.stats(self.expert_bytes), **self.split.stats())
            if "decode" in out:
                out["decode_split"] = self._decode_split(out)
        return out

    def _decode_split(self, out: dict) -> dict:
        cache = out["decode"]["total"]
        steps = max(out["decode"]["per_layer"]["calls"], default=0)
        split = {"hit": cache["distinct"] - cache["misses"], "copied": cache["misses"], "host": out["host_experts"]}
        split.update(pcie_bytes=split["copied"] * self.expert_bytes, host_bytes=out["host_bytes"], steps=steps)
        split["per_step"] = {k: split[k] / steps if steps else 0.0 for k in ("hit", "copied", "host")}
        return split
