"""More requests than KV pages on the real engine (built-in tiny model, CPU): every request
completes through preemption and recompute, with the tokens it gets when run alone."""

import pytest

from moeferry import LLM, SamplingParams

PROMPTS = [[5 + i, 17, 33 + i, 2, 9, 71, 40 + i] for i in range(6)]


@pytest.fixture(scope="module")
def tiny_kv_llm(model_cache):
    # 16 pages of 4 tokens: each request needs up to 7 + 20 = 27 tokens (7 pages), so two fit.
    return LLM(dtype="float32", device="cpu", num_tokens=64, page_size=4, max_running_requests=8,
               max_model_len=64)  # the CPU reference decode attention costs O(max_model_len) per token


def test_more_requests_than_kv_pages_complete_through_preemption(tiny_kv_llm):
    engine = tiny_kv_llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = [tiny_kv_llm.generate(p, params)[0] for p in PROMPTS]
    assert engine.scheduler.num_preemptions == 0

    together = tiny_kv_llm.generate(PROMPTS, params)

    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.text for o in together] == [o.text for o in alone]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 20 for o in together)
    stats = engine.stats()
    assert stats["kv"]["pages_used"] == 0 and stats["requests"]["running"] == 0
    assert stats["requests"]["preemptions"] == engine.scheduler.num_preemptions


def test_seeded_sampled_requests_keep_their_tokens_through_preemption(tiny_kv_llm):
    """A preempted request resumes its random stream where it was (seed and position) and its
    penalty counts from the tokens it had: the same tokens as alone."""
    engine = tiny_kv_llm.engine
    params = [SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.5, seed=40 + i, max_tokens=20,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    alone = [tiny_kv_llm.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    before = engine.scheduler.num_preemptions
    together = tiny_kv_llm.generate(PROMPTS, params)
    assert engine.scheduler.num_preemptions > before
    assert [o.token_ids for o in together] == alone
