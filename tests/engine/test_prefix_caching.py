"""Prefix caching on the real engine (built-in tiny model, CPU): a prompt that starts with a
cached prefix skips computing it and gets the output it gets on an engine without prefix
caching, also when requests sharing pages are preempted or aborted."""

import pytest

from moeferry import LLM, SamplingParams

# 16 pages of 4 tokens; prefill chunks of 8 tokens, so the two pages of STEM are one chunk
# whether computed or found: the forwards that follow see the same rows on both engines.
OPTIONS = dict(dtype="float32", device="cpu", num_tokens=64, page_size=4, max_prefill_tokens=8, max_running_requests=8,
               max_model_len=64)  # the CPU reference decode attention costs O(max_model_len) per token
STEM = [5, 17, 33, 2, 9, 71, 40, 11]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def cached(model_cache):
    return LLM(**OPTIONS)


@pytest.fixture(scope="module")
def plain(model_cache):
    return LLM(enable_prefix_caching=False, **OPTIONS)


def counted(llm, run):
    """run()'s result and how much the engine's counters moved during it."""
    before = dict(llm.engine.counters)
    result = run()
    return result, {k: v - before[k] for k, v in llm.engine.counters.items()}


def check_pool_at_rest(llm) -> None:
    pool = llm.engine.scheduler.pool
    assert all(pool.refcount(p) == 0 for p in range(pool.num_pages))
    assert pool.free_pages == pool.num_pages and llm.engine.stats()["kv"]["pages_used"] == 0


def test_a_prompt_sharing_a_cached_prefix_gets_the_tokens_and_logprobs_of_an_engine_without_it(cached, plain):
    first, counts = counted(cached, lambda: cached.generate(STEM + [12, 13, 14, 15, 16], GREEDY)[0])
    assert counts["prefix_cache_hit_tokens"] == 0 and counts["prefix_cache_queried_tokens"] == 13
    prompt = STEM + [18, 19, 20, 21, 22]
    second, counts = counted(cached, lambda: cached.generate(prompt, GREEDY)[0])
    assert counts["prefix_cache_queried_tokens"] == 13 and counts["prefix_cache_hit_tokens"] == 8
    assert counts["prefill_tokens"] == 5
    alone = plain.generate(prompt, GREEDY)[0]
    assert second.token_ids == alone.token_ids and second.token_ids != first.token_ids
    assert second.logprobs == alone.logprobs  # bit for bit: the KV read is the KV it would compute
    assert cached.engine.stats()["kv"]["pages_cached"] >= 2
    check_pool_at_rest(cached)


def test_a_follow_up_prompt_reuses_the_pages_decode_filled(cached, plain):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    first = cached.generate(prompt, GREEDY)[0]  # 19 tokens, 18 computed: 4 full pages, the last two by decode
    follow_up = prompt + first.token_ids + [7, 7, 7]
    second, counts = counted(cached, lambda: cached.generate(follow_up, GREEDY)[0])
    assert counts["prefix_cache_hit_tokens"] == 16 and counts["prefill_tokens"] == len(follow_up) - 16
    # decode wrote those pages one token per forward, prefill eight: equal tokens, not equal bits
    assert second.token_ids == plain.generate(follow_up, GREEDY)[0].token_ids


def test_requests_sharing_a_prefix_under_tight_kv_complete_through_preemption_with_their_tokens(cached, plain):
    prompts = [STEM + [30 + i, 50 + i, 70 + i] for i in range(6)]  # 11 + 12 tokens: 6 pages each
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [plain.generate(p, params)[0].token_ids for p in prompts]
    preemptions = cached.engine.scheduler.num_preemptions
    together, counts = counted(cached, lambda: cached.generate(prompts, params))
    assert cached.engine.scheduler.num_preemptions > preemptions
    assert counts["prefix_cache_hit_tokens"] >= 8 * len(prompts)  # the stem at every admission, at least
    assert [o.token_ids for o in together] == alone
    check_pool_at_rest(cached)


def test_aborting_the_request_that_computed_a_shared_prefix_leaves_its_sharer_intact(cached, plain):
    engine, params = cached.engine, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    owner = engine.add_request(STEM + [41, 42, 43, 44, 45, 46], params)
    while not owner.output_ids:
        engine.step()
    sharer = engine.add_request(STEM + [61, 62, 63], params)
    engine.step()
    assert sharer.pages[:2] == owner.pages[:2]
    engine.abort(owner)
    assert [engine.scheduler.pool.refcount(p) for p in sharer.pages[:2]] == [1, 1]
    while not sharer.finished:
        engine.step()
    assert sharer.output_ids == plain.generate(STEM + [61, 62, 63], params)[0].token_ids
    check_pool_at_rest(cached)
    _, counts = counted(cached, lambda: cached.generate(STEM + [99], params))
    assert counts["prefix_cache_hit_tokens"] == 8  # the aborted request's pages stayed cached
