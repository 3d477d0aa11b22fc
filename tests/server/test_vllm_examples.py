"""vLLM's documented request examples, replayed unchanged against the server: the OpenAI-compatible
server's quickstart (completions and chat through the openai client and curl's JSON), its extra
parameters, /tokenize and /detokenize, /version and /ping, and the reasoning outputs page (on a
tiny Qwen3-style checkpoint whose answers are scripted). Like vLLM's example scripts, the model's
name is read from /v1/models."""

import httpx
import pytest

from tests.support.scripted import scripted_answers
from tests.server.conftest import openai_client, serve_engine
from tests.server.test_reasoning import make_qwen3_style_checkpoint

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_quickstart_completion(client, model):
    completion = client.completions.create(model=model, prompt="San Francisco is a")
    assert completion.choices[0].text and completion.usage.completion_tokens == 16  # OpenAI's max_tokens


def test_quickstart_completion_with_curls_body(server, model):
    body = {"model": model, "prompt": "San Francisco is a", "max_tokens": 7, "temperature": 0}
    out = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers()).json()
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] <= 7


def test_quickstart_chat(client, model):
    chat_response = client.chat.completions.create(
        model=model, max_tokens=16,
        messages=[{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Tell me a joke."}])
    assert chat_response.choices[0].message.role == "assistant" and chat_response.choices[0].message.content


def test_extra_parameters_through_extra_body(client, model):
    completion = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}],
        extra_body={"structured_outputs": {"choice": ["positive", "negative"]}})
    assert completion.choices[0].message.content in ("positive", "negative")
    completion = client.completions.create(
        model=model, prompt="It is a truth universally acknowledged", max_tokens=8,
        extra_body={"top_k": 50, "min_tokens": 8, "ignore_eos": False, "skip_special_tokens": True,
                    "include_stop_str_in_output": False, "repetition_penalty": 1.1})
    assert completion.usage.completion_tokens == 8


def test_tokenize_and_detokenize(server, model):
    post = lambda path, body: httpx.post(server.url + path, json=body, headers=server.headers()).json()  # noqa: E731
    tokenized = post("/tokenize", {"model": model, "prompt": "Hello, my name is"})
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 256
    assert post("/detokenize", {"model": model, "tokens": tokenized["tokens"]})["prompt"] == "Hello, my name is"
    chat = post("/tokenize", {"model": model, "messages": [{"role": "user", "content": "Hello"}],
                              "add_generation_prompt": True, "return_token_strs": True})
    assert chat["count"] > tokenized["count"] - 3 and len(chat["token_strs"]) == chat["count"]


def test_version_and_ping(server):
    from moeferry import __version__

    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200


def test_stored_responses_can_be_listed_and_deleted(client, model):
    response = client.responses.create(model=model, input="Tell me of Elizabeth.", max_output_tokens=4)
    items = client.responses.input_items.list(response.id)
    assert [item.type for item in items.data] == ["message"]
    assert items.data[0].content[0].text == "Tell me of Elizabeth."
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


# ---- reasoning outputs ----------------------------------------------------------------------------
QUESTION = "9.11 and 9.8, which is greater?"
ANSWER = "<think>Compare the tenths: 8 is more than 1.</think>\n\n9.8 is greater."


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    path = make_qwen3_style_checkpoint(str(tmp_path_factory.mktemp("qwen3-think")))
    engine = Engine(EngineConfig(model=path, dtype="float32", device="cpu", max_model_len=256))
    with scripted_answers(engine, lambda prompt: ANSWER if QUESTION in prompt else None), \
            serve_engine(engine) as running:
        yield openai_client(running)


def test_reasoning_outputs(thinking):
    model = thinking.models.list().data[0].id
    messages = [{"role": "user", "content": QUESTION}]
    response = thinking.chat.completions.create(model=model, messages=messages, max_tokens=60)
    reasoning_content = response.choices[0].message.reasoning_content
    content = response.choices[0].message.content
    assert reasoning_content == "Compare the tenths: 8 is more than 1." and content == "9.8 is greater."


def test_reasoning_outputs_streamed(thinking):
    model = thinking.models.list().data[0].id
    stream = thinking.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                              max_tokens=60, stream=True)
    reasoning, content = "", ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if hasattr(delta, "reasoning_content") and delta.reasoning_content:
            reasoning += delta.reasoning_content
        elif delta.content:
            content += delta.content
    assert reasoning == "Compare the tenths: 8 is more than 1." and content == "9.8 is greater."


def test_thinking_switched_off_through_chat_template_kwargs(thinking):
    model = thinking.models.list().data[0].id
    response = thinking.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert getattr(response.choices[0].message, "reasoning_content", None) is None
    assert response.usage.prompt_tokens > 0
