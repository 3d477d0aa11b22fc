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
in this model: the channel speeds measured at start-up (moe/host_speeds.py ChannelSpeeds)
are those of one token per expert, where the host kernel reads weights at memory speed; a
prefill chunk's many tokens per expert make it compute-bound, at a speed nothing measures
yet. `cpu` under auto takes chunks of at most `AUTO_HOST_PREFILL_TOKENS` to the host
(`PrefillRoute`); `hybrid` decides as `offload` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.errors import ConfigError

AUTO = "auto"
DEMAND_MARGIN = 0.8  # demand must copy under 80% of the stream's bytes to be taken
# `cpu` under auto: chunks of at most this many tokens are computed on the host (PrefillRoute)
AUTO_HOST_PREFILL_TOKENS = 32


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
    the host for `cpu`), which only these strategies on a GPU have, and `cpu` on any device
    (its chunks to the host kernel); refuse the flag elsewhere rather than ignore it silently."""
    value = parse_demand_tokens(ec.moe_prefill_demand_tokens)
    if value in (0, "0") or ec.moe_strategy == "cpu":
        return
    if ec.moe_strategy not in DEMAND_STRATEGIES or ec.torch_device.type != "cuda":
        raise ConfigError(
            f"--moe-prefill-demand-tokens {value} needs GPU decode with --moe-strategy offload or hybrid, or "
            f"--moe-strategy cpu (got strategy {ec.moe_strategy!r} on {ec.torch_device.type})")


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
        ids = topk_ids.reshape(-1).long()
        routed[ids[ids >= 0]] = True  # (-1: another rank's route)
        routed = routed.cpu()
        held = slot_of >= 0
        distinct_first, missing_first = int(routed.sum()), int((routed & ~held[moe_layer]).sum())
        resident = held.sum(dim=1).tolist()
        est_missing = missing_first + sum(distinct_first * (1 - r / num_experts)
                                          for i, r in enumerate(resident) if i != moe_layer)
        demand_bytes = int(est_missing * expert_bytes)
        stream_bytes = (num_layers * num_experts - sum(resident)) * expert_bytes
        return self._record(PrefillDecision(demand_bytes < DEMAND_MARGIN * stream_bytes, demand_bytes, stream_bytes))


class PrefillRoute:
    """A prefill chunk's way through a store in host memory (moe/stores.py): streamed through
    the store's layer buffers (`stream`: the resident experts read from their slots, every
    other expert of each layer copied), or on demand (the decode path: the slot cache's
    admission, or the host channel where the store has no cache), as `PrefillPolicy` decides.

    Without a residency to read (a store with no slot cache), auto takes chunks of at most
    `host_tokens` tokens on demand (to the host): the host kernel reads each routed expert once
    per chunk, but its arithmetic grows with the tokens per expert, while streaming a layer
    costs the same for any chunk.

    Invariant: a decision, once taken for a chunk, holds for all of its layers."""

    def __init__(self, engine_config, host_tokens: int | None = None):
        self.policy = PrefillPolicy(engine_config.moe_prefill_demand_tokens)
        self.max_prefill_tokens = engine_config.max_prefill_tokens
        self.host_tokens = host_tokens
        self.store = None
        self.decision = PrefillDecision(False)
        self.residency_host: torch.Tensor | None = None  # auto: the residency a chunk read once
        self.streamed_bytes = 0

    def attach(self, store) -> None:
        self.store = store

    @property
    def widest_demand_chunk(self) -> int:
        """The most tokens a chunk taken on demand may have (buffers are sized by it)."""
        if self.policy.auto:
            return self.host_tokens if self.host_tokens is not None else self.max_prefill_tokens
        return self.policy.threshold

    def begin(self, num_tokens: int) -> None:
        """Called before a prefill forward: the decision where it can be taken now, and the
        stream's first copies when it streams."""
        residency = self.store.residency()
        if self.policy.auto and residency is None:
            self.residency_host = None
            self.decision = self.policy.decide(num_tokens <= self.host_tokens)
        else:
            # auto: the residency, read once before the chunk's work is queued (nothing admits until
            # its first MoE layer decides); the decision and the stream both read this copy
            self.residency_host = residency.cpu() if self.policy.auto else None
            self.decision = self.policy.begin(num_tokens, self.residency_host)
        if self.decision.demand is False:
            self._start_stream()

    def _start_stream(self) -> None:
        self.store.stream.begin(self.store.banks, self.store.residency(), self.residency_host)

    def streams(self, layer_id: int, topk_ids: torch.Tensor) -> bool:
        """Whether this chunk's layer streams; under auto with a slot cache the chunk's first MoE
        layer decides from its routes (one device sync)."""
        if self.decision.demand is None:
            self.decision = self.policy.decide_auto(topk_ids, self.store.moe_layer_of[layer_id], self.residency_host,
                                                    self.store.expert_bytes)
            if not self.decision.demand:
                self._start_stream()
        return not self.decision.demand

    def streamed(self, layer_id: int) -> tuple[object, torch.Tensor, int]:
        """(the stream's banks, expert -> row map [E] of the layer, experts it copied) once the
        layer's copies have landed; call `release` once its compute is enqueued. Only the experts
        not resident crossed the link, and only they count as streamed bytes."""
        row_of, copied = self.store.stream.acquire(layer_id)
        self.streamed_bytes += copied * self.store.expert_bytes
        return self.store.stream.banks, row_of

    def release(self, layer_id: int) -> None:
        self.store.stream.release(layer_id)

    @property
    def admits(self) -> bool:
        """Whether the last chunk admitted its routes through a slot cache."""
        return bool(self.decision.demand) and self.store.admits

    def stats(self) -> dict:
        return {"prefill_streamed_bytes": self.streamed_bytes, "prefill_chunks": dict(self.policy.decisions)}
