"""A request fails alone: what its own values can still break inside an engine step fails that
request, and the requests running beside it finish with the tokens they get without it."""

import pytest

from moeferry import LLM, SamplingParams

PROMPTS = [[5 + i, 17, 33 + i, 2, 9, 71, 40 + i] for i in range(3)]


@pytest.fixture(scope="module")
def llm(model_cache):
    return LLM(dtype="float32", device="cpu", max_running_requests=8, max_model_len=32)


def poisoned(params: SamplingParams) -> SamplingParams:
    """Params that passed validation, then changed behind its back to a value the sampler
    cannot take (1/T overflows to inf: the probabilities become NaN and sampling raises)."""
    params.temperature = 1e-40
    return params


def others(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.8, top_k=20, seed=7 + i, max_tokens=8, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_a_poisoned_request_fails_alone(llm):
    alone = [llm.generate(p, others(i))[0].token_ids for i, p in enumerate(PROMPTS)]
    bad = poisoned(SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
    outs = llm.generate(PROMPTS[:2] + [[3, 4, 5]] + PROMPTS[2:], [others(0), others(1), bad, others(2)])
    assert outs[2].finish_reason == "error" and outs[2].token_ids == []
    assert [o.token_ids for o in outs[:2] + outs[3:]] == alone
    assert all(o.finish_reason == "length" for o in outs[:2] + outs[3:])
    stats = llm.engine.stats()
    assert stats["kv"]["pages_used"] == 0 and stats["requests"]["running"] == 0
    assert stats["requests"]["failed"] >= 1


def test_a_failing_detokeniser_fails_only_its_request(llm, monkeypatch):
    engine = llm.engine
    real_add = engine.add_request

    def add(prompt, params):
        req = real_add(prompt, params)
        if prompt == [3, 4, 5]:
            engine._detok[req.rid].push = lambda token: 1 / 0
        return req

    monkeypatch.setattr(engine, "add_request", add)
    alone = llm.generate(PROMPTS[0], others(0))[0].token_ids
    outs = llm.generate([PROMPTS[0], [3, 4, 5]], [others(0), others(0)])
    assert outs[1].finish_reason == "error"
    assert outs[0].token_ids == alone and outs[0].finish_reason == "length"
    assert engine.stats()["kv"]["pages_used"] == 0


@pytest.mark.parametrize("fields", [dict(temperature=1e-40), dict(temperature=1e-38), dict(top_p=1e-46),
                                    dict(temperature=1e-38, top_p=1e-46)])
def test_extreme_temperature_and_top_p_give_the_top_token(llm, fields):
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True, seed=3, **fields))[0]
    assert out.finish_reason == "length" and out.token_ids == greedy.token_ids


def test_stop_token_ids_stop_even_with_ignore_eos_and_their_text_is_held_out(llm):
    free = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    stop_at = free[3]
    first = free.index(stop_at)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                  stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:first + 1]
    before = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=first, ignore_eos=True))[0]
    assert llm.tokenizer.decode([stop_at]).strip()  # an ordinary token with text of its own
    assert out.text == before.text  # the ending token's text is not output


def test_a_refused_prompt_leaves_nothing_queued(llm):
    from moeferry.sampling import InvalidRequest

    with pytest.raises(InvalidRequest) as err:
        llm.generate([PROMPTS[0], [10**9]], SamplingParams(max_tokens=4))
    assert err.value.param == "prompt"
    assert not llm.engine.has_work
