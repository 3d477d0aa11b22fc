"""Expert stores: where a model's routed experts live, and how the device reaches a layer's.

A store allocates one `ExpertBanks` per MoE layer (the loader fills them), says what it asks
of memory (`memory_needs`), takes what the memory plan gave it (`finalize`) and, per layer and
step, `locate`s the routed experts for the device's fused MoE: the banks to read and the rows
of the routes in them.

    ResidentStore  every expert on the compute device (`gpu`)
    UvaStore       pinned host memory, read in place by the kernels over PCIe (`uva`)
    SlotStore      pinned host memory behind a device slot cache shared by every layer, with
                   device-side admission (`offload`, `hybrid`)
    HostStore      pinned host memory only: the device computes nothing from it outside a
                   streamed prefill (`cpu`)

The stores in host memory also keep the two layer buffers of streamed prefill (`stream`,
moe/layer_stream.py). Every store gives the `gpu` store's bits for the same routes: the same
kernel over the same rows, tiles sized by the layer's expert count.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import cached_property

import torch

from moeferry.kernels.fused_moe import BLOCK_ASSIGNMENTS, SILU, Activation
from moeferry.kernels.gather_copy import GatherTuning
from moeferry.moe import formats
from moeferry.moe.banks import ExpertBanks, ExpertNeeds
from moeferry.moe.formats import ExpertFormat
from moeferry.moe.layer_stream import LayerStream
from moeferry.moe.slot_cache import DEFAULT_MAX_ROUTES, SlotCache

logger = logging.getLogger(__name__)

MISS_COPIES = ("gather", "dma")  # how a slot store copies a layer's missed experts (--moe-miss-copy)


class ExpertStore:
    """The banks of every MoE layer and what is derived from them. The set of banks is fixed
    once loading starts, so `moe_layer_of` and `expert_bytes` are derived once."""

    in_host_memory = False  # the banks live in (pinned) host memory
    admits = False  # routes go through a slot cache's admission

    def __init__(self, engine_config, model_config):
        self.engine_config, self.model_config = engine_config, model_config
        self.device, self.dtype = engine_config.torch_device, engine_config.torch_dtype
        self.banks: dict[int, ExpertBanks] = {}
        self.stream: LayerStream | None = None

    @property
    def bank_device(self) -> torch.device:
        return torch.device("cpu") if self.in_host_memory else self.device

    @cached_property
    def expert_format(self) -> ExpertFormat:
        """The banks' format: the checkpoint's quantization_config, else --quantization."""
        return formats.expert_format(getattr(self.model_config, "hf", None),
                                     getattr(self.engine_config, "quantization", None))

    def allocate(self, layer_id: int, num_experts: int, hidden: int, inter: int, bias: bool = False,
                 activation: Activation = SILU) -> ExpertBanks:
        dev = self.bank_device
        pin = dev.type == "cpu" and self.device.type == "cuda"
        self.banks[layer_id] = ExpertBanks.allocate(num_experts, hidden, inter, self.expert_format, self.dtype, dev,
                                                    pin, bias=bias, activation=activation)
        return self.banks[layer_id]

    @cached_property
    def moe_layer_of(self) -> dict[int, int]:
        """Model layer id (0 .. num_layers - 1) -> MoE layer index (0 .. MoE layers - 1), the
        index of the slot cache, the statistics and the routing traces."""
        return {layer: i for i, layer in enumerate(sorted(self.banks))}

    @cached_property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert over every bank (0 for a model without routed experts)."""
        return next(iter(self.banks.values())).bytes_per_expert if self.banks else 0

    @property
    def total_experts(self) -> int:
        return self.model_config.num_experts * len(self.banks)

    @property
    def holds_all(self) -> bool:
        """Whether every expert is on the device, so no route can miss."""
        return not self.in_host_memory

    def memory_needs(self) -> ExpertNeeds:
        """What the store asks of the memory planner, its banks allocated: by default the
        experts already where they compute (allocated with the model), nothing more."""
        host_bytes = self.total_experts * self.expert_bytes if self.in_host_memory else 0
        return ExpertNeeds(expert_bytes=self.expert_bytes, total_experts=self.total_experts,
                           layer_experts=self.model_config.num_experts, host_bytes=host_bytes,
                           expert_format=self.format_description())

    def format_description(self) -> str:
        """The experts' storage format as the plan and /v1/stats show it ('bf16', 'fp8 e4m3, ...')."""
        fmt = self.expert_format
        return str(self.dtype).removeprefix("torch.").replace("bfloat16", "bf16") if not fmt.quantized else fmt.describe()

    def finalize(self, plan) -> None:
        """Allocate what the memory plan (engine/planner.py MemoryPlan) gave the store."""

    def locate(self, layer_id: int, topk_ids: torch.Tensor, phase: str) -> tuple[ExpertBanks, torch.Tensor]:
        """(banks, rows): the routes' experts readable by the device, at `rows` (shaped like
        `topk_ids`) of `banks`. `phase` (decode or prefill) picks the statistics' bucket."""
        return self.banks[layer_id], topk_ids

    def kernel_options(self, topk_ids: torch.Tensor) -> dict:
        """fused_moe's keyword arguments this store adds for routes shaped like `topk_ids`."""
        return {}

    def residency(self) -> torch.Tensor | None:
        """slot_of [L, E] (-1: not on the device) where a slot cache decides it; None otherwise."""
        return None

    def check(self) -> None:
        """Raise EngineFailed if the store's copies went wrong (a copy engine request failed or
        its wait gave up: slots would hold stale rows); host state only, no device sync."""

    def restart(self) -> None:
        """Back to the state after `finalize`, statistics zeroed (a measured run starts here)."""

    def stats(self) -> dict:
        return {}


