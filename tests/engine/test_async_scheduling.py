"""Async scheduling (engine/engine.py): a decode step launched before the host reads the tokens
of the one in flight gives every request the tokens, text and finish reason it gets with every
step planned on the host, whatever ends, arrives or is aborted while a step is in flight."""

import pytest

from moeferry import LLM, SamplingParams
from moeferry.engine.runner import ModelRunner

PROMPTS = [[5 + i, 17, 33 + i, 2, 9, 71, 40 + i] for i in range(4)]


def engine_of(async_scheduling: bool, **options):
    return LLM(dtype="float32", device="cpu", max_running_requests=4, max_model_len=96,
               async_scheduling=async_scheduling, **options).engine


@pytest.fixture(scope="module")
def engines(model_cache):
    return {on: engine_of(on) for on in (False, True)}


@pytest.fixture
def launches(monkeypatch):
    """The decode steps launched ahead of their predecessor's tokens, and those planned."""
    counts = {"ahead": 0, "planned": 0}
    launch, decode = ModelRunner.launch_decode, ModelRunner.decode

    def counted_launch(self, reqs, after=None):
        counts["ahead"] += after is not None
        return launch(self, reqs, after)

    def counted_decode(self, reqs):
        counts["planned"] += 1
        return decode(self, reqs)

    monkeypatch.setattr(ModelRunner, "launch_decode", counted_launch)
    monkeypatch.setattr(ModelRunner, "decode", counted_decode)
    return counts


def finished(engine, reqs):
    while engine.has_work:
        engine.step()
    assert engine.stats()["kv"]["pages_used"] == 0
    return [(r.output_ids, r.text, r.finish_reason) for r in reqs]


def run(engine, params, prompts=PROMPTS):
    return finished(engine, [engine.add_request(p, sp) for p, sp in zip(prompts, params)])


def test_a_steady_decode_launches_each_step_ahead(engines, launches):
    """Requests of different lengths: the first decode step is launched with nothing in
    flight, every later one ahead, a request that reached max_tokens left out of the next."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 12, 17)]
    off = run(engines[False], params, PROMPTS[:3])
    assert launches == {"ahead": 0, "planned": 23}
    assert run(engines[True], params, PROMPTS[:3]) == off
    assert launches == {"ahead": 22, "planned": 23}
    assert [len(ids) for ids, _, _ in off] == [24, 12, 17]


def test_mixed_requests_get_the_same_tokens(engines):
    params = [SamplingParams(temperature=0, max_tokens=30, stop=["e"]),
              SamplingParams(temperature=0.9, top_k=30, seed=3, max_tokens=17, repetition_penalty=1.3),
              SamplingParams(temperature=0.7, seed=11, max_tokens=25, min_tokens=6, frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=9, logprobs=2)]
    off, on = run(engines[False], params), run(engines[True], params)
    assert on == off
    assert {reason for _, _, reason in on} >= {"length"}


def test_an_early_end_drops_the_step_computed_past_it(engines, launches):
    """Greedy requests ending on a stop string while a longer one goes on: the step launched
    past each end is computed and its token dropped."""
    stops = [SamplingParams(temperature=0, max_tokens=40, stop=[s]) for s in ("e", "th", "ly")]
    stops.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    off, on = run(engines[False], stops), run(engines[True], stops)
    assert on == off
    assert any(reason == "stop" for _, _, reason in on)
    assert launches["ahead"] > 0


def test_arrivals_and_aborts_while_a_step_is_in_flight(engines):
    """A request added mid-run and another aborted mid-run: the others' tokens are those they
    get with every step planned, and the aborted one ends aborted with a prefix of them."""
    outs = {}
    for on, engine in engines.items():
        greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        first, doomed = engine.add_request(PROMPTS[0], greedy), engine.add_request(PROMPTS[1], greedy)
        for _ in range(6):
            engine.step()
        late = engine.add_request(PROMPTS[2], SamplingParams(temperature=0.8, seed=5, max_tokens=12))
        for _ in range(4):
            engine.step()
        engine.abort(doomed)
        outs[on] = finished(engine, [first, late]), doomed.output_ids, doomed.finish_reason
    alone = run(engines[False], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)], PROMPTS[1:2])
    assert outs[True][0] == outs[False][0]
    assert outs[True][2] == "abort" and outs[True][1] == alone[0][0][:len(outs[True][1])]


def test_a_pool_short_of_pages_preempts_as_planned(model_cache, launches):
    """Six pages for four requests that want three each: steps that cannot reserve the next
    page read the step in flight and plan (and preempt); tokens stay the same."""
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4
    outs = {}
    for on in (False, True):
        engine = engine_of(on, num_tokens=96, page_size=16)
        outs[on] = run(engine, params)
        assert engine.scheduler.num_preemptions > 0
    assert outs[True] == outs[False]
    assert launches["ahead"] > 0


def test_off_plans_every_step(model_cache, launches):
    run(engine_of(False), [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)], PROMPTS[:1])
    assert launches["ahead"] == 0 and launches["planned"] == 11


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["gpu", "offload", "hybrid"])
def test_graphs_launched_ahead_give_the_tokens_of_planned_steps(tmp_path, strategy, launches):
    """On the GPU: each step's input ids copied on the device from the graph in flight, its
    tokens read through the second pinned buffer, batches shrinking as requests end."""
    import os

    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine
    from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

    cfg = write_config_dir(os.path.join(tmp_path, "m"), QWEN3_30B_DIR_CONFIG)
    prompts = [list(range(3 + i, 30 + 2 * i)) for i in range(6)]
    params = [SamplingParams(temperature=0.9 if i % 2 else 0, seed=i, max_tokens=10 + 5 * i, ignore_eos=True,
                             repetition_penalty=1.2 if i == 3 else 1.0) for i in range(6)]
    outs = {}
    for on in (False, True):
        options = dict(model=cfg, load_format="dummy", hf_overrides={"num_hidden_layers": 4}, max_running_requests=8,
                       max_model_len=128, num_tokens=4096, moe_strategy=strategy, async_scheduling=on)
        if strategy != "gpu":
            options["moe_cache_slots"] = 128 + 64  # one layer's 128 experts and 64 more: misses every step
        engine = Engine(EngineConfig(**options))
        assert engine.runner.graphs is not None
        outs[on] = finished(engine, [engine.add_request(p, sp) for p, sp in zip(prompts, params)])
        del engine
    assert outs[True] == outs[False]
    assert launches["ahead"] >= 30  # of the 34 decode steps, all but the first (a length end plans nothing)
