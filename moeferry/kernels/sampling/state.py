"""SamplingState: the per-slot sampling parameters and penalty state, on the device."""
from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from moeferry.kernels import size_of

__all__ = ["SamplingState"]


@dataclass(frozen=True)
class SamplingState:
    """Every per-request tensor the sampler reads, indexed by slot (one running request).

    Parameters, ``[S]``: ``temperature`` f32 (0 = greedy), ``top_k`` i32 (<= 0 or >= V: off),
    ``top_p`` f32 in (0, 1] (1: off), ``min_p`` f32 in [0, 1] (0: off),
    ``repetition_penalty`` f32 > 0 (1: off), ``frequency_penalty`` and ``presence_penalty``
    f32 (0: off), ``seed`` i64 (the key of the slot's random stream), ``full_logprobs`` u8
    (1: the sampler writes the row's log-probs of every token).
    Penalty state: ``output_counts[S, V]`` i32 (times each token was generated so far; the
    sampler adds each live row's token), ``prompt_mask[S, V]`` u8 (1: in the prompt).
    Logit bias: ``bias_ids[S, NB]`` i32 and ``bias_values[S, NB]`` f32, a slot's entries
    first with distinct ids in [0, V), then -1: a slot without bias has ``bias_ids[s, 0] = -1``
    and costs the sampler one load.

    Invariants: the tensors are allocated once and only written in place (captured CUDA
    graphs hold their pointers); ``assign`` writes a whole slot eagerly, outside any graph;
    the rows of one sampler call use distinct slots.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    seed: torch.Tensor
    full_logprobs: torch.Tensor
    output_counts: torch.Tensor
    prompt_mask: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, vocab: int, max_bias: int, device) -> "SamplingState":
        """Every slot at temperature 1, every filter and penalty off, seed 0, no bias."""
        def full(shape, value, dtype):
            return torch.full(shape, value, dtype=dtype, device=device)

        s = (num_slots,)
        return cls(
            temperature=full(s, 1.0, torch.float32), top_k=full(s, -1, torch.int32),
            top_p=full(s, 1.0, torch.float32), min_p=full(s, 0.0, torch.float32),
            repetition_penalty=full(s, 1.0, torch.float32),
            frequency_penalty=full(s, 0.0, torch.float32),
            presence_penalty=full(s, 0.0, torch.float32), seed=full(s, 0, torch.int64),
            full_logprobs=full(s, 1, torch.uint8),
            output_counts=full((num_slots, vocab), 0, torch.int32),
            prompt_mask=full((num_slots, vocab), 0, torch.uint8),
            bias_ids=full((num_slots, max(1, max_bias)), -1, torch.int32),
            bias_values=full((num_slots, max(1, max_bias)), 0.0, torch.float32))

    num_slots = size_of("output_counts", 0)
    vocab = size_of("output_counts", 1)
    max_bias = size_of("bias_ids", 1)

    def assign(self, slot: int, *, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
               min_p: float = 0.0, repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, seed: int | None = None,
               logit_bias: Mapping[int, float] | None = None, prompt_ids: Sequence[int] = (),
               output_ids: Sequence[int] = (), full_logprobs: bool = True) -> None:
        """Writes every field of ``slot``: the parameters (an unseeded request gets a random
        seed), the counts of ``output_ids`` (non-empty when a preempted request resumes), the
        prompt mask of ``prompt_ids`` and the bias entries."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of [0, {self.num_slots})")
        _check_parameters(temperature, top_p, min_p, repetition_penalty)
        scalars = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                   "repetition_penalty": repetition_penalty, "frequency_penalty": frequency_penalty,
                   "presence_penalty": presence_penalty,
                   "seed": secrets.randbits(63) if seed is None else seed,
                   "full_logprobs": int(bool(full_logprobs))}
        for name, value in scalars.items():
            getattr(self, name)[slot].fill_(value)
        self.output_counts[slot].zero_()
        self.output_counts[slot].index_put_((self._token_ids(output_ids, "output_ids"),),
                                            torch.ones(len(output_ids), dtype=torch.int32,
                                                       device=self.output_counts.device),
                                            accumulate=True)
        self.prompt_mask[slot].zero_()
        self.prompt_mask[slot].index_fill_(0, self._token_ids(prompt_ids, "prompt_ids"), 1)
        self._assign_bias(slot, dict(logit_bias or {}))

    def _token_ids(self, ids: Sequence[int], name: str) -> torch.Tensor:
        ids = torch.as_tensor(list(ids), dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            raise ValueError(f"{name}: token ids must lie in [0, {self.vocab})")
        return ids.to(self.output_counts.device)

    def _assign_bias(self, slot: int, bias: dict[int, float]) -> None:
        if len(bias) > self.max_bias:
            raise ValueError(f"logit_bias: {len(bias)} entries, at most {self.max_bias}")
        ids = self._token_ids(bias.keys(), "logit_bias")
        n = ids.numel()
        self.bias_ids[slot].fill_(-1)
        self.bias_values[slot].zero_()
        self.bias_ids[slot, :n] = ids.to(torch.int32)
        self.bias_values[slot, :n] = torch.tensor(list(bias.values()), dtype=torch.float32)


def _check_parameters(temperature: float, top_p: float, min_p: float,
                      repetition_penalty: float) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if not (math.isfinite(repetition_penalty) and repetition_penalty > 0):
        raise ValueError(f"repetition_penalty must be finite and > 0, got {repetition_penalty}")
