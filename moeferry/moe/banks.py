"""A model's routed experts as banks of rows (`ExpertBanks`) and what a strategy asks of memory
for them (`ExpertNeeds`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moeferry.kernels.fused_moe import SILU, Activation
from moeferry.kernels.gather_copy import row_bytes
from moeferry.moe.formats import UNQUANTIZED, ExpertFormat, scale_grid


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
        args.update(self.format.kernel_args(self.w13_scale, self.w2_scale))
        return args

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def bytes_per_expert(self) -> int:
        """One expert's bytes over every bank, scales included: what a copy moves."""
        return sum(row_bytes(t) for t in self.tensors())
