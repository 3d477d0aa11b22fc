"""The layer timeline (moe/timeline.py): a hybrid decode with a timeline set stamps every
point of every MoE layer once per step, generates what it generates without one, and its
summary gives each point-to-point span in order; prefill stamps nothing."""
import pytest

from moeferry import LLM, SamplingParams
from moeferry.moe.timeline import HYBRID_POINTS, LayerTimeline
from tests.support.fixtures import family_configs, make_checkpoint

PROMPTS = [[5, 17, 33, 2, 9, 71, 40], [88, 3]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    name, config = family_configs()[0]
    path = str(tmp_path_factory.mktemp(name))
    make_checkpoint(config, path)
    return path, config.num_experts


def test_a_hybrid_decode_stamps_each_layer_once_a_step(ckpt):
    path, experts = ckpt
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    options = dict(dtype="float32", device="cpu", moe_strategy="hybrid", moe_cache_slots=experts, moe_host_share=0.5)
    want = [o.token_ids for o in LLM(path, **options).generate(PROMPTS, params)]
    llm = LLM(path, **options, moe_timeline=True)
    strategy = llm.engine.runner.strategy
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    summary = strategy.timeline.summary()
    assert summary["steps"] == 5  # 6 tokens: the first from the prefill, 5 decode steps
    spans = [f"{a} -> {b}" for a, b in zip(HYBRID_POINTS, HYBRID_POINTS[1:])]
    assert list(summary) == [*spans, "between layers", "layers", "steps"]
    assert all(summary[k] >= 0 for k in spans) and summary["layers"] >= sum(summary[k] for k in spans)
    rows = strategy.timeline.times[:5].view(5, len(strategy.moe_layer_of), len(HYBRID_POINTS))
    assert (rows > 0).all() and (rows.flatten(1).diff(dim=1) >= 0).all()  # every point once, in order
    assert (strategy.timeline.times[5:] == 0).all()


def test_an_empty_timeline_says_so():
    timeline = LayerTimeline(("a", "b"), 2, "cpu", rows=4)
    assert timeline.summary() == {"steps": 0}
