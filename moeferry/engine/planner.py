"""The memory planner: once the weights are loaded, one function turns the device memory left
into the whole plan (expert slots, prefill stream buffers, KV pages) and says what it chose;
each owner then allocates its part from the plan (the strategy its slots and buffers, the
runner the KV cache), so no part is sized twice or depends on who allocates first.

Order of claims on the budget (free device memory x --memory-ratio - --vram-reserve-mb):
1. the sampler's state and buffers (per running request, a vocabulary's worth of counts,
   prompt marks and log-probs), and the prefill stream buffers of a strategy that streams
   layers (offload on a GPU);
2. the KV cache the flags ask for (--num-tokens, else --kv-reserve-tokens, else one context
   per running request: --max-model-len, else the model's capped at KV_PLAN_CONTEXT) is reserved;
3. expert slots: --moe-cache-slots, else --moe-cache-gb, else what 1 and 2 leave, capped at
   every expert (a bigger cache has nothing more to hold);
4. the KV cache gets what is left, up to what it asked for.
On the CPU there is no device budget: every expert gets a slot and the KV cache a fixed size.
Then the context served is fitted to the KV cache (`served_context`): one request of it must fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moeferry.errors import ConfigError
from moeferry.moe.banks import ExpertNeeds
from moeferry.moe.slot_cache import slots_for_gb

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_TOKENS = 16384
_GIB = 2**30
# The context the KV cache is planned for per running request when --max-model-len is not
# given: a model's own (40,960 or 262,144 tokens) would reserve that much per request ahead of
# the expert cache; served_context still lets one request use the model's whole context when
# the cache holds it.
KV_PLAN_CONTEXT = 8192


@dataclass(frozen=True)
class KVShape:
    """What the KV cache costs: bytes per token over every layer, and the context planned for
    per running request (`planned_context`)."""

    bytes_per_token: int
    context_tokens: int


@dataclass(frozen=True)
class MemoryPlan:
    """The whole plan. Invariant: on a GPU, expert slots + stream buffers + KV fit the budget
    (`budget_bytes`) unless a flag fixed a size; `expert_slots` is 0 for strategies without a
    slot cache and otherwise at least one layer's experts."""

    kv_pages: int
    page_size: int
    kv_bytes: int
    expert_slots: int
    slot_bytes: int
    stream_bytes: int
    sampler_bytes: int
    host_bytes: int
    free_bytes: int | None  # device memory free once the weights were loaded (None: CPU)
    budget_bytes: int | None
    expert_bytes: int = 0  # one expert over every bank, scales included (a slot's size)
    expert_format: str = ""  # how those bytes store the weights: bf16, fp8 e4m3 with block scales, ...

    @property
    def kv_tokens(self) -> int:
        return self.kv_pages * self.page_size

    def table(self) -> str:
        """The plan as a small table for the start-up log."""
        def gib(n):
            return "-" if n is None else f"{n / _GIB:.2f} GiB"

        rows = [("device memory free after the weights", gib(self.free_bytes)),
                ("budget (x --memory-ratio - --vram-reserve-mb)", gib(self.budget_bytes)),
                (f"expert slots: {self.expert_slots} x {self.expert_bytes / 2**20:.2f} MiB "
                 f"({self.expert_format or 'no experts'})", gib(self.slot_bytes)),
                ("prefill stream buffers", gib(self.stream_bytes)),
                ("sampler state and buffers", gib(self.sampler_bytes)),
                (f"KV cache: {self.kv_pages} pages x {self.page_size} = {self.kv_tokens} tokens", gib(self.kv_bytes)),
                ("pinned host memory for experts", gib(self.host_bytes))]
        width = max(len(name) for name, _ in rows)
        return "memory plan:\n" + "\n".join(f"  {name:<{width}}  {value:>11}" for name, value in rows)


