"""How an offloaded prefill chunk gets its experts: streamed (the resident ones read from
their slots, every other expert of each layer copied through the double buffer) or on demand
(only the experts it routes to, through the slot cache, as decode does).

`--moe-prefill-demand-tokens N`: a chunk of at most N tokens goes on demand (0: never).
`--moe-prefill-demand-tokens auto`: decided per chunk at its first MoE layer, from a cost
model in bytes over the link: on demand, the chunk's distinct routed experts that are not
resident (exact at the first layer, extrapolated to every other layer by its residency);
streamed, every expert not resident in any layer (exact: streaming copies only those and
reads the resident ones from their slots). Streaming overlaps its copies with compute and
demand does not, and demand admits (its misses evict decode's slots), so demand must also win
by `DEMAND_MARGIN`; a cache that holds every expert streams nothing and never goes on demand.
The peers' fixed thresholds (a crossover near 700 tokens in background/pr-demand-prefill.txt)
depend on the model and the card; the cost model reads both off the live routing and
residency.

The host strategies' third way (computing a chunk's missing experts on the host CPU) is not
in this model: the channel speeds measured at start-up (moe/host_experts.py ChannelSpeeds)
are those of one token per expert, where the host kernel reads weights at memory speed; a
prefill chunk's many tokens per expert make it compute-bound, at a speed nothing measures
yet. `cpu` under auto takes chunks of at most `AUTO_HOST_PREFILL_TOKENS` to the host
(moe/hybrid.py); `hybrid` decides as `offload` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.errors import ConfigError

AUTO = "auto"
DEMAND_MARGIN = 0.8  # demand must copy under 80% of the stream's bytes to be taken


def parse_demand_tokens(value) -> int | str:
    """The flag's value: a non-negative token count or "auto"."""
    if isinstance(value, str):
        if value.strip().lower() == AUTO:
            return AUTO
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(f"--moe-prefill-demand-tokens {value!r}: give a token count or 'auto'") from None
    if value < 0:
        raise ConfigError(f"--moe-prefill-demand-tokens must be >= 0 or 'auto', got {value}")
    return value


DEMAND_STRATEGIES = ("offload", "hybrid", "cpu")


def validate_demand_prefill(ec) -> None:
    """Demand prefill takes a chunk's experts the way a decode step does (the slot cache, or
    the host for `cpu`), which only these strategies on a GPU have; refuse the flag elsewhere
    rather than ignore it silently."""
    value = parse_demand_tokens(ec.moe_prefill_demand_tokens)
    if value in (0, "0"):
        return
    if ec.moe_strategy not in DEMAND_STRATEGIES or ec.torch_device.type != "cuda":
        raise ConfigError(
            f"--moe-prefill-demand-tokens {value} needs GPU decode with --moe-strategy "
            f"{' or '.join(DEMAND_STRATEGIES)} (got strategy {ec.moe_strategy!r} on {ec.torch_device.type})")


@dataclass
class PrefillDecision:
    """One chunk's choice: `demand` True/False, or None while auto waits for the first layer."""

    demand: bool | None
    estimated_demand_bytes: int = 0
    stream_bytes: int = 0


class PrefillPolicy:
    """Chooses stream or demand per prefill chunk. Invariant: a decision, once taken for a
    chunk, holds for all of its layers (a chunk never mixes the two paths)."""

    def __init__(self, demand_tokens):
        self.threshold = parse_demand_tokens(demand_tokens)
        self.decisions = {"demand": 0, "stream": 0}

    @property
    def auto(self) -> bool:
        return self.threshold == AUTO

    def begin(self, num_tokens: int, residency: torch.Tensor | None = None) -> PrefillDecision:
        """A chunk's decision where it can be taken before the forward: by the threshold; under
        auto, stream when `residency` (a host copy of slot_of [L, E]) holds every expert, since
        nothing would cross the link either way; otherwise None, for `decide_auto` at the first
        MoE layer (whose routing it needs: a device sync in the middle of the forward)."""
        if self.auto:
            if residency is not None and bool((residency >= 0).all()):
                return self._record(PrefillDecision(False))
            return PrefillDecision(None)
        return self._record(PrefillDecision(0 < num_tokens <= self.threshold))

    def decide(self, demand: bool) -> PrefillDecision:
        """Record a choice the strategy made itself (`cpu` under auto)."""
        return self._record(PrefillDecision(demand))

    def _record(self, decision: PrefillDecision) -> PrefillDecision:
        self.decisions["demand" if decision.demand else "stream"] += 1
        return decision

    def decide_auto(self, topk_ids: torch.Tensor, moe_layer: int, slot_of: torch.Tensor,
                    expert_bytes: int) -> PrefillDecision:
        """At the chunk's first MoE layer, from its routing (read back here: one device sync) and
        the residency `slot_of` [L, E], a host copy the caller read once for the whole chunk
        (the stream reads the same copy)."""
        num_layers, num_experts = slot_of.shape
        routed = torch.zeros(num_experts, dtype=torch.bool, device=topk_ids.device)
        routed[topk_ids.reshape(-1).long()] = True
        routed = routed.cpu()
        held = slot_of >= 0
        distinct_first, missing_first = int(routed.sum()), int((routed & ~held[moe_layer]).sum())
        resident = held.sum(dim=1).tolist()
        est_missing = missing_first + sum(distinct_first * (1 - r / num_experts)
                                          for i, r in enumerate(resident) if i != moe_layer)
        demand_bytes = int(est_missing * expert_bytes)
        stream_bytes = (num_layers * num_experts - sum(resident)) * expert_bytes
        return self._record(PrefillDecision(demand_bytes < DEMAND_MARGIN * stream_bytes, demand_bytes, stream_bytes))
