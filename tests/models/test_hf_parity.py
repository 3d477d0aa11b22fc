"""moeferry against HF transformers on tiny random checkpoints of every family (float32, CPU)."""

import pytest
import torch

from moeferry import LLM, SamplingParams
from tests.support.fixtures import family_configs, make_checkpoint

FAMILIES = family_configs()
PROMPTS = [[5, 17, 33, 2, 9, 71, 40], [88, 3], [12, 60, 61, 62, 7, 1, 90, 45, 23, 30, 31, 8, 19]]


@pytest.fixture(scope="module", params=FAMILIES, ids=[name for name, _ in FAMILIES])
def family(request, tmp_path_factory):
    name, config = request.param
    path = str(tmp_path_factory.mktemp(name))
    hf = make_checkpoint(config, path)
    llm = LLM(path, dtype="float32", device="cpu", max_running_requests=4)
    return name, hf, llm


def _all_logits(llm, prompts):
    """moeferry's logits at every position of a batch of prompts of different lengths, one prefill."""
    from moeferry.scheduler.request import Request

    eng = llm.engine
    reqs = [Request(p, SamplingParams(max_tokens=1)) for p in prompts]
    for r in reqs:
        r.pages = eng.runner.kv.pool.allocate(eng.runner.kv.pages_for(len(p := r.prompt_ids)))
    batch = eng.runner.prefill_batch([(r, r.num_tokens) for r in reqs])
    batch.logits_rows = torch.arange(batch.num_rows)
    logits = eng.runner.forward(batch)
    for r in reqs:
        eng.runner.kv.pool.release(r.pages)
    out, row = [], 0
    for p in prompts:
        out.append(logits[row:row + len(p)])
        row += len(p)
    return out


def assert_logits_match(llm, reference, prompts=PROMPTS, atol=1e-4):
    """moeferry's logits at every position of `prompts` (one mixed prefill) within `atol` of the
    `reference` model's (a transformers model, float32 on the CPU), whose logits are not flat."""
    for prompt, got in zip(prompts, _all_logits(llm, prompts)):
        with torch.no_grad():
            ref = reference(torch.tensor([prompt])).logits[0].float()
        assert ref.std() > 1e-3
        err = (got - ref).abs().max().item()
        assert err < atol, f"max abs logit difference {err}"


def test_logits_match_transformers(family):
    name, hf, llm = family
    ours = _all_logits(llm, PROMPTS)
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert got.shape == ref.shape
        err = (got - ref).abs().max().item()
        assert err < 1e-4, f"{name}: max abs logit difference {err}"
        assert ref.std() > 1e-3  # the check means something: logits are not flat


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_match_transformers_alone_and_batched(family):
    name, hf, llm = family
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [_hf_greedy(hf, p, 24) for p in PROMPTS]
    alone = llm.generate(PROMPTS[0], params)[0].token_ids
    assert alone == expected[0], f"{name}: batch 1"
    batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert batched == expected, f"{name}: mixed batch"