class ResidentStore(ExpertStore):
    """Every expert resident on the compute device; the fused MoE reads the layer's own banks."""


class UvaStore(ExpertStore):
    """Every expert stays in pinned host memory and the fused MoE kernels read it in place over
    PCIe (no copies, no slot cache); the kernel's block assignment takes the sorted path for
    host-resident weights, so an expert routed to several tokens of a step crosses the link
    once (kernels/fused_moe/triton.py: choose_block_assignment). Plain host tensors on a
    CPU-only machine, where it equals `gpu`.

    --moe-uva-block-assignment overrides the kernel's choice ("auto"): "naive" gives each
    (token, expert) route its own block wherever the small-batch rule allows it and falls
    back to "sorted" elsewhere, so prefill and wide decode stay legal.

    Statistics (--moe-collect-stats, decode only, counted on the device so they hold inside
    CUDA graphs): `expert_reads`, one per distinct routed expert per layer on the sorted path
    and one per route on the naive path; `routes`, padded graph rows included."""

    in_host_memory = True

    def __init__(self, engine_config, model_config):
        super().__init__(engine_config, model_config)
        self.block_assignment = engine_config.moe_uva_block_assignment
        if self.block_assignment not in BLOCK_ASSIGNMENTS:
            raise ValueError(f"block_assignment {self.block_assignment!r} not in {BLOCK_ASSIGNMENTS}")

    @property
    def holds_all(self) -> bool:
        return True  # read in place: nothing misses

    def finalize(self, plan) -> None:
        layers, e = len(self.moe_layer_of), self.model_config.num_experts
        self.read_counts = torch.zeros((layers, e), dtype=torch.int64, device=self.device)
        self.decode_steps = torch.zeros(layers, dtype=torch.int64, device=self.device)
        self.route_counts = torch.zeros(layers, dtype=torch.int64, device=self.device)

    def _assignment(self, topk_ids: torch.Tensor) -> str:
        """The block assignment handed to the kernel: the override, "naive" only where allowed."""
        if self.block_assignment != "naive":
            return self.block_assignment
        from moeferry.kernels.fused_moe.triton import naive_allowed

        allowed = naive_allowed(topk_ids.shape[0], topk_ids.shape[1], self.model_config.num_experts)
        return "naive" if allowed else "sorted"

    def kernel_options(self, topk_ids: torch.Tensor) -> dict:
        return {"block_assignment": self._assignment(topk_ids)}

    def locate(self, layer_id, topk_ids, phase):
        if phase == "decode" and self.engine_config.moe_collect_stats:
            self._count_reads(layer_id, topk_ids, naive=self._assignment(topk_ids) == "naive")
        return self.banks[layer_id], topk_ids

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

    def stats(self) -> dict:
        """Totals over decode forwards; a step is one decode forward of every MoE layer."""
        steps = int(self.decode_steps.max().item()) if self.decode_steps.numel() else 0
        reads = int(self.read_counts.sum().item())
        return {"block_assignment": self.block_assignment, "decode_steps": steps, "expert_reads": reads,
                "routes": int(self.route_counts.sum().item()), "pcie_bytes_read": reads * self.expert_bytes,
                "pcie_bytes_per_step": reads * self.expert_bytes / steps if steps else 0.0}


