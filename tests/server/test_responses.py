"""POST /v1/responses through the official `openai` client (client.responses.create, streamed
and not) on the built-in model: text input, message lists and instructions, function calls as
output items and their outputs sent back, previous_response_id continuation, the store's bound
and TTL, and the stream's events joining into the non-streamed response."""

import json

import openai
import pytest

from moeferry.server.protocol import APIError
from moeferry.server.responses import ResponseStore
from tests.server.conftest import openai_client, serve_engine
from tests.support.scripted import scripted_answers

ARGS = '{"city": "Paris"}'

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
MODEL = "moeferry-tiny-moe"


@pytest.fixture(scope="module")
def engine(long_context_engine):
    return long_context_engine


@pytest.fixture(scope="module")
def client(engine):
    with serve_engine(engine) as running:
        yield openai_client(running)


def recording(answer_text: str, prompts: list):
    """A script answering `answer_text` and keeping each prompt it saw."""
    def script(prompt):
        prompts.append(prompt)
        return answer_text
    return script


def test_text_input_answers_a_message(client):
    out = client.responses.create(model=MODEL, input="Hello", max_output_tokens=8, temperature=0)
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    assert out.status in ("completed", "incomplete")
    assert [item.type for item in out.output] == ["message"]
    assert out.output_text == out.output[0].content[0].text and out.output_text
    assert out.usage.output_tokens <= 8 and out.usage.input_tokens > 0
    if out.status == "incomplete":
        assert out.incomplete_details.reason == "max_output_tokens"


def test_instructions_and_message_input_render_as_the_chat_template(engine, client):
    prompts = []
    with scripted_answers(engine, recording("Fine.", prompts)):
        out = client.responses.create(model=MODEL, instructions="Be brief.",
                                      input=[{"role": "user", "content": "Hi"},
                                             {"role": "assistant",
                                              "content": [{"type": "output_text", "text": "Hello"}]},
                                             {"role": "user", "content": [{"type": "input_text", "text": "How?"}]}])
    reference = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "How?"}],
        add_generation_prompt=True, tokenize=False)
    assert prompts == [reference]
    assert out.output_text == "Fine." and out.status == "completed"


def test_a_stream_of_text_joins_into_the_response(engine, client):
    with scripted_answers(engine, lambda _p: "It is sunny in Paris."):
        whole = client.responses.create(model=MODEL, input="Weather?")
        events = list(client.responses.create(model=MODEL, input="Weather?", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types.index("response.output_item.added") < types.index("response.output_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == "It is sunny in Paris."
    done = events[-1].response
    assert done.output_text == text and done.status == "completed" and done.usage.output_tokens > 0
    assert [e.text for e in events if e.type == "response.output_text.done"] == [text]


def test_a_function_call_is_an_output_item_streamed_as_argument_deltas(engine, client):
    with scripted_answers(engine, lambda _p: f"Checking.\n{CALL}"):
        whole = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
        events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], stream=True))
    assert [item.type for item in whole.output] == ["message", "function_call"]
    call = whole.output[1]
    assert (call.name, call.arguments, call.status) == ("get_weather", ARGS, "completed")
    assert call.call_id.startswith("call_") and whole.output_text == "Checking."
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["message", "function_call"] and added[1].name == "get_weather"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == ARGS
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [ARGS]
    streamed = events[-1].response
    assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in streamed.output] == \
        [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in whole.output]


def test_previous_response_id_continues_the_conversation_with_the_call_output(engine, client):
    """The function_call_output sent with previous_response_id reaches the prompt after the
    stored turn: the agent loop of the Responses API."""
    prompts = []

    def script(prompt):
        prompts.append(prompt)
        if "<tool_response>" not in prompt:
            return CALL
        return "In Paris: " + prompt.split("<tool_response>\n")[-1].split("\n</tool_response>")[0]

    with scripted_answers(engine, script):
        first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                        instructions="Use tools.")
        call = first.output[0]
        assert call.type == "function_call"
        result = {"Paris": "sunny"}[json.loads(call.arguments)["city"]]
        second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                         input=[{"type": "function_call_output", "call_id": call.call_id,
                                                 "output": result}])
    assert second.output_text == "In Paris: sunny" and second.previous_response_id == first.id
    reference = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": call.call_id, "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        add_generation_prompt=True, tokenize=False)
    assert prompts[-1] == reference  # instructions are not carried over (OpenAI's rule)
    assert client.responses.retrieve(second.id).output_text == "In Paris: sunny"


def test_an_unknown_previous_response_is_a_404_naming_it(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, previous_response_id="resp_nope", input="Hi")
    assert caught.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=unstored.id, input="Hi")


def test_the_store_drops_the_oldest_past_its_size_and_any_past_its_ttl():
    clock = [0.0]
    store = ResponseStore(size=2, ttl_s=10.0, clock=lambda: clock[0])
    for name in ("a", "b", "c"):
        store.put({"id": name}, [])
    with pytest.raises(APIError) as caught:
        store.get("a", "previous_response_id")
    assert caught.value.status == 404 and caught.value.param == "previous_response_id"
    assert store.get("c", "previous_response_id")[0] == {"id": "c"}
    clock[0] = 10.5
    with pytest.raises(APIError):
        store.get("c", "previous_response_id")
    assert len(store.entries) == 1


def test_text_format_json_schema_takes_the_structured_output_path(client):
    """text.format is chat's response_format, held by the same grammar: the answer is the
    schema's JSON. The schema bounds its values (the tiny model's free strings and open objects
    never end by themselves)."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}}
    for seed_text in ("Hi", "Is it raining?"):
        out = client.responses.create(model=MODEL, input=seed_text, text=fmt, max_output_tokens=64)
        assert out.status == "completed"
        assert json.loads(out.output_text)["answer"] in ("yes", "no")


def test_bad_input_items_are_400s(client):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[{"type": "input_image", "image_url": "x"}])
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", tools=[WEATHER], tool_choice={"type": "function", "name": "g"})
    assert caught.value.body["param"] == "tool_choice"


def test_a_named_tool_choice_answers_its_call_and_is_echoed_in_the_responses_shape(engine, client):
    with scripted_answers(engine, lambda _p: ARGS):
        out = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                      tool_choice={"type": "function", "name": "get_weather"})
    assert [(i.type, i.name, i.arguments) for i in out.output] == [("function_call", "get_weather", ARGS)]
    assert (out.tool_choice.type, out.tool_choice.name) == ("function", "get_weather")
