"""The context served: --max-model-len, else the model's own max_position_embeddings; the
default is lowered to what the KV cache holds with one warning naming the flag, a given length
that does not fit is refused in one line, and a long default neither reserves its length per
request ahead of the expert cache nor widens the per-request page tables past the KV cache."""

import logging

import pytest

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError, EngineConfig
from moeferry.engine.planner import KV_PLAN_CONTEXT, KVShape, planned_context, wanted_kv_tokens

CPU = dict(device="cpu", dtype="float32")


def test_the_default_context_is_the_models_own_past_the_old_8192_cap(model_cache):
    llm = LLM(hf_overrides={"max_position_embeddings": 12_000}, num_tokens=12_000, **CPU)
    assert llm.engine.runner.max_model_len == 12_000 and llm.engine.scheduler.context_limit == 12_000


def test_a_default_context_longer_than_the_kv_cache_is_lowered_with_one_warning(model_cache, caplog):
    with caplog.at_level(logging.WARNING):
        llm = LLM(hf_overrides={"max_position_embeddings": 262_144}, num_tokens=4096, **CPU)
    runner = llm.engine.runner
    assert runner.max_model_len == 4096 and llm.engine.scheduler.context_limit == 4096
    assert runner.max_pages_per_req == 4096 // 16  # not 262,144 tokens' worth per request
    assert runner.model.model.rotary.cos.shape[0] == 4096  # nor rotary tables for positions never served
    lines = [r.getMessage() for r in caplog.records if "does not fit the KV cache" in r.getMessage()]
    assert len(lines) == 1 and "context of 262144 tokens" in lines[0] and "serving 4096" in lines[0]
    assert "--max-model-len" in lines[0]
    assert len(llm.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_a_given_context_that_does_not_fit_the_kv_cache_is_refused_in_one_line(model_cache):
    with pytest.raises(ConfigError) as caught:
        LLM(max_model_len=2048, num_tokens=1024, **CPU)
    message = str(caught.value)
    assert message.startswith("--max-model-len 2048: one request of that length does not fit the KV cache of 1024")
    assert "--num-tokens" in message and "\n" not in message


def test_a_long_default_context_plans_the_kv_cache_as_a_short_one_per_request():
    default, given = EngineConfig(max_running_requests=8), EngineConfig(max_running_requests=8, max_model_len=40_960)
    assert planned_context(default, 262_144) == KV_PLAN_CONTEXT and planned_context(default, 4096) == 4096
    assert wanted_kv_tokens(default, KVShape(1, planned_context(default, 262_144))) == 8 * KV_PLAN_CONTEXT
    assert wanted_kv_tokens(given, KVShape(1, planned_context(given, 262_144))) == 8 * 40_960
