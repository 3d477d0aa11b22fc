"""ExpertShard: one rank's share of every MoE layer's routed experts, under
--tensor-parallel-size (docs/multi_gpu.md).

Rank r of N owns the contiguous block of experts [r E/N, (r + 1) E/N) of every MoE layer: its
store allocates, loads and caches only those. Every rank routes every token (the router is
replicated), computes the routes to its own experts, and one all-reduce over the process group
gives every rank the outputs of all K routes.

Invariant: the all-reduce sums per-route outputs [T, K, H] in float32, each route nonzero on
exactly one rank (the others write 0.0), so the sum is exact whatever order the collective
adds in: every rank holds the same bits, and they are the bits one process computes (the
next add+RMSNorm then sums the K routes in k order, as it does for one process). The price
is K times the bytes of reducing [T, H] sums; cheaper reductions give up that equality.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertShard:
    """Rank `rank` of `world_size`; `group` the torch.distributed process group the routes are
    reduced over (None: the default group)."""

    rank: int
    world_size: int
    group: object = None

    def owned(self, num_experts: int) -> range:
        """The experts of a layer of `num_experts` this rank holds (global ids)."""
        if num_experts % self.world_size:
            raise ValueError(f"{num_experts} experts do not split evenly across {self.world_size} ranks")
        per_rank = num_experts // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def localize(self, topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(local ids, owned) of global routes [T, K]: the rank's bank row of each route it owns,
        -1 for the others (left out of admission, as another channel's routes are); `owned`
        [T, K] bool."""
        experts = self.owned(num_experts)
        local = topk_ids - experts.start
        owned = (local >= 0) & (local < len(experts))
        return torch.where(owned, local, torch.full_like(local, -1)), owned

    def all_routes(self, routes: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
        """Every rank's per-route outputs [T, K, H] float32 from this rank's (zeroed where not
        `owned`): the exact sum over the ranks (module docstring)."""
        import torch.distributed as dist

        routes = routes.float().masked_fill(~owned.unsqueeze(-1), 0.0)
        dist.all_reduce(routes, group=self.group)
        return routes
