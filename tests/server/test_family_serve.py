"""`moeferry serve` of a tiny checkpoint of each family with its own attention or experts
(DeepSeek-V3's MLA and absorbed decode; gpt-oss's sinks, windows and biased experts): the
OpenAI API answers chat and a streamed completion from them as from any other model (the
server is model-agnostic; this checks the whole path: start-up, plan, prefill and decode)."""

import json

import httpx
import pytest

from tests.server.conftest import running_server
from tests.support.fixtures import deepseek_configs, gpt_oss_configs, make_checkpoint_with_builtin_tokenizer

FAMILIES = {"deepseek_v3": deepseek_configs, "gpt_oss": gpt_oss_configs}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tiny_checkpoint_serves_chat_and_streamed_completions(tmp_path, family):
    model = str(tmp_path / "m")
    make_checkpoint_with_builtin_tokenizer(dict(FAMILIES[family]())[family], model)
    with running_server(model=model, max_running_requests=4, max_model_len=128) as server:
        with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as http:
            chat = http.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
                "temperature": 0, "ignore_eos": True}).json()
            assert chat["usage"]["completion_tokens"] == 5, chat
            assert chat["choices"][0]["finish_reason"] == "length"
            with http.stream("POST", "/v1/completions", json={
                    "model": "m", "prompt": "Once upon", "max_tokens": 4, "temperature": 0, "stream": True,
                    "ignore_eos": True}) as response:
                assert response.status_code == 200
                events = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert server.engine.mc.model_type == family
