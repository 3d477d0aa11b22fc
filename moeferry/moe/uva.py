"""The uva strategy: every expert stays in pinned host memory and the fused MoE kernels read
it in place over PCIe (no copies, no slot cache). The kernel's block assignment takes the
sorted path for host-resident weights, so an expert routed to several tokens of a step
crosses the link once (kernels/fused_moe/triton.py: choose_block_assignment)."""

from __future__ import annotations

import dataclasses

import torch

from moeferry.kernels.fused_moe import fused_moe
from moeferry.kernels.fused_moe import BLOCK_ASSIGNMENTS
from moeferry.moe.strategies import ExpertNeeds, MoEStrategy


class UvaStrategy(MoEStrategy):
    """Invariants: the banks are pinned CPU tensors when the compute device is a GPU (plain
    host tensors on a CPU-only machine, where `uva` equals `gpu`); nothing is copied to the
    device.

    `block_assignment` ("auto" by default) overrides the kernel's choice, for benchmarks:
    "naive" gives each (token, expert) route its own block wherever the small-batch rule
    allows it (T * K * 4 <= E) and falls back to "sorted" elsewhere, so prefill and wide
    decode stay legal. The choice depends on shapes only, so a captured CUDA graph keeps the
    assignment it was captured with: recapture after changing it.

    Statistics (`collect_stats`, decode forwards only, counted on the device so they hold
    inside CUDA graphs): `expert_reads` counts expert weight reads over PCIe, one per
    distinct routed expert per layer on the sorted path and one per route on the naive
    path; `routes` counts (token, expert) routes, padded graph rows included.
    """

    name = "uva"

    def __init__(self, engine_config, model_config):
        super().__init__(engine_config, model_config)
        self._block_assignment = "auto"

    @property
    def block_assignment(self) -> str:
        return self._block_assignment

    @block_assignment.setter
    def block_assignment(self, value: str) -> None:
        if value not in BLOCK_ASSIGNMENTS:
            raise ValueError(f"block_assignment {value!r} not in {BLOCK_ASSIGNMENTS}")
        self._block_assignment = value

    def memory_needs(self) -> ExpertNeeds:
        return dataclasses.replace(super().memory_needs(), host_bytes=self.total_experts * self.expert_bytes)

    def finalize(self, plan) -> None:
        layers, e = len(self.moe_layer_of), self.model_config.num_experts
        self.read_counts = torch.zeros((layers, e), dtype=torch.int64, device=self.device)
        self.decode_steps = torch.zeros(layers, dtype=torch.int64, device=self.device)
        self.route_counts = torch.zeros(layers, dtype=torch.int64, device=self.device)

    def bank_device(self) -> torch.device:
        return torch.device("cpu")

    def _assignment(self, num_tokens: int, top_k: int, num_experts: int) -> str:
        """The block assignment handed to the kernel: the override, "naive" only where allowed."""
        if self._block_assignment != "naive":
            return self._block_assignment
        from moeferry.kernels.fused_moe.triton import naive_allowed

        return "naive" if naive_allowed(num_tokens, top_k, num_experts) else "sorted"

    def _count_reads(self, layer_id: int, topk_ids: torch.Tensor, naive: bool) -> None:
        """Per expert: 1 if any route reads it (sorted), else its route count (naive)."""
        i = self.moe_layer_of[layer_id]
        ids = topk_ids.reshape(-1).long()
        if naive:
            self.read_counts[i].index_add_(0, ids, torch.ones_like(ids))
        else:
            touched = torch.zeros(self.model_config.num_experts, dtype=torch.int64, device=self.device)
            touched.index_fill_(0, ids, 1)
            self.read_counts[i] += touched
        self.decode_steps[i] += 1
        self.route_counts[i] += ids.numel()

    def forward(self, layer_id, hidden, topk_weights, topk_ids, is_decode, sum_routes=True):
        banks = self.banks[layer_id]
        assignment = self._assignment(topk_ids.shape[0], topk_ids.shape[1], banks.num_experts)
        if is_decode and self.engine_config.moe_collect_stats:
            self._count_reads(layer_id, topk_ids, naive=assignment == "naive")
        return fused_moe(hidden, banks.w13, banks.w2, topk_weights, topk_ids,
                         num_routed_experts=banks.num_experts, block_assignment=assignment,
                         sum_routes=sum_routes, **banks.kernel_args())

    def stats(self) -> dict:
        """Totals over decode forwards; a step is one decode forward of every MoE layer."""
        steps = int(self.decode_steps.max().item()) if self.decode_steps.numel() else 0
        reads = int(self.read_counts.sum().item())
        return {"strategy": self.name, "block_assignment": self._block_assignment, "decode_steps": steps,
                "expert_reads": reads, "routes": int(self.route_counts.sum().item()),
                "expert_bytes": self.expert_bytes, "expert_format": self.format_description(),
                "pcie_bytes_read": reads * self.expert_bytes,
                "pcie_bytes_per_step": reads * self.expert_bytes / steps if steps else 0.0}
