"""Structured output on the GPU, in the decode CUDA graphs: constrained requests beside free
ones give the same tokens replayed from graphs (the split forward and sampler graphs of a step
with token masks, then the single graph again) as run eagerly, and every constrained output
validates; at Qwen3's 151,936-token vocabulary (a synthetic tokenizer)."""
import json
import os

import jsonschema
import pytest

from moeferry.config import EngineConfig
from moeferry.engine.engine import Engine
from moeferry.sampling import SamplingParams
from moeferry.structured import json_schema_constraint
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir, write_wide_tokenizer

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


def generate(engine, prompts, all_params):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, all_params)]
    while engine.has_work:
        engine.step()
    return reqs


def test_constrained_decode_in_graphs_equals_eager(tmp_path):
    cfg = write_wide_tokenizer(write_config_dir(os.path.join(tmp_path, "m"), QWEN3_30B_DIR_CONFIG), 151_936)
    common = dict(model=cfg, load_format="dummy", hf_overrides={"num_hidden_layers": 4}, max_running_requests=8,
                  max_model_len=160, num_tokens=4096)
    constraint = json_schema_constraint(SCHEMA)
    all_params = [SamplingParams(temperature=0, max_tokens=60, structured=constraint),
                  SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured=constraint),
                  SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                  SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)] * 2
    prompts = [list(range(3 + i, 30 + 2 * i)) for i in range(8)]
    graphed = Engine(EngineConfig(**common))
    assert graphed.runner.graphs is not None
    with_graphs = generate(graphed, prompts, all_params)
    assert graphed.runner.graphs.split  # the masked steps ran through the split graphs
    del graphed
    eager = generate(Engine(EngineConfig(disable_cuda_graph=True, **common)), prompts, all_params)
    assert [r.output_ids for r in with_graphs] == [r.output_ids for r in eager]
    for req in with_graphs:
        if req.params.structured is not None:
            assert req.finish_reason == "stop"
            jsonschema.validate(json.loads(req.text), SCHEMA)
