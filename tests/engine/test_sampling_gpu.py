"""Sampling inside the decode CUDA graph (GPU): a batch of seeded requests with mixed sampling
parameters gives the same tokens replayed from graphs as run eagerly (the same kernels over the
same logits; a request alone may see other logits bits, as the model's GEMMs tile by batch)."""
import os

import pytest

from moeferry.config import EngineConfig
from moeferry.engine.engine import Engine
from moeferry.sampling import SamplingParams
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

pytestmark = pytest.mark.gpu


def params(i: int) -> SamplingParams:
    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.95, seed=10 + i, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=50, min_p=0.02, seed=20 + i, max_tokens=24, ignore_eos=True,
                           logprobs=5),
            SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                           logit_bias={7: 2.0}, seed=30 + i, max_tokens=24, ignore_eos=True)][i % 4]


def generate(engine, prompts, all_params):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, all_params)]
    while engine.has_work:
        engine.step()
    return [list(r.output_ids) for r in reqs]


def test_graphed_sampling_equals_eager(tmp_path):
    cfg = write_config_dir(os.path.join(tmp_path, "m"), QWEN3_30B_DIR_CONFIG)
    common = dict(model=cfg, load_format="dummy", hf_overrides={"num_hidden_layers": 4}, max_running_requests=8,
                  max_model_len=128, num_tokens=4096)
    prompts = [list(range(3 + i, 30 + 2 * i)) for i in range(8)]
    all_params = [params(i) for i in range(8)]
    graphed = Engine(EngineConfig(**common))
    assert graphed.runner.graphs is not None
    batch = generate(graphed, prompts, all_params)
    del graphed
    eager = generate(Engine(EngineConfig(disable_cuda_graph=True, **common)), prompts, all_params)
    assert batch == eager
    assert len({tuple(t) for t in batch}) == len(batch)
