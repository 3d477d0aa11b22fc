"""Expert slot cache admission: ``admit(state, moe_layer, topk_ids, counters) -> slot_ids``.

Dedups a call's routes, refreshes the hits, gives each distinct miss a victim slot under the
state's eviction policy, updates the maps, writes a copy plan for gather_copy and returns the
routes as slot ids. The semantics, bit for bit, are those of reference.py (its docstring is the
specification); the Triton kernel reproduces them in one program per call with no host sync
(CUDA-graph capturable). `state.py` holds the state every implementation shares.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.kernels import implementation
from moeferry.kernels.admission.state import (POLICIES, AdmissionCounters, DecayPowers, SlotState,
                                              check_call)

__all__ = ["POLICIES", "AdmissionCounters", "AdmissionTuning", "DecayPowers", "SlotState", "admit",
           "check_call"]


@dataclass(frozen=True)
class AdmissionTuning:
    """How the Triton kernel runs (the reference ignores it): every value gives the same
    results, only the time differs. The defaults are the measured best on an H200
    (benchmarks/RESULTS.md, admission); `python -m benchmarks.sweep_admission` sweeps them.

    num_warps / num_warps_wide: warps of a call of at most / more than `max_block_r` routes.
    radix_bits: key bits resolved per sweep of the radix victim search.
    max_block_r, max_block_s: routes and slots per block; a pool of at most `max_block_s`
    slots keeps its keys in registers when `keys_in_registers`.
    extract_max: up to this many misses, victims by repeated minimum (keys in registers).
    all_hits_fast_path: LRU policies without statistics try the one-pass all-hits path first.
    phase_clock: the debug probe: an SM clock read after each phase, summed into
    `triton.phase_cycles(device)` (adds barriers: for measuring, never for serving).
    """

    num_warps: int = 8
    num_warps_wide: int = 16
    radix_bits: int = 5
    max_block_r: int = 1024
    max_block_s: int = 4096
    keys_in_registers: bool = True
    extract_max: int = 16
    all_hits_fast_path: bool = True
    phase_clock: bool = False


def admit(state: SlotState, moe_layer: int, topk_ids: torch.Tensor, counters: AdmissionCounters | None = None, *,
          tuning: AdmissionTuning = AdmissionTuning(), impl: str | None = None, ahead: bool = False) -> torch.Tensor | None:
    """Admit every expert routed by ``topk_ids`` into MoE layer ``moe_layer``; returns slot ids
    shaped like ``topk_ids`` (an int32 view of ``state.slot_ids``, valid until the next call).
    ``ahead``: a lookahead admission of predicted experts beside the last call's (no clock
    step, its own plan, no slot ids: reference.py), returns None."""
    return implementation("admission", topk_ids, impl).admit(state, moe_layer, topk_ids, counters, tuning,
                                                             ahead=ahead)
