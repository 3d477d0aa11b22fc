"""EngineConfig.check: every option's type, choice and range, the options together, and the fit
to the model, checked once before anything heavy is built; `LLM(...)` keywords go through the
same check as the CLI's flags."""

import pytest

from moeferry import LLM
from moeferry.config import CHOICES, RANGES, ConfigError, EngineConfig


def test_choices_are_the_registries_lists():
    from moeferry.kernels.admission import POLICIES
    from moeferry.moe.strategies import strategy_names

    assert CHOICES["moe_cache_policy"]() == tuple(POLICIES)
    assert CHOICES["moe_strategy"]() == strategy_names()


@pytest.mark.parametrize("name", sorted(RANGES))
def test_every_numeric_option_is_range_checked(name):
    bound = RANGES[name]
    below = bound.low if bound.low_open else bound.low - 1
    with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be"):
        EngineConfig(**{name: below, **_reader_of(name)}).check()


def _reader_of(name: str) -> dict:
    """The strategy and policy under which `name` is read (so only its range can fail)."""
    if name.startswith("moe_cache") or name == "moe_lrfu_decay":
        return {"moe_strategy": "offload", "moe_cache_policy": "lrfu"}
    return {}


@pytest.mark.parametrize("options,says", [
    (dict(max_running_requests="8"), "--max-running-requests must be an integer"),
    (dict(max_running_requests=True), "--max-running-requests must be an integer"),
    (dict(memory_ratio=float("inf")), "--memory-ratio must be in"),
    (dict(hf_overrides=[1]), "--hf-overrides must be a JSON object"),
    (dict(moe_strategy="gpu2"), "--moe-strategy 'gpu2' is unknown; choose one of: gpu, offload, uva"),
    (dict(moe_strategy="offload", moe_cache_policy="mru"), "--moe-cache-policy 'mru' is unknown"),
    (dict(dtype="int8"), "--dtype 'int8' is unknown"),
    (dict(quantization="int3"), "--quantization 'int3' is unknown; choose one of: fp8, int4, mxfp4"),
    (dict(moe_cache_gb=4.0), "read only by --moe-strategy offload or hybrid; under --moe-strategy gpu it would be ignored"),
    (dict(moe_strategy="uva", moe_cache_slots=8), "read only by --moe-strategy offload or hybrid; under --moe-strategy uva"),
    (dict(num_tokens=8), "less than one KV page"),
    (dict(moe_timeline=True), "--moe-timeline is read only by --moe-strategy hybrid"),
    (dict(moe_strategy="offload", moe_host_schedule="static"), "--moe-host-schedule is read only by --moe-strategy hybrid or cpu"),
    (dict(moe_strategy="hybrid", moe_host_staging="copy"), "--moe-host-dispatch mailbox stages by kernel only"),
    (dict(moe_strategy="offload", moe_host_activations="bf16"), "--moe-host-activations is read only by --moe-strategy hybrid or cpu"),
    (dict(moe_strategy="cpu", moe_host_activations="int4"), "--moe-host-activations 'int4' is unknown; choose one of: bf16, int8"),
    (dict(moe_strategy="uva", moe_uva_block_assignment="grouped"), "--moe-uva-block-assignment 'grouped' is unknown"),
])
def test_llm_keywords_are_checked_before_anything_loads(options, says, monkeypatch):
    import moeferry.default_model

    monkeypatch.setattr(moeferry.default_model, "ensure_default_model", lambda: pytest.fail("a model was made"))
    with pytest.raises(ConfigError, match=says):
        LLM(device="cpu", **options)


def test_the_context_is_capped_at_the_models_and_said_so(model_cache, caplog):
    with caplog.at_level("WARNING"):
        llm = LLM(device="cpu", dtype="float32", max_model_len=100_000, num_tokens=4096)
    assert llm.engine.ec.max_model_len == 2048 and llm.engine.runner.max_model_len == 2048
    assert "--max-model-len 100000 exceeds the model's max_position_embeddings 2048" in caplog.text


def test_a_cache_under_one_layer_is_refused_before_loading(model_cache, monkeypatch):
    import moeferry.engine.engine

    monkeypatch.setattr(moeferry.engine.engine, "ModelRunner", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match="fewer than one layer's 32 experts"):
        LLM(device="cpu", moe_strategy="offload", moe_cache_slots=3)
