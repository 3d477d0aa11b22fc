"""The engine's sampler: every running request owns a slot of one device SamplingState
(kernels/sampling), and a batch's tokens are drawn on the device in one launch, inside the
decode CUDA graph where there is one; the host reads back the token ids (and, for requests that
asked, their log-probs) and nothing else.

A slot is written whole (`SamplingState.assign`) when its request first samples after a prefill
(its first token, or again after a preemption, with the tokens generated so far for the
penalties), and freed when the request finishes, is aborted or is preempted. A request's random
stream is keyed by its seed and the position of the token it draws, so a seeded request gives
the same tokens in any batch, replayed from a graph or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.kernels.sampling import SamplingState, sample
from moeferry.sampling import MAX_LOGIT_BIAS, SAMPLING_EPS
from moeferry.structured import TokenMasks


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the `top` most likely tokens' [(id, logprob)],
    from the log-softmax of the processed logits (penalties, bias and temperature applied,
    before top-k/top-p/min-p truncation)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Logprob:
    """vLLM's shape of one token's entry in a position's log-probs: its log-probability, its
    rank at that position (1: the most likely), and its text (None without a tokenizer)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(frozen=True)
class PromptLogprobs:
    """One prompt token's log-probability given the tokens before it, its rank (the tokens
    at least as likely as it, itself included: 1 is the most likely), and the `top` most
    likely tokens' [(id, logprob)] there, from the log-softmax of the model's float32 logits
    (no penalty, bias or temperature: vLLM's raw prompt log-probs)."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()

    def as_dict(self, token_text=None) -> dict[int, Logprob]:
        """vLLM's form: token id -> Logprob, the prompt token first, then the top ones by rank
        (the prompt token once, where it is among them). `token_text(id)`: a token's text."""
        text = token_text or (lambda _: None)
        out = {self.token: Logprob(self.logprob, self.rank, text(self.token))}
        for rank, (token, logprob) in enumerate(self.top, 1):
            out[token] = Logprob(logprob, rank, text(token))
        return out


PROMPT_LOGITS_BYTES = 64 << 20  # float32 logits of prompt rows held at once (their log-softmax as much)


