"""Prompt log-probs (SamplingParams.prompt_logprobs, vLLM's) against HF transformers on a tiny
random checkpoint (float32, CPU): every prompt token's log-prob, rank and top tokens are the
log-softmax of transformers' logits at the position before it, whether the prompt is prefilled
in several chunks, shares a cached prefix, or is recomputed after a preemption."""

import pytest
import torch

from moeferry import LLM, SamplingParams
from moeferry.engine.sampler import prompt_logprobs
from tests.support.fixtures import family_configs, make_checkpoint

# chunks of 4 tokens over pages of 4: a 13-token prompt is prefilled in four forwards
OPTIONS = dict(dtype="float32", device="cpu", max_prefill_tokens=4, page_size=4, num_tokens=128, max_model_len=64,
               max_running_requests=4)
PROMPT = [12, 60, 61, 62, 7, 1, 90, 45, 23, 30, 31, 8, 19]
TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    name, config = family_configs()[0]  # qwen3_moe, untied head
    path = str(tmp_path_factory.mktemp(name))
    return path, make_checkpoint(config, path)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], **OPTIONS)


def reference(hf, prompt) -> torch.Tensor:
    """transformers' log-probs [len(prompt), V]: row p is the distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_matches(hf, prompt, got, k=TOP, atol=1e-4):
    """`got` (RequestOutput.prompt_logprobs) holds, per position after the first, the prompt
    token's log-prob and rank and the k most likely tokens', as transformers computes them."""
    ref = reference(hf, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        row, token, entry = ref[p - 1], prompt[p], got[p]
        assert list(entry)[0] == token  # vLLM's order: the prompt token first
        assert abs(entry[token].logprob - row[token].item()) < atol, p
        assert entry[token].rank == int((row >= row[token]).sum())
        top = torch.topk(row, k)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[t].rank == rank and abs(entry[t].logprob - v) < atol, (p, rank)
        assert len(entry) == k + (token not in top.indices.tolist())
    assert ref.std() > 1e-3  # not flat: the comparison means something


def test_prompt_logprobs_over_several_prefill_chunks_match_transformers(llm, checkpoint):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP))[0]
    assert_matches(checkpoint[1], PROMPT, out.prompt_logprobs)
    zero = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert [None if e is None else list(e) for e in zero.prompt_logprobs] == [None] + [[t] for t in PROMPT[1:]]
    assert out.token_ids == zero.token_ids
    assert llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))[0].prompt_logprobs is None


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs_and_cached_for_others(llm, checkpoint):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    engine = llm.engine
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))  # its pages go into the prefix cache
    before = dict(engine.counters)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP))[0]
    moved = {k: v - before[k] for k, v in engine.counters.items()}
    assert moved["prefill_tokens"] == len(prompt) and moved["prefix_cache_hit_tokens"] == 0
    assert_matches(checkpoint[1], prompt, out.prompt_logprobs)
    before = dict(engine.counters)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    assert engine.counters["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 8  # still cached


def test_a_batch_mixing_prompt_logprobs_keeps_every_answer(llm, checkpoint):
    prompts = [PROMPT, [88, 3], [5, 17, 33, 2, 9, 71, 40]]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(prompts, greedy)]
    asked = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)
    mixed = llm.generate(prompts, [asked, greedy, asked])
    assert [o.token_ids for o in mixed] == alone
    assert mixed[1].prompt_logprobs is None
    assert_matches(checkpoint[1], prompts[0], mixed[0].prompt_logprobs)
    assert_matches(checkpoint[1], prompts[2], mixed[2].prompt_logprobs)
    one = llm.generate([7], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert one.prompt_logprobs == [None]  # no token precedes the first


def test_n_samples_compute_the_prompts_logprobs_once(llm, checkpoint):
    before = dict(llm.engine.counters)
    out = llm.generate(PROMPT, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=2, prompt_logprobs=TOP))[0]
    assert_matches(checkpoint[1], PROMPT, out.prompt_logprobs)
    assert llm.engine.counters["prefill_tokens"] - before["prefill_tokens"] < 2 * len(PROMPT)  # the second cached


def test_a_request_preempted_mid_prefill_gets_each_prompt_logprob_once(checkpoint):
    # 5 pages of 4 tokens: the first request takes 4 in two chunks and the second the last one
    # for its first 3 tokens; when the first decodes its 17th token it needs that page, so the
    # second is preempted part-way through its prefill and computed again from its start
    small = LLM(checkpoint[0], **{**OPTIONS, "num_tokens": 20, "max_model_len": 20, "max_prefill_tokens": 8})
    assert small.engine.scheduler.pool.num_pages == 5
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=TOP)
    other = PROMPT[::-1]
    outs = small.generate([PROMPT, other], params)
    assert small.engine.scheduler.num_preemptions > 0
    assert_matches(checkpoint[1], PROMPT, outs[0].prompt_logprobs)
    assert_matches(checkpoint[1], other, outs[1].prompt_logprobs)


def test_prompt_logprobs_in_slices_equal_them_at_once():
    torch.manual_seed(0)
    vocab, hidden = 50, torch.randn(7, 16)
    head = torch.nn.Linear(16, vocab, bias=False)
    targets = torch.randint(0, vocab, (7,)).tolist()
    ref = torch.log_softmax(head(hidden).detach(), dim=-1)
    for max_bytes in (1, 4 * vocab * 2, 4 * vocab * 3, 1 << 20):  # one, two, three rows a slice; all at once
        got = prompt_logprobs(hidden, head, targets, 4, vocab, max_bytes=max_bytes)
        assert [e.token for e in got] == targets
        assert [e.logprob for e in got] == pytest.approx(ref[torch.arange(7), targets].tolist(), abs=1e-6)
        assert [e.rank for e in got] == [int((r >= r[t]).sum()) for r, t in zip(ref, targets)]
        assert [[i for i, _ in e.top] for e in got] == torch.topk(ref, 4).indices.tolist()
