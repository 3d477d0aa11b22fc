"""`moeferry serve` of a tiny DeepSeek-V3 checkpoint: the OpenAI API answers chat and streamed
completions from an MLA model as from any other (the server is model-agnostic; this checks the
whole path: start-up, plan, prefill and absorbed decode behind the HTTP API)."""

import json
import os
import shutil

import httpx

from moeferry.testing.fixtures import deepseek_configs, make_checkpoint
from tests.server.conftest import running_server


def _tiny_deepseek_with_tokenizer(path: str) -> str:
    from moeferry.default_model import builtin_model_dir

    tokenizer_dir = builtin_model_dir("moeferry-tiny-moe")
    vocab = json.load(open(os.path.join(tokenizer_dir, "config.json")))["vocab_size"]
    config = dict(deepseek_configs())["deepseek_v3"]
    make_checkpoint(type(config)(**{**config.to_dict(), "vocab_size": vocab}), path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


def test_a_tiny_deepseek_checkpoint_serves_chat_and_streamed_completions(tmp_path):
    model = _tiny_deepseek_with_tokenizer(str(tmp_path / "ds"))
    with running_server(model=model, max_running_requests=4, max_model_len=128) as server:
        with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as http:
            chat = http.post("/v1/chat/completions", json={
                "model": "ds", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
                "temperature": 0, "ignore_eos": True}).json()
            assert chat["usage"]["completion_tokens"] == 5, chat
            assert chat["choices"][0]["finish_reason"] == "length"
            events = []
            with http.stream("POST", "/v1/completions", json={
                    "model": "ds", "prompt": "Once upon", "max_tokens": 4, "temperature": 0, "stream": True,
                    "ignore_eos": True}) as response:
                assert response.status_code == 200
                events = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert server.engine.mc.model_type == "deepseek_v3"
