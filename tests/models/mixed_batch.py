"""A mixed batch against transformers, shared by the family tests that bring their own attention
(DeepSeek's MLA, gpt-oss's sinks and windows): request a's 13-token prompt in two chunks, the
second batched with request b's whole 7-token prompt, then `decode_steps` decode steps of both
in one batch; every position's fp32 logits within 1e-4 of transformers' over the whole sequence."""

import torch

from moeferry import SamplingParams
from moeferry.scheduler.request import Request


def _logits(runner, batch, rows):
    batch.logits_rows = torch.arange(rows)
    return runner.forward(batch)


def assert_mixed_batch_matches_transformers(runner, hf, name: str, decode_steps: int, vocab: int = 96) -> None:
    g = torch.Generator().manual_seed(1)
    a = Request(torch.randint(0, vocab, (13,), generator=g).tolist(), SamplingParams(max_tokens=8))
    b = Request(torch.randint(0, vocab, (7,), generator=g).tolist(), SamplingParams(max_tokens=8))
    extra = {r: torch.randint(0, vocab, (decode_steps,), generator=g).tolist() for r in (a, b)}
    for r in (a, b):
        r.pages = runner.kv.pool.allocate(runner.kv.pages_for(r.num_tokens + decode_steps))
    got = {a: [_logits(runner, runner.prefill_batch([(a, 5)]), 5)], b: []}
    a.num_computed = 5
    both = _logits(runner, runner.prefill_batch([(a, 8), (b, 7)]), 15)
    got[a].append(both[:8])
    got[b].append(both[8:])
    a.num_computed, b.num_computed = 13, 7
    for step in range(decode_steps):
        for r in (a, b):
            r.output_ids.append(extra[r][step])
        logits = _logits(runner, runner.decode_batch([a, b]), 2)
        for i, r in enumerate((a, b)):
            got[r].append(logits[i:i + 1])
            r.num_computed += 1
    for r in (a, b):
        ours = torch.cat(got[r])
        with torch.no_grad():
            ref = hf(torch.tensor([r.tokens])).logits[0].float()
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err < 1e-4, f"{name}: max abs logit difference {err}"
        assert ref.std() > 1e-3
