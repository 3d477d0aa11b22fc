"""The next-layer predictor (routing/predict.py): on the built-in trained model, layer l+1's
router on the stream entering layer l+1 recalls at least 0.75 of its true top-k on held-out
text; the predictor is its router's own ranking, and forced-route hooks do not touch it."""

import pytest
import torch

from benchmarks.bench_predictor import held_out_prompts
from moeferry import LLM
from moeferry.routing.forced import ForcedRouting
from moeferry.routing.predict import INPUTS, predict_experts, probe_prefills, routed_ids
from moeferry.routing.profiles import get_profile
from tests.support.fixtures import family_configs, make_checkpoint

RECALL_BOUND = 0.75  # measured 0.81 at 2,048 tokens (benchmarks/bench_predictor.py)


@pytest.fixture(scope="module")
def builtin_probe():
    from moeferry.default_model import DEFAULT_MODEL_NAME

    llm = LLM(DEFAULT_MODEL_NAME, device="cpu", dtype="float32", max_prefill_tokens=512)
    probe, tokens = probe_prefills(llm, held_out_prompts(llm.tokenizer, 6, 96))
    return llm, probe, tokens


def test_the_built_in_models_next_layer_recall_is_at_least_its_bound(builtin_probe):
    llm, probe, tokens = builtin_probe
    k = llm.engine.mc.top_k
    best = max(INPUTS, key=lambda name: probe.counts[name, k].recall)
    assert probe.counts[best, k].recall >= RECALL_BOUND, {n: probe.counts[n, k].recall for n in INPUTS}
    assert probe.counts["residual", k].recall > probe.counts["moe_input", k].recall
    c = probe.counts[best, k]
    assert c.routed == tokens * len(probe.pairs) * k and c.predicted == c.routed  # every pair of every token


def test_predicting_twice_the_experts_recalls_more_and_wastes_more(builtin_probe):
    llm, probe, _ = builtin_probe
    k = llm.engine.mc.top_k
    for name in INPUTS:
        one, two = probe.counts[name, k], probe.counts[name, 2 * k]
        assert two.recall > one.recall and two.wasted > one.wasted
        assert one.wasted == one.predicted - one.hits


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_predictor_on_a_layers_own_input_is_its_route_and_ignores_router_hooks(family, tmp_path):
    make_checkpoint(dict(family_configs())[family], str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    mc, model = llm.engine.mc, llm.engine.runner.model
    block = model.moe_block(mc.moe_layer_ids[-1])
    hidden = torch.randn(64, mc.hidden_size, generator=torch.Generator().manual_seed(0))
    forced = ForcedRouting.install(llm.engine, get_profile("uniform"))
    counter = forced.generator.counter.clone()
    ids = predict_experts(block.route_module, hidden, mc.top_k)
    assert torch.equal(forced.generator.counter, counter)  # no hook fired
    forced.remove()
    own = block.route_module(hidden)[1] if family == "deepseek_v3" else None
    want = routed_ids(block, hidden)
    assert ids.shape == (64, mc.top_k)
    if family == "qwen3_moe":  # a softmax gate: the prediction is exactly its top-k
        assert torch.equal(ids.sort(dim=1).values, want.sort(dim=1).values)
    else:  # grouped routing limits the choice to groups: the prediction may differ, but mostly agrees
        assert torch.equal(want, own.long())
        hit = (ids[:, :, None] == want[:, None, :]).any(dim=2).float().mean()
        assert hit >= 0.5


def test_a_fitted_predictor_recovers_a_linear_scoring_exactly():
    """Scores that are a linear function of the input (plus a bias) are fitted to their ranking."""
    from moeferry.moe.predictors import FittedPredictors

    gen = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(24, 10, generator=gen), torch.randn(10, generator=gen)
    pairs = []
    for _ in range(4):
        x = torch.randn(50, 24, generator=gen)
        pairs.append((x, x @ weight + bias))
    fitted = FittedPredictors.fit({7: pairs}, ridge=1e-9)
    x = torch.randn(30, 24, generator=gen)
    assert torch.equal(fitted.predict(7, x, 3), (x @ weight + bias).topk(3, dim=1).indices)


def test_a_fitted_mlp_learns_which_experts_a_scoring_ranks_first():
    """An MLP fitted on the top-k of a linear scoring recalls most of that top-k on new inputs (at
    least 0.8, where chance is 0.25), and the same seed fits the same predictor."""
    from moeferry.moe.predictors import FittedPredictors

    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(16, 8, generator=gen)
    pairs = [(x, x @ weight) for x in torch.randn(8, 100, 16, generator=gen)]
    fitted = FittedPredictors.fit_mlp({3: pairs}, top_k=2, hidden=32, steps=300)
    x = torch.randn(200, 16, generator=gen)
    pred, true = fitted.predict(3, x, 2), (x @ weight).topk(2, dim=1).indices
    assert (pred[:, :, None] == true[:, None, :]).any(dim=2).float().mean() >= 0.8  # chance: 0.25
    again = FittedPredictors.fit_mlp({3: pairs}, top_k=2, hidden=32, steps=300)
    assert torch.equal(again.predict(3, x, 2), pred)


def test_on_the_built_in_model_a_fitted_predictor_recalls_more_than_the_router_from_the_same_input():
    """Fitted on the held-out text's first part, measured on its last: from layer l's MoE input
    (the earliest), the fitted map beats layer l+1's own router (measured 0.77 against 0.64)."""
    from benchmarks.bench_predictor import FIT_PART, fitted_on, parse_args
    from moeferry.default_model import DEFAULT_MODEL_NAME

    llm = LLM(DEFAULT_MODEL_NAME, device="cpu", dtype="float32", max_prefill_tokens=512)
    fitted = fitted_on(llm, held_out_prompts(llm.tokenizer, 32, 96, FIT_PART), parse_args([]), hidden=0)
    probe, _ = probe_prefills(llm, held_out_prompts(llm.tokenizer, 6, 96, (FIT_PART[1], 1.0)), fitted)
    k = llm.engine.mc.top_k
    assert probe.counts["fitted", k].recall > probe.counts["moe_input", k].recall + 0.05
