"""The engine's sampling on the device sampler (kernels/sampling; its reference on the CPU): a
seeded request gives the same tokens alone and in a mixed batch, greedy rows are untouched by
sampled neighbours, preemption keeps a seeded request's tokens, log-probs come back for the
requests that ask, logit_bias and penalties act, and sampler slots are given back."""

import math

import pytest

from moeferry import LLM, SamplingParams

PROMPTS = [[5 + i, 17, 33 + i, 2, 9, 71, 40 + i] for i in range(8)]


@pytest.fixture(scope="module")
def llm(model_cache):
    return LLM(dtype="float32", device="cpu", max_running_requests=8, max_model_len=48)


def sampled(seed, **fields):
    return SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=10, ignore_eos=True, **fields)


def mixed(i):
    """Row i of a batch that mixes greedy rows with rows of different sampling parameters."""
    return [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), sampled(100 + i),
            SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=200 + i, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=1.2, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3,
                           seed=300 + i, max_tokens=10, ignore_eos=True)][i % 4]


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch_of_8(llm):
    alone = [llm.generate(p, mixed(i))[0].token_ids for i, p in enumerate(PROMPTS)]
    together = llm.generate(PROMPTS, [mixed(i) for i in range(len(PROMPTS))])
    assert [o.token_ids for o in together] == alone
    assert len({tuple(t) for t in alone}) == len(alone)  # the rows are not all one answer


def test_seeds_choose_the_tokens(llm):
    outs = [llm.generate(PROMPTS[0], sampled(seed))[0].token_ids for seed in (1, 1, 2, 3)]
    assert outs[0] == outs[1]
    assert len({tuple(t) for t in outs}) == 3


def test_greedy_rows_are_the_argmax_whatever_samples_beside_them(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], greedy)[0].token_ids
    together = llm.generate([PROMPTS[1]] + PROMPTS[2:6], [greedy] + [sampled(i) for i in range(4)])
    assert together[0].token_ids == alone


def test_logit_bias_forces_a_token(llm):
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                  logit_bias={77: 100.0}))[0]
    assert out.token_ids == [77] * 6


def test_penalties_change_what_is_drawn(llm):
    free = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    penalised = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                        presence_penalty=2.0, frequency_penalty=2.0))[0].token_ids
    assert len(set(free)) < len(free)  # the tiny model repeats itself when greedy...
    assert len(set(penalised)) > len(set(free))  # ...and the penalties push it to new tokens


def test_log_probs_come_back_for_the_requests_that_ask(llm):
    outs = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3),
                                      SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)])
    asked, not_asked = outs
    assert not_asked.logprobs == []
    assert len(asked.logprobs) == 5
    for token, lp in zip(asked.token_ids, asked.logprobs):
        ids = [i for i, _ in lp.top]
        values = [v for _, v in lp.top]
        assert len(lp.top) == 3 and values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert ids[0] == token and math.isclose(lp.logprob, values[0], abs_tol=1e-5)  # greedy: the top token


def test_sampled_log_probs_are_those_of_the_drawn_token(llm):
    out = llm.generate(PROMPTS[4], sampled(9, logprobs=20))[0]
    for token, lp in zip(out.token_ids, out.logprobs):
        top = dict(lp.top)
        if token in top:
            assert math.isclose(top[token], lp.logprob, abs_tol=1e-5)
        else:
            assert lp.logprob <= min(top.values()) + 1e-5


def test_slots_go_back_when_requests_end(llm):
    sampler = llm.engine.runner.sampler
    free_before = len(sampler._free)
    llm.generate(PROMPTS, [mixed(i) for i in range(len(PROMPTS))])
    assert len(sampler._free) == free_before == sampler.state.num_slots
    assert not sampler._slot_of


def test_n_above_one_gives_n_samples_of_each_prompt_seeded_as_the_servers_choices(llm):
    from moeferry.sampling import choice_params

    params = sampled(7, n=3)
    outs = llm.generate(PROMPTS[:2], params)
    assert len(outs) == 2 and all(len(o.outputs) == 3 for o in outs)
    assert [c.index for c in outs[0].outputs] == [0, 1, 2] and outs[0].token_ids == outs[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) == 3  # the samples are not one answer
    for choice in range(3):
        alone = llm.generate(PROMPTS[1], choice_params(sampled(7), choice))[0].token_ids
        assert outs[1].outputs[choice].token_ids == alone
