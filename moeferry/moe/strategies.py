"""MoE strategies: where a layer's routed experts live and how a step computes them.

The MoE layer routes tokens and hands (hidden, topk_weights, topk_ids) to its strategy; the
strategy owns the expert weights. A strategy registers under a name (the --moe-strategy
choices come from `strategy_names()`); `create_strategy` builds it lazily by name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from moeferry.errors import ConfigError
from moeferry.kernels.fused_moe import SILU, Activation, fused_moe
from moeferry.kernels.gather_copy import row_bytes
from moeferry.moe import formats
from moeferry.moe.formats import UNQUANTIZED, ExpertFormat, scale_grid


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
    `stream_bytes`: device buffers for streamed prefill; `host_bytes`: its pinned host store;
    `expert_format`: how an expert's `expert_bytes` are stored (for the plan's table)."""

    expert_bytes: int = 0
    total_experts: int = 0
    layer_experts: int = 0
    wants_slots: bool = False
    stream_bytes: int = 0
    host_bytes: int = 0
    expert_format: str = ""


@dataclass
class ExpertBanks:
    """One MoE layer's routed experts (or a slot pool, or a stream buffer, of the same rows):
    w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]. In a quantized `format` the weights
    are its dtype (float8_e4m3fn; int32 words of eight int4 values along the last dimension,
    which is then H/8 and I/8; uint8 bytes of two MXFP4 values, H/2 and I/2) and w13_scale /
    w2_scale hold their block scales (float32; MXFP4's uint8 E8M0 exponents; layout:
    kernels/fused_moe/__init__.py); otherwise both are None. Experts with biases (gpt-oss) add
    the bias banks w13_bias [E, 2I] (gate's, then up's) and w2_bias [E, H] in the compute dtype;
    `activation` is how their gate and up rows combine (the same for every layer of a model).

    Invariant: dim 0 of every tensor is the expert (or slot) and row e of each belongs to the
    same expert, so an expert moves as the raw rows of `tensors()` (gather_copy, streaming,
    warm start), whatever the format."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    format: ExpertFormat = UNQUANTIZED
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    activation: Activation = SILU

    @classmethod
    def allocate(cls, rows: int, hidden: int, inter: int, fmt: ExpertFormat, dtype: torch.dtype,
                 device: torch.device, pin: bool = False, zero: bool = False, bias: bool = False,
                 activation: Activation = SILU) -> "ExpertBanks":
        """Banks of `rows` experts in `fmt` (weights in `dtype` when unquantized; biases, when
        asked, in `dtype`)."""
        make = torch.zeros if zero else torch.empty

        def bank(*shape, dt):
            return make(shape, dtype=dt, device=device, pin_memory=pin)

        weight_dtype = fmt.weight_dtype or dtype
        banks = cls(bank(rows, 2 * inter, fmt.stored_cols(hidden), dt=weight_dtype),
                    bank(rows, hidden, fmt.stored_cols(inter), dt=weight_dtype), format=fmt)
        if fmt.quantized:
            gate_rows, h_cols = scale_grid(inter, hidden, fmt.block_shape)
            h_rows, i_cols = scale_grid(hidden, inter, fmt.block_shape)
            banks.w13_scale = bank(rows, 2 * gate_rows, h_cols, dt=fmt.scale_dtype)
            banks.w2_scale = bank(rows, h_rows, i_cols, dt=fmt.scale_dtype)
        if bias:
            banks.w13_bias = bank(rows, 2 * inter, dt=dtype)
            banks.w2_bias = bank(rows, hidden, dt=dtype)
        banks.activation = activation
        return banks

    def like(self, rows: int, device: torch.device, zero: bool = False) -> "ExpertBanks":
        """Banks of the same format, expert shape and arithmetic with `rows` rows on `device`."""
        hidden, inter = self.w2.shape[1], self.w13.shape[1] // 2
        dtype = self.w13.dtype if self.w13_bias is None else self.w13_bias.dtype
        return ExpertBanks.allocate(rows, hidden, inter, self.format, dtype, device, zero=zero,
                                    bias=self.w13_bias is not None, activation=self.activation)

    def head(self, rows: int) -> "ExpertBanks":
        """The first `rows` rows of every bank, as views (a slot pool inside a larger allocation)."""
        return replace(self, **{f: t[:rows] for f, t in vars(self).items() if isinstance(t, torch.Tensor)})

    def tensors(self) -> list[torch.Tensor]:
        """Every bank, in the order copies take them: weights, then scales, then biases."""
        return [t for t in (self.w13, self.w2, self.w13_scale, self.w2_scale, self.w13_bias, self.w2_bias)
                if t is not None]

    def kernel_args(self) -> dict:
        """fused_moe's keyword arguments beyond the weights: this format's scales (none when
        unquantized), the biases and the activation (where the experts have them)."""
        args = {} if self.activation == SILU else {"activation": self.activation}
        if self.w13_bias is not None:
            args.update(w13_bias=self.w13_bias, w2_bias=self.w2_bias)
        if self.format.quantized:
            args.update(w13_scale=self.w13_scale, w2_scale=self.w2_scale, block_shape=self.format.block_shape)
        return args

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def bytes_per_expert(self) -> int:
        """One expert's bytes over every bank, scales included: what a copy moves."""
        return sum(row_bytes(t) for t in self.tensors())


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

    @cached_property
    def expert_format(self) -> ExpertFormat:
        """The banks' format: the checkpoint's quantization_config, else --quantization."""
        return formats.expert_format(getattr(self.model_config, "hf", None), getattr(self.engine_config, "quantization", None))

    def allocate_banks(self, layer_id: int, num_experts: int, hidden: int, inter: int, bias: bool = False,
                       activation: Activation = SILU) -> ExpertBanks:
        dev = self.bank_device()
        pin = dev.type == "cpu" and self.device.type == "cuda"
        self.banks[layer_id] = ExpertBanks.allocate(num_experts, hidden, inter, self.expert_format, self.dtype, dev, pin,
                                                    bias=bias, activation=activation)
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
                           layer_experts=self.model_config.num_experts, expert_format=self.format_description())

    @property
    def total_experts(self) -> int:
        return self.model_config.num_experts * len(self.banks)

    def finalize(self, plan) -> None:
        """Called once after every bank is filled, with the engine's memory plan
        (engine/planner.py: MemoryPlan, which reads this strategy's ExpertNeeds; not imported
        here, so moe/ never imports the engine): the strategy allocates what the plan gave it
        (slots, buffers) and nothing else."""

    def begin_forward(self, is_decode: bool, num_tokens: int) -> None:
        """Called at the start of every model forward, before the first layer."""

    def begin_decode_step(self) -> None:
        """Called on the host before every decode step, a graph's replay or an eager forward
        alike (a replayed step runs no forward, so begin_forward never sees it): host-side
        bookkeeping only."""

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

    def format_description(self) -> str:
        """The experts' storage format as the plan and /v1/stats show it ('bf16', 'fp8 e4m3, ...')."""
        fmt = self.expert_format
        return str(self.dtype).removeprefix("torch.").replace("bfloat16", "bf16") if not fmt.quantized else fmt.describe()

    def stats(self) -> dict:
        return {}


class GpuStrategy(MoEStrategy):
    """Every expert resident on the compute device; a grouped GEMM over the layer's own banks."""

    name = "gpu"

    def stats(self) -> dict:
        return {"strategy": self.name, "expert_format": self.format_description(), "expert_bytes": self.expert_bytes}

    def forward(self, layer_id, hidden, topk_weights, topk_ids, is_decode, sum_routes=True):
        banks = self.banks[layer_id]
        return fused_moe(hidden, banks.w13, banks.w2, topk_weights, topk_ids,
                         num_routed_experts=banks.num_experts, sum_routes=sum_routes, **banks.kernel_args())