@torch.inference_mode()
def prompt_logprobs(hidden: torch.Tensor, logits_of, targets: list[int], k: int, vocab: int,
                    max_bytes: int = PROMPT_LOGITS_BYTES) -> list[PromptLogprobs]:
    """The PromptLogprobs of `targets[i]` under row i of `hidden` [len(targets), H] (the final
    hidden states of the positions before them), with the `k` most likely tokens':
    `logits_of(rows)` -> float32 logits [rows, `vocab`], called on slices of at most
    `max_bytes` of logits (one row at least), so a long prompt never holds [T, V] at once."""
    rows = max(1, max_bytes // (4 * vocab))
    out = []
    for start in range(0, len(targets), rows):
        logprobs = torch.log_softmax(logits_of(hidden[start:start + rows]).float(), dim=-1)
        wanted = torch.tensor(targets[start:start + rows], device=logprobs.device)
        chosen = logprobs.gather(1, wanted[:, None])
        ranks = (logprobs >= chosen).sum(dim=-1).tolist()
        tops = [()] * len(ranks)
        if k:
            top = torch.topk(logprobs, k, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
        out += [PromptLogprobs(t, lp, r, top) for t, lp, r, top in
                zip(targets[start:start + rows], chosen[:, 0].tolist(), ranks, tops)]
    return out


def mask_words(vocab: int) -> int:
    """int32 words of one row's packed token bitmask."""
    return -(-vocab // 32)


@dataclass
class SampleBuffers:
    """Static device buffers of one sampler call of up to `rows` rows (a decode graph captures
    their pointers): the rows' slots and draw positions (inputs), their token masks (inputs:
    `token_mask` [rows, W] packed bitmasks, `mask_rows` [rows] flags, 1 for a constrained row),
    tokens, their log-probs and the processed log-probs of every token (outputs).
    `all_mask_rows` is the whole flags buffer a view's `mask_rows` is part of."""

    row_slot: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor
    token_logprobs: torch.Tensor
    logprobs: torch.Tensor
    token_mask: torch.Tensor
    mask_rows: torch.Tensor
    all_mask_rows: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, vocab: int, device, row_slot: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None) -> "SampleBuffers":
        """New buffers; the inputs may be given (the decode graphs stage them with the rest)."""
        if row_slot is None:
            row_slot = torch.full((rows,), -1, dtype=torch.int32, device=device)
        if positions is None:
            positions = torch.zeros(rows, dtype=torch.int64, device=device)
        mask_rows = torch.zeros(rows, dtype=torch.int32, device=device)
        return cls(row_slot=row_slot, positions=positions,
                   tokens=torch.zeros(rows, dtype=torch.int64, device=device),
                   token_logprobs=torch.zeros(rows, dtype=torch.float32, device=device),
                   logprobs=torch.zeros(rows, vocab, dtype=torch.float32, device=device),
                   token_mask=torch.zeros(rows, mask_words(vocab), dtype=torch.int32, device=device),
                   mask_rows=mask_rows, all_mask_rows=mask_rows)

    def view(self, rows: int) -> "SampleBuffers":
        return SampleBuffers(self.row_slot[:rows], self.positions[:rows], self.tokens[:rows],
                             self.token_logprobs[:rows], self.logprobs[:rows], self.token_mask[:rows],
                             self.mask_rows[:rows], self.all_mask_rows)


class Sampler:
    """Slots of one SamplingState for the running requests.

    Invariants: a request holds at most one slot, and a slot at most one request; a slot's
    contents are its request's parameters and penalty state (the counts of every token it
    generated since the slot was assigned: the kernel adds each sampled token on the device).
    A row is constrained by a token mask exactly when its request has a grammar
    (`Request.grammar`): `stage_masks` writes the masks of such rows and keeps every other
    flag of a persistent buffer 0, so a step without grammars copies nothing.
    """

    def __init__(self, num_slots: int, vocab: int, device: torch.device):
        self.state = SamplingState.allocate(num_slots, vocab, MAX_LOGIT_BIAS, device)
        self.vocab = vocab
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[int, int] = {}
        self._masks = TokenMasks(num_slots, mask_words(vocab), pinned=device.type == "cuda")
        self._masks_copied = torch.cuda.Event() if device.type == "cuda" else None
        # a step's tokens come back through pinned memory and an event: a pageable read would
        # block in the driver while the step's graph may still wait on a host worker. Two of
        # each: a launched step's read may still be outstanding when the next step queues its own
        cuda = device.type == "cuda"
        self._host_tokens = [torch.zeros(num_slots, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._tokens_read = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._next_read = 0
        self._flagged: dict[int, torch.Tensor] = {}  # whole flag buffers that may hold a 1

    @staticmethod
    def device_bytes(num_slots: int, vocab: int, rows: int) -> int:
        """Device bytes of a sampler of `num_slots` slots and a graph's buffers of `rows` rows:
        per slot int32 counts and a byte of prompt mark per token, per row float32 log-probs
        and a bit of token mask per token."""
        return num_slots * vocab * 5 + rows * (vocab * 4 + mask_words(vocab) * 4 + 4)

    def bind(self, req) -> int:
        """The request's slot, assigned and written now if it has none (the engine binds every
        request it samples for, before the step draws; `slots` then only looks them up)."""
        slot = self._slot_of.get(req.rid)
        if slot is not None:
            return slot
        p = req.params
        if 0.0 < p.temperature < SAMPLING_EPS:  # SamplingParams makes these greedy: 1/T would overflow
            raise ValueError(f"request {req.rid}: temperature {p.temperature} below {SAMPLING_EPS} and not 0")
        if not self._free:
            raise RuntimeError("no free sampling slot: more running requests than slots")
        slot = self._slot_of[req.rid] = self._free.pop()
        self.state.assign(slot, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                          repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
                          presence_penalty=p.presence_penalty, seed=req.seed, logit_bias=p.logit_bias,
                          prompt_ids=req.prompt_ids if p.repetition_penalty != 1.0 else (),
                          output_ids=req.output_ids, full_logprobs=bool(p.logprobs))  # logprobs 0: the token's own only
        return slot

    def is_bound(self, req) -> bool:
        return req.rid in self._slot_of

    def slots(self, reqs) -> list[int]:
        """The slots of bound requests (KeyError for one that is not)."""
        return [self._slot_of[r.rid] for r in reqs]

    def release(self, req) -> None:
        slot = self._slot_of.pop(req.rid, None)
        if slot is not None:
            self._free.append(slot)

    def stage(self, buffers: SampleBuffers, reqs, ahead: int = 0) -> None:
        """Write the rows' slots and draw positions into `buffers` (rows past len(reqs) are
        padding: slot -1). The position of a draw is the index of the token it makes: with
        `ahead`, that many tokens past the request's last one on the host."""
        n = len(reqs)
        slots = torch.tensor(self.slots(reqs) + [-1] * (buffers.row_slot.shape[0] - n), dtype=torch.int32)
        positions = torch.tensor([r.num_tokens + ahead for r in reqs] + [0] * (buffers.positions.shape[0] - n))
        buffers.row_slot.copy_(slots, non_blocking=True)
        buffers.positions.copy_(positions, non_blocking=True)

    def stage_masks(self, buffers: SampleBuffers, reqs, persistent: bool = True) -> None:
        """The token masks of the requests with a grammar into rows [0, len(reqs)) of `buffers`
        (computed on the host now, then one asynchronous copy each of words and flags); with no
        grammar in the call, nothing is copied, and a persistent buffer's flags that an earlier
        call set are cleared on the device."""
        matchers = [r.grammar for r in reqs]
        if not any(m is not None for m in matchers):
            flags = self._flagged.pop(buffers.all_mask_rows.data_ptr(), None)
            if flags is not None:
                flags.zero_()
            return
        if self._masks_copied is not None:
            self._masks_copied.synchronize()  # the previous step's copies have read the host rows
        n = len(reqs)
        self._masks.fill(matchers)
        buffers.token_mask[:n].copy_(self._masks.words[:n], non_blocking=True)
        buffers.mask_rows[:n].copy_(self._masks.flags[:n], non_blocking=True)
        if self._masks_copied is not None:
            self._masks_copied.record()
        if persistent:
            self._flagged[buffers.all_mask_rows.data_ptr()] = buffers.all_mask_rows

    def run(self, logits: torch.Tensor, buffers: SampleBuffers) -> None:
        """The sampler kernel over `logits` [rows, V] into `buffers` (graph-capturable)."""
        sample(logits, buffers.row_slot, buffers.positions, self.state, logprobs_out=buffers.logprobs,
               tokens_out=buffers.tokens, token_logprobs_out=buffers.token_logprobs,
               token_mask=buffers.token_mask, mask_rows=buffers.mask_rows)

    def sample(self, logits: torch.Tensor, reqs) -> "SampledTokens":
        """Eagerly: one token for each of `reqs`, row i of `logits` [len(reqs), V] float32."""
        return self.read(self.draw(logits, reqs), reqs)

    def draw(self, logits: torch.Tensor, reqs, ahead: int = 0) -> SampleBuffers:
        """Eagerly, nothing read back: the buffers of one token drawn for each of `reqs` from
        row i of `logits` [len(reqs), V] float32, each `ahead` tokens past its last on the host."""
        buffers = SampleBuffers.allocate(len(reqs), self.vocab, logits.device)
        self.stage(buffers, reqs, ahead)
        self.stage_masks(buffers, reqs, persistent=False)
        self.run(logits, buffers)
        return buffers

    def read(self, buffers: SampleBuffers, reqs) -> "SampledTokens":
        """The tokens of the first len(reqs) rows, and the log-probs of those that asked."""
        n = len(reqs)
        tokens = self.read_later(buffers.tokens[:n]).wait()
        wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not wanted:
            return SampledTokens(tokens, [None] * n)
        return SampledTokens(tokens, self._logprobs(buffers, reqs, wanted))

    def read_later(self, tokens: torch.Tensor) -> "PendingTokens":
        """The host's copy of `tokens` [n] (at most one per slot), queued behind the work that
        writes them. At most two may be outstanding: a launched step's, and the next one's."""
        if self._tokens_read is None:  # on the CPU: nothing to wait for
            return PendingTokens(tokens, None)
        i, self._next_read = self._next_read, 1 - self._next_read
        host = self._host_tokens[i][:tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        self._tokens_read[i].record()
        return PendingTokens(host, self._tokens_read[i])

    def _logprobs(self, buffers: SampleBuffers, reqs, wanted: list[int]) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(reqs)
        chosen = buffers.token_logprobs[wanted].tolist()
        k = max(reqs[i].params.logprobs for i in wanted)
        top_values = top_ids = None
        if k > 0:
            top = torch.topk(buffers.logprobs[wanted], k, dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        for j, i in enumerate(wanted):
            kept = reqs[i].params.logprobs
            top_pairs = tuple(zip(top_ids[j][:kept], top_values[j][:kept])) if kept else ()
            out[i] = TokenLogprobs(chosen[j], top_pairs)
        return out


@dataclass(frozen=True)
class PendingTokens:
    """A step's token ids on their way to the host: `wait()` gives them once the copy queued
    behind the step is done (`event`; None on the CPU, where `host` holds them already)."""

    host: torch.Tensor
    event: torch.cuda.Event | None

    def wait(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass(frozen=True)
class SampledTokens:
    """One sampler call's result on the host: a token per request, and its TokenLogprobs where
    the request asked for log-probs (else None)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
