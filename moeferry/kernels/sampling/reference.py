"""Batched token sampling in plain torch: the specification, and the oracle of triton.py.

Read top to bottom: the random stream (Philox4x32-10 exactly as Triton's ``tl.philox``
computes it, and Triton's uint32 -> float conversion), the processing of the logits, then the
choice of a token per row. The kernel must draw the same uniforms bit for bit and, given the
same processed logits, the same tokens (it sums in another order, so a decision that hinges on
the last bit of a sum may differ: that happens with probability ~1e-7 per decision).
"""
from __future__ import annotations

import numpy as np
import torch

from moeferry.kernels.sampling.state import SamplingState

__all__ = ["COLUMNS", "MAX_ROUNDS", "U_MIN", "philox", "uniform", "uniforms", "gumbel", "allowed_tokens",
           "processed_logits", "log_probs", "kept", "draw", "sample_row", "sample"]

COLUMNS = 1024  # a draw picks a column (tokens c, c + COLUMNS, ...) first, then a token in it
MAX_ROUNDS = 32  # rejection rounds before the fallback to the argmax (always in the nucleus)
U_MIN = 2.0 ** -32  # uniforms are clamped to [U_MIN, 1): the Gumbel noise stays finite

_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_UNIFORM_SCALE = 4.6566127342e-10  # Triton's: the largest with (2**31 - 1) * scale < 1 in fp32


def _words(value) -> np.ndarray:
    return np.asarray(torch.as_tensor(value, dtype=torch.int64).cpu()).astype(np.uint64) & _MASK32


def philox(seed: int, c0, c1, c2, c3) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of the counter (c0, c1, c2, c3) under the 64-bit key ``seed`` (low word
    first), as CPU int64 tensors holding uint32 values: Triton's ``tl.philox(seed, c0, c1, c2,
    c3)``. (In numpy: products of two 32-bit words fit its uint64.)"""
    c0, c1, c2, c3 = np.broadcast_arrays(*(_words(c) for c in (c0, c1, c2, c3)))
    k0, k1 = np.uint64(seed & _MASK32), np.uint64((seed >> 32) & _MASK32)
    for _ in range(10):
        product_b, product_a = np.uint64(_ROUND_B) * c2, np.uint64(_ROUND_A) * c0
        c0, c1 = (product_b >> np.uint64(32)) ^ c1 ^ k0, product_b & np.uint64(_MASK32)
        c2, c3 = (product_a >> np.uint64(32)) ^ c3 ^ k1, product_a & np.uint64(_MASK32)
        k0, k1 = (k0 + np.uint64(_KEY_A)) & np.uint64(_MASK32), (k1 + np.uint64(_KEY_B)) & np.uint64(_MASK32)
    return tuple(torch.from_numpy(c.astype(np.int64)) for c in (c0, c1, c2, c3))


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """float32 in [U_MIN, 1) of uint32 values held in int64: Triton's uint_to_uniform_float (the
    bits as int32, negatives complemented, times the fp32 scale), then clamped below."""
    signed = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits)
    magnitude = torch.where(signed < 0, ~signed, signed)
    u = magnitude.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=bits.device)
    return torch.clamp_min(u, U_MIN)


def uniforms(seed: int, position: int, round_: int, level: int, index: torch.Tensor) -> torch.Tensor:
    """The uniforms of ``index`` (a column at level 0, a token at level 1) in draw ``round_`` of
    the token at ``position`` of the request seeded ``seed``: the first word of
    Philox(counter = (index, position low, position high, 2 * round + level)), converted."""
    bits, _, _, _ = philox(seed, index, position & _MASK32, (position >> 32) & _MASK32,
                           2 * round_ + level)
    return uniform(bits.to(index.device))


def gumbel(seed: int, position: int, round_: int, level: int, index: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log(u)) of those uniforms."""
    return -torch.log(-torch.log(uniforms(seed, position, round_, level, index)))


def allowed_tokens(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., V] bool of packed bitmasks [..., W] int32: token v is allowed iff bit v % 32 of word
    v // 32 is set (the layout of xgrammar's and llguidance's token bitmasks)."""
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    unpacked = (words[..., :, None] >> bits) & 1
    return unpacked.flatten(-2)[..., :vocab] != 0


def processed_logits(logits: torch.Tensor, row_slot: torch.Tensor, state: SamplingState,
                     token_mask: torch.Tensor | None = None,
                     mask_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] float32: per live row, in order, the repetition penalty on tokens of the prompt or
    already generated (z / r where z > 0, z * r elsewhere), z -= frequency * count + presence *
    (count > 0), z += logit bias, z = -inf on the tokens the row's mask leaves out (rows with
    ``mask_rows[b] != 0``), then z * (1 / temperature) (fp32 reciprocal) unless greedy.
    Padding rows are left as their logits."""
    z = logits.float().clone()
    for b, slot in enumerate(row_slot.tolist()):
        if slot >= 0:
            allowed = None
            if token_mask is not None and int(mask_rows[b]) != 0:
                allowed = allowed_tokens(token_mask[b], z.shape[1])
            z[b] = _processed_row(z[b], state, slot, allowed)
    return z


def _processed_row(z: torch.Tensor, state: SamplingState, s: int,
                   allowed: torch.Tensor | None) -> torch.Tensor:
    counts = state.output_counts[s]
    penalty = state.repetition_penalty[s]
    seen = (state.prompt_mask[s] != 0) | (counts > 0)
    z = torch.where(seen, torch.where(z > 0, z / penalty, z * penalty), z)
    z = z - (state.frequency_penalty[s] * counts.float()
             + state.presence_penalty[s] * (counts > 0).float())
    ids = state.bias_ids[s]
    used = ids >= 0
    z = z.index_put((ids[used].long(),), state.bias_values[s][used], accumulate=True)
    if allowed is not None:
        z = torch.where(allowed, z, float("-inf"))
    temperature = state.temperature[s]
    if temperature > 0:
        z = z * torch.reciprocal(temperature)
    return z


def log_probs(z: torch.Tensor) -> torch.Tensor:
    """(z - max) - log(sum(exp(z - max))) per row."""
    shifted = z - z.max(dim=-1, keepdim=True).values
    return shifted - torch.log(torch.exp(shifted).sum(dim=-1, keepdim=True))


def kept(z: torch.Tensor, top_k: int, min_p: float) -> torch.Tensor:
    """K: the tokens at or above both thresholds, the k-th largest z (ties kept; off when
    top_k <= 0 or >= V) and max z + log(min_p) (off when min_p is 0)."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < z.numel():
        keep &= z >= torch.topk(z, top_k).values[-1]
    if min_p > 0:
        keep &= z >= z.max() + torch.log(torch.tensor(min_p, dtype=torch.float32, device=z.device))
    return keep


