"""MoE strategies: where a layer's routed experts live and how a step computes them.

The MoE layer routes tokens and hands (hidden, topk_weights, topk_ids) to its strategy; the
strategy owns the expert weights. A strategy registers under a name (the --moe-strategy
choices come from `strategy_names()`); `create_strategy` builds it lazily by name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from moeferry.config import ConfigError
from moeferry.kernels.fused_moe import fused_moe

if TYPE_CHECKING:
    from moeferry.engine.planner import MemoryPlan

# name -> "module:Class"; imported only when chosen.
_REGISTRY: dict[str, str] = {
    "gpu": "moeferry.moe.strategies:GpuStrategy",
    "offload": "moeferry.moe.offload:OffloadStrategy",
    "uva": "moeferry.moe.uva:UvaStrategy",
    "cpu": "moeferry.moe.hybrid:CpuStrategy",
    "hybrid": "moeferry.moe.hybrid:HybridStrategy",
}


def strategy_names() -> list[str]:
    return list(_REGISTRY)


def create_strategy(name: str, engine_config, model_config) -> "MoEStrategy":
    if name not in _REGISTRY:
        raise ConfigError(f"--moe-strategy {name!r} is unknown; choose one of: {', '.join(_REGISTRY)}")
    module_name, cls_name = _REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(engine_config, model_config)


@dataclass(frozen=True)
class ExpertNeeds:
    """What a MoE strategy asks of memory (MoEStrategy.memory_needs). `wants_slots`: it keeps a
    device slot cache, of at least `layer_experts` slots and at most `total_experts`;
    `stream_bytes`: device buffers for streamed prefill; `host_bytes`: its pinned host store."""

    expert_bytes: int = 0
    total_experts: int = 0
    layer_experts: int = 0
    wants_slots: bool = False
    stream_bytes: int = 0
    host_bytes: int = 0


@dataclass
class ExpertBanks:
    """One MoE layer's routed experts: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]."""

    w13: torch.Tensor
    w2: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def bytes_per_expert(self) -> int:
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()


class MoEStrategy:
    """Interface between the MoE layers and the place their experts live.

    Life cycle: `allocate_banks` once per MoE layer (the loader then fills the banks),
    `finalize` once after loading, then `forward` per layer per step. Every strategy gives
    the output of `gpu` for the same inputs. The set of banks is fixed once loading starts,
    so `moe_layer_of` and `expert_bytes` are derived from it once.
    """

    name = "base"
    recorder = None  # a routing.RoutingRecorder under --moe-record-routing, set before any forward

    def __init__(self, engine_config, model_config):
        self.engine_config = engine_config
        self.model_config = model_config
        self.device = engine_config.torch_device
        self.dtype = engine_config.torch_dtype
        self.banks: dict[int, ExpertBanks] = {}

    def bank_device(self) -> torch.device:
        return self.device

    def allocate_banks(self, layer_id: int, num_experts: int, hidden: int, inter: int) -> ExpertBanks:
        dev = self.bank_device()
        pin = dev.type == "cpu" and self.device.type == "cuda"
        w13 = torch.empty((num_experts, 2 * inter, hidden), dtype=self.dtype, device=dev, pin_memory=pin)
        w2 = torch.empty((num_experts, hidden, inter), dtype=self.dtype, device=dev, pin_memory=pin)
        self.banks[layer_id] = ExpertBanks(w13, w2)
        return self.banks[layer_id]

    @cached_property
    def moe_layer_of(self) -> dict[int, int]:
        """Model layer id (`layer_id`, 0 .. num_layers - 1) -> MoE layer index (`moe_layer`,
        0 .. number of MoE layers - 1), the index of the slot cache, statistics and banks."""
        return {layer: i for i, layer in enumerate(sorted(self.banks))}

    @cached_property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert over both banks (every layer's experts have one shape; 0
        for a model without routed experts)."""
        return next(iter(self.banks.values())).bytes_per_expert if self.banks else 0

    def memory_needs(self) -> ExpertNeeds:
        """What this strategy asks of the memory planner, once its banks are allocated. The
        default: experts already where they compute (allocated with the model), nothing more."""
        return ExpertNeeds(expert_bytes=self.expert_bytes, total_experts=self.total_experts,
                           layer_experts=self.model_config.num_experts)

    @property
    def total_experts(self) -> int:
        return self.model_config.num_experts * len(self.banks)

    def finalize(self, plan: "MemoryPlan") -> None:
        """Called once after every bank is filled, with the engine's memory plan: the strategy
        allocates what the plan gave it (slots, buffers) and nothing else."""

    def begin_forward(self, is_decode: bool, num_tokens: int) -> None:
        """Called at the start of every model forward, before the first layer."""

    def record_routes(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Hand a layer's routes, before `forward` sees them, to the routing recorder if there
        is one: device work only, so it runs inside a decode graph (routing/recorder.py)."""
        if self.recorder is not None:
            self.recorder.record(self.moe_layer_of[layer_id], topk_ids)

    def admits_prefill(self) -> bool:
        """Whether the last prefill forward admitted its routes through a slot cache."""
        return False

    def forward(self, layer_id: int, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                is_decode: bool, sum_routes: bool = True) -> torch.Tensor:
        """The routed experts' output [T, H] (sum_routes=False: the weighted per-route outputs
        [T, K, H], as ops.fused_moe gives them)."""
        raise NotImplementedError

    def stats(self) -> dict:
        return {}


class GpuStrategy(MoEStrategy):
    """Every expert resident on the compute device; a grouped GEMM over the layer's own banks."""

    name = "gpu"

    def forward(self, layer_id, hidden, topk_weights, topk_ids, is_decode, sum_routes=True):
        banks = self.banks[layer_id]
        return fused_moe(hidden, banks.w13, banks.w2, topk_weights, topk_ids,
                             num_routed_experts=banks.num_experts, sum_routes=sum_routes)
