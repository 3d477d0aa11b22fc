"""generation_config.json: its eos_token_id (an id or a list) stops every request, and its
temperature/top_p/top_k/min_p/repetition_penalty are the defaults of requests that leave them
unset, through LLM.generate, `moeferry generate` and the server; a value the request sets,
even the neutral one, always wins."""

import json
import shutil

import httpx
import pytest

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError
from moeferry.sampling import GenerationDefaults

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def builtin(model_cache):
    """The random built-in model: it has no generation_config.json of its own."""
    from moeferry.default_model import ensure_random_model

    return ensure_random_model()


def with_generation_config(builtin, tmp_path, config: dict) -> str:
    """A copy of the built-in checkpoint with this generation_config.json."""
    d = tmp_path / "m"
    shutil.copytree(builtin, d)
    (d / "generation_config.json").write_text(json.dumps(config))
    return str(d)


def engine_options(model: str) -> dict:
    return dict(model=model, device="cpu", dtype="float32", max_model_len=64, max_running_requests=4)


@pytest.fixture(scope="module")
def plain(builtin):
    return LLM(**engine_options(builtin))


@pytest.fixture(scope="module")
def greedy_ids(plain):
    return plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids


def test_an_unset_field_is_distinguishable_from_one_set_to_the_neutral_value():
    params = SamplingParams(top_p=1.0)
    assert params.temperature is None and params.top_p == 1.0
    resolved = params.with_defaults({"temperature": 0.0, "top_p": 0.5})
    assert resolved.temperature == 0.0 and resolved.top_p == 1.0
    assert SamplingParams().with_defaults().temperature == 1.0  # no model default: the OpenAI API's


def test_eos_token_ids_from_generation_config_stop_a_request(builtin, tmp_path, greedy_ids):
    k = next(i for i in range(1, len(greedy_ids)) if greedy_ids[i] not in greedy_ids[:i])
    for eos in (greedy_ids[k], [10**6, greedy_ids[k]]):  # an id, or a list (with one outside the vocabulary)
        llm = LLM(**engine_options(with_generation_config(builtin, tmp_path / str(type(eos)), {"eos_token_id": eos})))
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0]
        assert out.token_ids == greedy_ids[:k + 1] and out.finish_reason == "stop"


def test_the_models_temperature_is_the_default_and_a_requests_own_value_wins(builtin, tmp_path, plain, greedy_ids):
    llm = LLM(**engine_options(with_generation_config(builtin, tmp_path, {"temperature": 0.0, "top_k": 5})))
    unset = SamplingParams(seed=11, max_tokens=8, ignore_eos=True)
    assert llm.generate(PROMPT, unset)[0].token_ids == greedy_ids
    no_params = llm.generate(PROMPT)[0].token_ids
    assert no_params[:8] == greedy_ids[:len(no_params)]
    own = SamplingParams(temperature=1.0, top_k=-1, seed=11, max_tokens=8, ignore_eos=True)
    sampled = plain.generate(PROMPT, own)[0].token_ids
    assert sampled != greedy_ids
    assert llm.generate(PROMPT, own)[0].token_ids == sampled


def test_the_models_top_k_applies_to_a_request_that_sets_only_its_temperature(builtin, tmp_path, greedy_ids):
    llm = LLM(**engine_options(with_generation_config(builtin, tmp_path, {"top_k": 1})))
    assert llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True))[0].token_ids \
        == greedy_ids


@pytest.mark.parametrize("config,says", [
    ({"temperature": -1}, "temperature must be in [0.0, 100.0]"),
    ({"top_k": "many"}, "top_k must be an integer"),
    ({"eos_token_id": ["x"]}, "eos_token_id must be a token id or a list of them"),
])
def test_a_bad_generation_config_is_one_line_naming_the_file(tmp_path, config, says):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as caught:
        GenerationDefaults.from_dir(str(tmp_path))
    assert str(tmp_path / "generation_config.json") in str(caught.value) and says in str(caught.value)


def test_generate_takes_the_models_temperature_unless_the_flag_is_given(builtin, tmp_path, capsys):
    from moeferry.cli import main

    model = with_generation_config(builtin, tmp_path, {"temperature": 1.0})
    common = ["generate", "--model", model, "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
              "--prompt", PROMPT, "--max-tokens", "8", "--ignore-eos", "--sampling-seed", "11"]
    texts = []
    for flags in ([], ["--temperature", "0"]):
        assert main(common + flags) == 0
        texts.append(capsys.readouterr().out)
    main(["generate", "--model", builtin, *common[3:]])  # no generation_config.json: greedy
    assert texts[0] != texts[1] and capsys.readouterr().out == texts[1]


def test_the_server_takes_the_models_defaults_for_fields_a_request_leaves_out(builtin, tmp_path):
    from tests.server.conftest import running_server

    model = with_generation_config(builtin, tmp_path, {"temperature": 0.0})
    with running_server(model=model, max_model_len=64, max_running_requests=4) as server:
        def text(endpoint: str, **body) -> str:
            body = {"max_tokens": 8, "ignore_eos": True, **body}
            if endpoint == "chat":
                body["messages"] = [{"role": "user", "content": PROMPT}]
            else:
                body["prompt"] = PROMPT
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            choice = httpx.post(server.url + path, headers=server.headers(), timeout=60, json=body).json()["choices"][0]
            return choice["message"]["content"] if endpoint == "chat" else choice["text"]

        for endpoint in ("chat", "completions"):
            greedy = text(endpoint, temperature=0)
            assert text(endpoint, seed=11) == greedy
            assert text(endpoint, seed=11, temperature=None) == greedy
            assert text(endpoint, seed=11, temperature=1.0) != greedy
