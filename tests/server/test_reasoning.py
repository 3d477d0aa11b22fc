"""Reasoning over the API: a tiny Qwen3-style checkpoint (its tokenizer has <think> and </think>,
its template honours enable_thinking) answers with reasoning_content apart from content, whole
and streamed as deltas, and reasoning items in /v1/responses; tool calls are read from the
answer after the reasoning. The answers are scripted (testing/scripted.py): a random tiny model
cannot be made to think."""

import json

import httpx
import pytest

from tests.support.fixtures import family_configs, make_checkpoint
from tests.support.scripted import scripted_answers
from tests.server.conftest import serve_engine

QWEN3_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
# A template whose generation prompt opens the reasoning itself (Qwen3-2507 thinking, DeepSeek-R1-0528).
OPENING_TEMPLATE = QWEN3_TEMPLATE.replace("{%- if enable_thinking", "{{ '<think>\\n' }}{%- if enable_thinking")

ANSWERS = {
    "greet me": "<think>The user wants a greeting.</think>\n\nHello there.",
    "be brief": "Brief.",
    "opened": "Thinking inside.</think>The answer.",
    "pick after thinking": "<think>Weighing it.</think>yes",
    "pick at once": "no",
    "json after thinking": '<think>Plan.</think>{"a": "x"}',
    "call f": '<think>f fits.</think>\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
}


def make_qwen3_style_checkpoint(path: str) -> str:
    """The built-in model's tokenizer with <think> and </think> added (not special: kept in the
    text, as Qwen3's are) and a Qwen3-style template, over a random tiny qwen3_moe model."""
    from transformers import AutoTokenizer

    from moeferry.default_model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(path)
    config = dict(family_configs())["qwen3_moe"]
    config = type(config)(**{**config.to_dict(), "vocab_size": len(tokenizer),
                             "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>")})
    make_checkpoint(config, path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    path = make_qwen3_style_checkpoint(str(tmp_path_factory.mktemp("qwen3-think")))
    engine = Engine(EngineConfig(model=path, dtype="float32", device="cpu", max_model_len=256))

    def answer_for(prompt: str):
        return next((a for key, a in ANSWERS.items() if key in prompt), None)

    with scripted_answers(engine, answer_for), serve_engine(engine) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as client:
        yield client


def chat(http, text, **fields):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 40, "temperature": 0, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def stream_chat(http, text, **fields):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 40, "temperature": 0, "stream": True,
            **fields}
    deltas = []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                deltas += [c["delta"] for c in json.loads(line[6:])["choices"]]
    return deltas


def test_the_served_model_reads_reasoning_with_the_qwen3_parser(server):
    assert server.app.state.model_info.reasoning_parser == "qwen3"


def test_reasoning_content_is_apart_from_the_answer(http):
    message = chat(http, "greet me")["message"]
    assert message["reasoning_content"] == "The user wants a greeting."
    assert message["content"] == "Hello there."


def test_reasoning_is_streamed_as_deltas_before_the_answer(http):
    deltas = stream_chat(http, "greet me")
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning == "The user wants a greeting." and content == "Hello there."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_content:])


def test_enable_thinking_false_reaches_the_template(http):
    on = http.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    off = http.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}],
                                       "chat_template_kwargs": {"enable_thinking": False}}).json()
    text = http.post("/detokenize", json={"tokens": off["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off["count"] > on["count"]
    message = chat(http, "be brief", chat_template_kwargs={"enable_thinking": False})["message"]
    assert message["content"] == "Brief." and "reasoning_content" not in message


def test_a_prompt_that_opens_the_reasoning_makes_the_answer_start_in_it(http):
    message = chat(http, "opened", chat_template=OPENING_TEMPLATE)["message"]
    assert message["reasoning_content"] == "Thinking inside." and message["content"] == "The answer."
    deltas = stream_chat(http, "opened", chat_template=OPENING_TEMPLATE)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Thinking inside."


def test_include_reasoning_false_leaves_the_reasoning_out(http):
    message = chat(http, "greet me", include_reasoning=False)["message"]
    assert message["content"] == "Hello there." and "reasoning_content" not in message


def test_tool_calls_are_read_from_the_answer_after_the_reasoning(http):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    choice = chat(http, "call f", tools=tools, max_tokens=150)
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "f fits."
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "f" and json.loads(call["arguments"]) == {"x": 1}


def test_responses_carry_a_reasoning_item_before_the_message(http):
    response = http.post("/v1/responses", json={"input": "greet me", "max_output_tokens": 40, "temperature": 0})
    assert response.status_code == 200, response.text
    output = response.json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"][0]["text"] == "The user wants a greeting."
    assert output[1]["content"][0]["text"] == "Hello there."


def test_the_openai_client_reads_reasoning_content(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key)
    reply = client.chat.completions.create(model=server.app.state.model_info.name, max_tokens=40, temperature=0,
                                           messages=[{"role": "user", "content": "greet me"}])
    assert reply.choices[0].message.content == "Hello there."
    assert reply.choices[0].message.model_extra["reasoning_content"] == "The user wants a greeting."


def test_structured_output_applies_to_the_answer_after_the_reasoning(http):
    choices = {"structured_outputs": {"choice": ["yes", "no"]}}
    message = chat(http, "pick after thinking", **choices)["message"]
    assert message["reasoning_content"] == "Weighing it." and message["content"] == "yes"
    assert chat(http, "pick at once", **choices)["message"]["content"] == "no"
    schema = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"], "additionalProperties": False}
    message = chat(http, "json after thinking", max_tokens=60,
                   response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})["message"]
    assert message["reasoning_content"] == "Plan." and json.loads(message["content"]) == {"a": "x"}


def test_the_gate_masks_nothing_while_reasoning_and_the_grammar_after():
    import torch

    from moeferry.structured import ReasoningGate, ReasoningTags

    class Grammar:
        xgrammar_matcher, fed = None, []

        def accept(self, token):
            self.fed.append(token)
            return True

        def fill(self, masks, row):
            masks[row] = 0

        finished = property(lambda self: len(self.fed) == 2)

    inner = Grammar()
    gate = ReasoningGate(inner, ReasoningTags(start=33, end=34))
    masks = torch.zeros((1, 2), dtype=torch.int32)
    gate.fill(masks, 0)
    assert gate.constrains and masks[0, 1].item() == 2  # undecided: the grammar's tokens and <think> (33)
    for token in (33, 5, 6, 34):
        assert gate.accept(token) and not gate.constrains or token == 34
    assert gate.constrains and inner.fed == [] and not gate.finished
    gate.accept(7), gate.accept(8)
    assert inner.fed == [7, 8] and gate.finished
