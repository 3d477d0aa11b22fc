"""Memory planner: turns the memory left after the weights into KV pages (and, with the
offload strategy, expert slots), and says what it chose."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moeferry.config import ConfigError
from moeferry.kvcache.paged import PagedKVCache

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_TOKENS = 16384


@dataclass(frozen=True)
class MemoryPlan:
    kv_pages: int
    kv_bytes: int
    free_bytes_before_kv: int | None

    def describe(self, page_size: int) -> str:
        free = "n/a" if self.free_bytes_before_kv is None else f"{self.free_bytes_before_kv / 2**30:.2f} GiB"
        return (f"KV cache: {self.kv_pages} pages x {page_size} tokens = {self.kv_pages * page_size} tokens "
                f"({self.kv_bytes / 2**30:.3f} GiB); device memory free before KV: {free}")


def plan_memory(ec, mc, runner) -> MemoryPlan:
    per_token = PagedKVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, runner.dtype)
    free = None
    if ec.num_tokens is not None:
        tokens = ec.num_tokens
    elif runner.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(runner.device)
        budget = free * ec.memory_ratio - ec.vram_reserve_mb * 2**20
        tokens = int(budget // per_token)
        if ec.kv_reserve_tokens is not None:
            tokens = min(tokens, ec.kv_reserve_tokens)
        tokens = min(tokens, ec.max_running_requests * runner.max_model_len)
    else:
        tokens = min(_CPU_DEFAULT_KV_TOKENS, ec.max_running_requests * runner.max_model_len)
    pages = tokens // ec.page_size
    if pages < 1:
        raise ConfigError(f"no room for the KV cache: {tokens} tokens fit (raise --memory-ratio, lower "
                          f"--vram-reserve-mb or the expert cache, or set --num-tokens)")
    plan = MemoryPlan(pages, pages * ec.page_size * per_token, free)
    logger.info(plan.describe(ec.page_size))
    return plan