def expert_slots(ec, needs: ExpertNeeds, room_bytes: int | None) -> int:
    """Slots of the expert cache: from the flags, else as many as `room_bytes` holds (None: no
    device budget, every expert), capped at every expert. Refuses fewer than one layer's."""
    if not needs.wants_slots:
        return 0
    if ec.moe_cache_slots is not None:
        slots = ec.moe_cache_slots
    elif ec.moe_cache_gb is not None:
        slots = slots_for_gb(ec.moe_cache_gb, needs.expert_bytes)
    elif ec.cpu_offload_gb is not None:  # vLLM's sense: the experts left on the host
        slots = needs.total_experts - -(-int(ec.cpu_offload_gb * _GIB) // needs.expert_bytes)
    elif room_bytes is None:
        slots = needs.total_experts
    else:
        slots = min(needs.total_experts, max(0, int(room_bytes // needs.expert_bytes)))
    if slots < needs.layer_experts:
        layer_gib = needs.layer_experts * needs.expert_bytes / _GIB
        raise ConfigError(f"the expert cache holds {slots} experts, fewer than one layer's {needs.layer_experts}: "
                          f"raise --moe-cache-slots/--moe-cache-gb (one layer needs {layer_gib:.2f} GiB)")
    return slots


def planned_context(ec, model_len: int) -> int:
    """The context the KV cache is planned for per running request: --max-model-len, else
    the model's (`model_len`) capped at KV_PLAN_CONTEXT."""
    return ec.max_model_len or min(model_len, KV_PLAN_CONTEXT)


def wanted_kv_tokens(ec, kv: KVShape) -> int:
    """The KV capacity the flags ask for: --num-tokens, else --kv-reserve-tokens (at most one
    planned context per running request), else one planned context per running request."""
    if ec.num_tokens is not None:
        return ec.num_tokens
    full = ec.max_running_requests * kv.context_tokens
    return full if ec.kv_reserve_tokens is None else min(ec.kv_reserve_tokens, full)


def served_context(ec, model_len: int, plan: MemoryPlan) -> int:
    """The most tokens (prompt + output) one request may hold: `model_len` (--max-model-len,
    else the model's max_position_embeddings) when one request of it fits the planned KV
    cache. Otherwise a given --max-model-len is refused (ConfigError), and the model's is
    lowered to the KV cache's size with one warning naming the flag that plans for more."""
    if model_len <= plan.kv_tokens:
        return model_len
    if ec.max_model_len is not None:
        raise ConfigError(f"--max-model-len {model_len}: one request of that length does not fit the KV cache of "
                          f"{plan.kv_tokens} tokens; lower it, or make the KV cache larger (--num-tokens, "
                          f"--kv-reserve-tokens, --memory-ratio, a smaller expert cache)")
    logger.warning("the model's context of %d tokens (max_position_embeddings) does not fit the KV cache of %d "
                   "tokens: serving %d; give --max-model-len to plan the KV cache for a longer one (or --num-tokens)",
                   model_len, plan.kv_tokens, plan.kv_tokens)
    return plan.kv_tokens


def _device_budget(ec, device: torch.device) -> tuple[int | None, int | None]:
    if device.type != "cuda":
        return None, None
    free, total = torch.cuda.mem_get_info(device)
    if ec.gpu_memory_utilization is not None:  # vLLM's sense: a share of the whole GPU, weights included
        return free, int(free - (1 - ec.gpu_memory_utilization) * total - ec.vram_reserve_mb * 2**20)
    return free, int(free * ec.memory_ratio - ec.vram_reserve_mb * 2**20)


def plan_memory(ec, needs: ExpertNeeds, kv: KVShape | None = None, device: torch.device | None = None,
                sampler_bytes: int = 0) -> MemoryPlan:
    """The plan for this engine (see the module for the order of claims); `kv` None plans no
    KV cache (a strategy built on its own, in tests)."""
    device = torch.device(device or ec.torch_device)
    free, budget = _device_budget(ec, device)
    if budget is not None:
        budget -= sampler_bytes
    want_kv = wanted_kv_tokens(ec, kv) if kv is not None else 0
    if budget is None:
        slots = expert_slots(ec, needs, None)
        kv_tokens = want_kv if ec.num_tokens is not None else min(_CPU_DEFAULT_KV_TOKENS, want_kv)
    else:
        want_kv_bytes = want_kv * kv.bytes_per_token if kv is not None else 0
        slots = expert_slots(ec, needs, budget - needs.stream_bytes - want_kv_bytes)
        left = budget - needs.stream_bytes - slots * needs.expert_bytes
        kv_tokens = want_kv if ec.num_tokens is not None or kv is None else min(want_kv, left // kv.bytes_per_token)
    pages = kv_tokens // ec.page_size
    if kv is not None and pages < 1:  # (a --num-tokens under one page is refused by EngineConfig.check)
        raise ConfigError(f"no room for the KV cache: {kv_tokens} tokens fit (raise --memory-ratio, lower "
                          f"--vram-reserve-mb or the expert cache, or set --num-tokens)")
    return MemoryPlan(kv_pages=pages, page_size=ec.page_size, kv_bytes=pages * ec.page_size * (kv.bytes_per_token if kv else 0),
                      expert_slots=slots, slot_bytes=slots * needs.expert_bytes,
                      stream_bytes=needs.stream_bytes, sampler_bytes=sampler_bytes, host_bytes=needs.host_bytes,
                      free_bytes=free, budget_bytes=budget, expert_bytes=needs.expert_bytes,
                      expert_format=needs.expert_format)

