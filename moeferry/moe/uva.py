"""The uva strategy: every expert stays in pinned host memory and the fused MoE kernels read
it in place over PCIe (no copies, no slot cache). The kernel's block assignment takes the
sorted path for host-resident weights, so an expert routed to several tokens of a step
crosses the link once (kernels/triton/fused_moe.py: choose_block_assignment)."""

from __future__ import annotations

import torch

from moeferry.kernels import ops
from moeferry.moe.strategies import MoEStrategy


class UvaStrategy(MoEStrategy):
    """Invariants: the banks are pinned CPU tensors when the compute device is a GPU (plain
    host tensors on a CPU-only machine, where `uva` equals `gpu`); nothing is copied to the
    device. Statistics: expert bytes read over PCIe, counted per distinct routed expert per
    step, on the device (`collect_stats`)."""

    name = "uva"

    def bank_device(self) -> torch.device:
        return torch.device("cpu")

    def finalize(self) -> None:
        layers = sorted(self.banks)
        self.moe_index = {l: i for i, l in enumerate(layers)}
        e = self.model_config.num_experts
        self.read_counts = torch.zeros((len(layers), e), dtype=torch.int64, device=self.device)
        self.decode_steps = torch.zeros(len(layers), dtype=torch.int64, device=self.device)
        banks = self.banks[layers[0]]
        self.expert_bytes = (banks.w13[0].numel() + banks.w2[0].numel()) * banks.w13.element_size()

    def _count_reads(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        e = self.model_config.num_experts
        touched = torch.zeros(e, dtype=torch.int64, device=self.device)
        touched.index_fill_(0, topk_ids.reshape(-1).long(), 1)
        self.read_counts[self.moe_index[layer_id]] += touched
        self.decode_steps[self.moe_index[layer_id]] += 1

    def forward(self, layer_id, hidden, topk_weights, topk_ids, is_decode):
        banks = self.banks[layer_id]
        if is_decode and self.engine_config.moe_collect_stats:
            self._count_reads(layer_id, topk_ids)
        return ops.fused_moe(hidden, banks.w13, banks.w2, topk_weights, topk_ids,
                             num_routed_experts=banks.num_experts)

    def stats(self) -> dict:
        steps = int(self.decode_steps.max().item()) if self.decode_steps.numel() else 0
        reads = int(self.read_counts.sum().item())
        return {"strategy": self.name, "decode_steps": steps, "expert_reads": reads,
                "pcie_bytes_read": reads * self.expert_bytes,
                "pcie_bytes_per_step": reads * self.expert_bytes / steps if steps else 0.0}
