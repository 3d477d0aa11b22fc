"""Device-side batched sampling: one token per row of logits, every row with its request's
parameters, reproducible from the request's seed without any CPU generator.

Contract of ``sample(logits, row_slot, positions, state, ...)``:
    logits              [B, V] float32, unit last stride, any row stride; read only.
    row_slot            [B] int32: the slot of ``state`` each row samples for; -1 = padding.
                        Live rows use distinct slots.
    positions           [B] int64: the position of the token each row generates (with the
                        slot's seed, the key of the row's random numbers).
    state               SamplingState of the same V: the slots' parameters and penalty state.
    logprobs_out        [B, V] float32, contiguous (written; allocated unless given): a live
                        row whose slot has ``full_logprobs`` gets the log-probs of every token
                        (below); other rows are scratch, with unspecified contents. Padding rows
                        are not touched.
    tokens_out          [B] int64 (written): the chosen tokens; 0 for padding rows.
    token_logprobs_out  [B] float32 (written): the chosen tokens' log-probs; 0 for padding.
    token_mask          [B, W] int32, W >= ceil(V / 32), unit last stride (optional, read only):
                        packed bitmasks of the tokens a row may take, bit v % 32 of word v // 32
                        for token v (xgrammar's and llguidance's layout).
    mask_rows           [B] int32, given with token_mask: rows with a nonzero flag are restricted
                        to their mask's tokens; the others read neither their mask nor anything
                        more than without one (one flag load).
    Effect: ``state.output_counts[slot, token] += 1`` for every live row, on the device, so
    the penalty state follows the generated tokens across CUDA graph replays.
No output may alias an input or the state. The launch shape depends on B and V only and nothing
is read back to the host: a call captures in a CUDA graph and replays with new contents in the
same buffers.

Per live row b with slot s, in order:
1. z = logits[b]; repetition penalty r on tokens in the prompt or already generated
   (``prompt_mask[s]`` or ``output_counts[s] > 0``): z / r where z > 0, z * r elsewhere; then
   z -= frequency * count + presence * (count > 0); then z += logit bias; then, in a row with
   a mask, z = -inf on every token its mask leaves out (a mask must allow one token of finite
   logit). Greedy and sampled rows alike are restricted: the rest works on that z.
2. Greedy (temperature 0): token = argmax z, ties to the lowest index. Without penalties or
   bias, exactly ``logits.argmax(-1)``.
3. Sampled: z = z * (1 / temperature) (fp32 reciprocal). K = {v : z_v >= max(t_k, t_min)}
   with t_k the k-th largest z (ties kept; -inf when top_k <= 0 or >= V) and t_min = max z +
   log(min_p) (-inf when min_p = 0). M = sum over K of exp(z - max z). A token x of K is in
   the nucleus iff the sum over {v in K: z_v > z_x} of exp(z_v - max z) < top_p * M (every
   token of K when top_p = 1). The token follows softmax(z) restricted to the nucleus.
4. Randomness: Philox4x32-10 keyed by the slot's seed, counter (index, position, 2 * round +
   level); u from its first word by Triton's uint32 -> float conversion, clamped to
   [2**-32, 1); Gumbel noise -log(-log(u)). A seeded request gets the same tokens in any batch,
   any row, captured or not.
5. Sampling without sorting, by rejection with pivots: round r (r < 32) draws x from softmax(z)
   over C_r, C_0 = K, and accepts it when it is in the nucleus; otherwise C_{r+1} = {v in C_r :
   z_v > z_x} (the nucleus, an upper set of z, lies above any rejected x). After 32 rejections,
   argmax z. A draw is two Gumbel-max steps, exact in distribution: a column c (the tokens c,
   c + 1024, c + 2048, ...) by the mass of its candidates (level 0, index c), then a candidate
   of that column by z (level 1, index the token).
6. Log-probs: (z - max z) - log(sum exp(z - max z)) of the processed z (after penalties, bias
   and temperature; temperature 1 for greedy rows), before any truncation.
reference.py holds this specification in plain torch; triton.py runs it on the GPU in one
launch with one program per row. Both give the same tokens for the same inputs (they sum in
other orders: a decision that hinges on the last bit of a sum may go either way). Logits are
finite or -inf (a row needs one finite logit); a row holding NaN gets an unspecified token in
[0, V).
"""
from __future__ import annotations

import torch

from moeferry.kernels import implementation
from moeferry.kernels.sampling.state import SamplingState

__all__ = ["SamplingState", "sample"]


def sample(logits: torch.Tensor, row_slot: torch.Tensor, positions: torch.Tensor,
           state: SamplingState, *, logprobs_out: torch.Tensor | None = None,
           tokens_out: torch.Tensor | None = None, token_logprobs_out: torch.Tensor | None = None,
           token_mask: torch.Tensor | None = None, mask_rows: torch.Tensor | None = None,
           impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, token_logprobs [B] f32, logprobs [B, V] f32); see the module
    docstring. ``impl``: "triton" or "reference"; None picks Triton for CUDA logits (Triton on
    CPU tensors needs TRITON_INTERPRET=1, set before triton is imported)."""
    return implementation("sampling", logits, impl).sample(
        logits, row_slot, positions, state, logprobs_out=logprobs_out, tokens_out=tokens_out,
        token_logprobs_out=token_logprobs_out, token_mask=token_mask, mask_rows=mask_rows)