def draw(z: torch.Tensor, candidates: torch.Tensor, seed: int, position: int, round_: int) -> int:
    """A token from softmax(z) restricted to ``candidates``, in two Gumbel-max steps that
    compose to exactly that distribution: a column c (the tokens c, c + COLUMNS, ...) with
    weight its candidates' mass sum(exp(z - max z)), then a token of that column by its z.
    Ties go to the lowest index."""
    v = z.numel()
    mass = torch.where(candidates, torch.exp(z - z.max()), 0.0)
    rows = -(-v // COLUMNS)
    column_mass = torch.nn.functional.pad(mass, (0, rows * COLUMNS - v)).view(rows, COLUMNS).sum(0)
    columns = torch.nonzero(column_mass > 0)[:, 0]
    if columns.numel() == 0:  # no candidate has a finite mass (NaN or +inf logits): any token will do
        return int(torch.argmax(torch.nan_to_num(z)))
    keys = torch.log(column_mass[columns]) + gumbel(seed, position, round_, 0, columns)
    column = int(columns[torch.argmax(keys)])
    tokens = torch.arange(column, v, COLUMNS, device=z.device)
    tokens = tokens[candidates[tokens]]
    keys = z[tokens] + gumbel(seed, position, round_, 1, tokens)
    return int(tokens[torch.argmax(keys)])


def sample_row(z: torch.Tensor, top_k: int, top_p: float, min_p: float, seed: int,
               position: int) -> int:
    """Rejection with pivots: round r draws x from C_r (C_0 = K) and accepts it when it lies in
    the nucleus, i.e. the mass of K strictly above z_x is below top_p times the mass of K
    (always, when top_p >= 1). Otherwise C_{r+1} = {v in C_r: z_v > z_x}: the nucleus is an
    upper set of z, so it lies above any rejected x, and the accepted token is distributed as
    softmax(z) restricted to the nucleus. After MAX_ROUNDS rejections, the argmax."""
    keep = kept(z, top_k, min_p)
    mass = torch.where(keep, torch.exp(z - z.max()), 0.0)
    total = mass.sum()
    candidates = keep
    for round_ in range(MAX_ROUNDS):
        x = draw(z, candidates, seed, position, round_)
        if top_p >= 1.0 or mass[z > z[x]].sum() < top_p * total:
            return x
        candidates = candidates & (z > z[x])
    return int(torch.argmax(z))


def sample(logits: torch.Tensor, row_slot: torch.Tensor, positions: torch.Tensor,
           state: SamplingState, *, logprobs_out: torch.Tensor | None = None,
           tokens_out: torch.Tensor | None = None,
           token_logprobs_out: torch.Tensor | None = None, token_mask: torch.Tensor | None = None,
           mask_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, token_logprobs [B] f32, logprobs [B, V] f32); see the package
    docstring for the contract. Rows whose slot has ``full_logprobs`` 0 are left untouched in
    ``logprobs_out``, as are padding rows."""
    b, v = logits.shape
    device = logits.device
    logprobs_out = torch.empty(b, v, device=device) if logprobs_out is None else logprobs_out
    tokens_out = torch.empty(b, dtype=torch.int64, device=device) if tokens_out is None else tokens_out
    token_logprobs_out = torch.empty(b, device=device) if token_logprobs_out is None else token_logprobs_out
    z = processed_logits(logits, row_slot, state, token_mask, mask_rows)
    lp = log_probs(z)
    tokens = [0] * b
    for row, (slot, position) in enumerate(zip(row_slot.tolist(), positions.tolist())):
        if slot < 0:
            continue
        if float(state.temperature[slot]) == 0.0:
            tokens[row] = int(torch.argmax(z[row]))
        else:
            tokens[row] = sample_row(z[row], int(state.top_k[slot]), float(state.top_p[slot]),
                                     float(state.min_p[slot]), int(state.seed[slot]), position)
        if state.full_logprobs[slot]:
            logprobs_out[row] = lp[row]
    chosen = torch.tensor(tokens, dtype=torch.int64, device=device)
    live = row_slot >= 0
    tokens_out.copy_(chosen)
    token_logprobs_out.copy_(torch.where(live, lp.gather(1, chosen[:, None])[:, 0], 0.0))
    slots = row_slot[live].long()
    state.output_counts.index_put_((slots, chosen[live]), torch.ones_like(slots, dtype=torch.int32),
                                   accumulate=True)
    return tokens_out, token_logprobs_out, logprobs_out