class SlotStore(ExpertStore):
    """Experts in host memory (pinned when the compute device is a GPU), a slot cache on the
    compute device shared by every MoE layer, admission on the device.

    Invariants: the host banks are the only full copy of the experts; the slot pool holds, in
    each occupied slot, exactly its owner's rows (the slot cache's invariant); the pool's
    banks hold two layers' more rows past the slots, the streamed prefill's buffers
    (`stream`), which the cache never sees."""

    in_host_memory = True
    admits = True

    def __init__(self, engine_config, model_config, widest_demand_chunk: int):
        super().__init__(engine_config, model_config)
        self.widest_demand_chunk = widest_demand_chunk
        self.miss_copy = engine_config.moe_miss_copy
        self.cache: SlotCache | None = None
        self.pool: ExpertBanks | None = None
        self._copier = None  # the copy engine over the current pool, once a copy needed it
        self._copier_key = None  # the pool's addresses and the plan's size it was started for

    @property
    def holds_all(self) -> bool:
        return self.cache.num_slots >= self.total_experts

    def memory_needs(self) -> ExpertNeeds:
        """Slots, the host store, and the two layer buffers of streamed prefill (rows past the slots)."""
        stream_bytes = 2 * self.model_config.num_experts * self.expert_bytes
        return dataclasses.replace(super().memory_needs(), wants_slots=True, stream_bytes=stream_bytes)

    def finalize(self, plan) -> None:
        self.build_cache(plan.expert_slots)

    def build_cache(self, slots: int, eviction_policy: str | None = None) -> None:
        """(Re)build the slot cache and its pool at `slots` slots under `eviction_policy`
        (default: --moe-cache-policy), warm: filled with the first layers' experts in layer
        order (all of them when they fit), so a cache that holds every expert never misses. A
        captured decode graph holds the old pool's pointers: on a running engine, call
        ModelRunner.recapture_graphs() after this."""
        ec, num_experts = self.engine_config, self.model_config.num_experts
        eviction_policy = eviction_policy or ec.moe_cache_policy
        self.cache = self.pool = self.stream = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        top_k = self.model_config.top_k
        widest = max(DEFAULT_MAX_ROUTES, ec.max_running_requests * top_k, self.widest_demand_chunk * top_k)
        self.cache = SlotCache(len(self.moe_layer_of), num_experts, slots, device=self.device,
                               eviction_policy=eviction_policy, lrfu_decay=ec.moe_lrfu_decay,
                               collect_stats=ec.moe_collect_stats, expert_bytes=self.expert_bytes, max_routes=widest)
        banks = next(iter(self.banks.values())).like(slots + 2 * num_experts, self.device, zero=True)
        self.pool = banks.head(slots)
        self.stream = LayerStream(banks, slots, num_experts, len(self.moe_layer_of))
        filled = self._warm_start()
        logger.info("expert cache: %d slots of %d experts (%.1f%%), %.2f GiB on %s (%s, %d bytes per expert); "
                    "policy %s; warm start with %d experts", slots, self.total_experts,
                    100.0 * slots / self.total_experts, slots * self.expert_bytes / 2**30, self.device,
                    self.format_description(), self.expert_bytes, eviction_policy, filled)

    def _warm_start(self) -> int:
        return self.cache.fill([self.banks[l].tensors() for l in sorted(self.banks)], self.pool.tensors())

    def restart(self) -> None:
        """Empty the cache, zero its statistics and warm it again as `build_cache` does, in place
        (captured graphs stay valid): a run measured from here starts from the state a routing
        simulation (routing/simulate.py) starts from, whatever graph capture admitted."""
        self.cache.reset()
        self._warm_start()

    def locate(self, layer_id, topk_ids, phase):
        """Admit the routes' experts (ids -1 are left out) and copy the misses into their slots
        (--moe-miss-copy: the gather kernel, or the copy engine, waited for at once): the pool
        and the routes' slot ids (-1 where the id was)."""
        moe_layer = self.moe_layer_of[layer_id]
        copier = self.copy_engine() if self.miss_copy == "dma" else None
        if copier is None:
            slot_ids = self.cache.load_experts(moe_layer, topk_ids, self.banks[layer_id].tensors(),
                                               self.pool.tensors(), phase=phase)
        else:
            slot_ids = self.cache.admit(moe_layer, topk_ids, phase)
            copier.post(moe_layer, self.cache.plan)
            copier.wait()
        return self.pool, slot_ids

    @property
    def has_copy_engine(self) -> bool:
        """Whether `copy_engine` gives one here (a CUDA device and a C++ compiler)."""
        from moeferry.kernels.gather_copy import copy_engine

        return copy_engine.available(self.device)

    def copy_engine(self):
        """The copy engine (kernels/gather_copy/copy_engine.py) over the current pool, or None
        where there is none (`has_copy_engine`). One serves the demand copies and the
        lookahead's (moe/prefetch.py): a layer joins its lookahead before it admits, so one
        request at most is in flight. Started from an eager forward on first use, and again
        once the pool was rebuilt (its table holds the pool's addresses)."""
        from moeferry.kernels.gather_copy import copy_engine

        if not self.has_copy_engine:
            return None
        pool = self.pool.tensors()
        key = (tuple(t.data_ptr() for t in pool), self.cache.plan.numel())
        if self._copier is None or self._copier_key != key:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # eager warm-ups come first
                raise RuntimeError("the copy engine starts in an eager forward, not inside a capture")
            if self._copier is not None:
                self._copier.close()
            host = [self.banks[layer].tensors() for layer in sorted(self.banks)]
            self._copier = copy_engine.CopyEngine(host, pool, (key[1] - 1) // 2, self.device)
            self._copier_key = key
        return self._copier

    def check(self) -> None:
        from moeferry.errors import EngineFailed

        if self._copier is not None and self._copier.error_code():
            raise EngineFailed(f"expert copies: {self._copier.failed()}")

    def copy_ahead(self, layer_id: int, tuning: GatherTuning = GatherTuning()) -> None:
        """Copy the last lookahead admission's misses (moe/prefetch.py) of layer `layer_id`."""
        self.cache.copy_ahead(self.banks[layer_id].tensors(), self.pool.tensors(), tuning)

    def residency(self) -> torch.Tensor:
        return self.cache.slot_of

    def stats(self) -> dict:
        out = {"slots": self.cache.num_slots, "experts": self.cache.num_layers * self.cache.num_experts}
        if self.cache.stats is not None:
            out.update(self.cache.stats.snapshot())
        return out


class HostStore(ExpertStore):
    """Experts in host memory only: no slot cache and no device copy of any expert outside
    the two layer buffers of streamed prefill; the host banks are the only full copy. The
    routes of decode and of demand prefill go to the host channel."""

    in_host_memory = True

    @property
    def holds_all(self) -> bool:
        return False

    def memory_needs(self) -> ExpertNeeds:
        stream_bytes = 2 * self.model_config.num_experts * self.expert_bytes
        return dataclasses.replace(super().memory_needs(), stream_bytes=stream_bytes)

    def finalize(self, plan) -> None:
        num_experts = self.model_config.num_experts
        buffers = next(iter(self.banks.values())).like(2 * num_experts, self.device)
        self.stream = LayerStream(buffers, 0, num_experts, len(self.moe_layer_of))

    def locate(self, layer_id, topk_ids, phase):
        raise RuntimeError("the host store holds no expert on the device: its routes go to the host channel")

    def stats(self) -> dict:
        return {"experts": self.total_experts}
