"""An agent loop against `moeferry serve` run as a process, through the official `openai`
client: the client offers a local Python function as a tool; the first request forces a call
(tool_choice "required" or the function's name: the grammar holds even the built-in tiny
model to a call whose arguments match the function's parameters); the client runs the
function on those arguments and sends its result back; the second request is answered in
text. Chat completions streamed and not (a streamed call is joined from its deltas, and the
joined call is the one the loop runs), and the Responses API (a function_call output item,
then a function_call_output input item after previous_response_id)."""

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import free_port, start_server

MODEL = "moeferry-tiny-moe"
API_KEY = "agent-key"
WEATHER = {"Paris": "sunny, 21 C", "Rome": "cloudy, 18 C", "Oslo": "snowing, -3 C"}
# The cities are an enum: the tiny model's free strings never end by themselves, and a real
# tool's schema often bounds its values so.
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "enum": list(WEATHER)}},
              "required": ["city"], "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                              "parameters": PARAMETERS}}
RESPONSES_TOOL = {"type": "function", **CHAT_TOOL["function"]}
QUESTION = "What is the weather in Paris?"


def get_weather(city: str) -> str:
    """The local function the model calls."""
    return f"{city}: {WEATHER[city]}"


LOCAL_FUNCTIONS = {"get_weather": get_weather}


@pytest.fixture(scope="module")
def client():
    """An openai client of `moeferry serve` (a process, with an API key); on teardown the
    process is stopped by SIGTERM and must exit 0 having logged no error."""
    port = free_port()
    proc = start_server(port, "--max-model-len", "512", "--max-running-requests", "2", "--log-interval", "0",
                        "--api-key", API_KEY)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "Traceback" not in output and "ERROR" not in output, output


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from moeferry.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(ensure_default_model(), local_files_only=True)


def prompt_length(tokenizer, messages: list[dict], tools: list[dict] | None) -> int:
    """The prompt tokens of a conversation in OpenAI's shape as transformers renders it (a
    call's arguments as a dict, an absent content as "")."""
    rendered = [json.loads(json.dumps(as_dict(m))) for m in messages]
    for message in rendered:
        message["content"] = message.get("content") or ""
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = tokenizer.apply_chat_template(rendered, tools=tools, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def run_calls(calls: list[dict]) -> list[dict]:
    """The tool messages answering `calls` (OpenAI's shape), each argument object checked
    against the function's parameters before the function runs on it."""
    results = []
    for call in calls:
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, PARAMETERS)
        result = LOCAL_FUNCTIONS[call["function"]["name"]](**arguments)
        results.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return results


def joined_message(stream) -> tuple[dict, str, object]:
    """A streamed chat answer as the assistant message a client joins from its deltas (tool
    calls by index: the first delta of a call carries its id, type and name, the others only
    argument text), its finish_reason and the usage chunk's usage."""
    content, calls, finish, usage = "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index == len(calls) and delta.type == "function" and delta.function.name
                calls.append({"id": delta.id, "type": "function",
                              "function": {"name": delta.function.name, "arguments": ""}})
            else:
                assert delta.index == len(calls) - 1 and delta.function.name is None
            calls[delta.index]["function"]["arguments"] += delta.function.arguments or ""
        if choice.finish_reason is not None:
            assert finish is None, "two finish_reasons"
            finish = choice.finish_reason
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    return message, finish, usage


def chat(client, stream: bool, **kwargs) -> tuple[object, str, object]:
    """(the assistant message, finish_reason, usage) of one chat request: the client's own
    message object when whole (an agent sends it back as it is), the joined dict when streamed."""
    if stream:
        return joined_message(client.chat.completions.create(**kwargs, stream=True,
                                                             stream_options={"include_usage": True}))
    out = client.chat.completions.create(**kwargs)
    (choice,) = out.choices
    return choice.message, choice.finish_reason, out.usage


def as_dict(message) -> dict:
    return message if isinstance(message, dict) else message.model_dump(exclude_none=True)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("stream,forcing,answering", [
    (False, "required", "none"), (False, NAMED, "auto"), (True, "required", "auto"), (True, NAMED, "none")],
    ids=["whole-required-then-none", "whole-named-then-auto", "streamed-required-then-auto",
         "streamed-named-then-none"])
def test_a_chat_agent_loop_runs_a_local_function_and_answers(client, tokenizer, stream, forcing, answering):
    messages = [{"role": "system", "content": "Answer with the tools you have."}, {"role": "user", "content": QUESTION}]
    forced = dict(model=MODEL, messages=list(messages), tools=[CHAT_TOOL], tool_choice=forcing,
                  parallel_tool_calls=False, seed=7, max_tokens=96)
    message, finish, usage = chat(client, stream, **forced)
    assert finish == "tool_calls"
    assert usage.prompt_tokens == prompt_length(tokenizer, messages, [CHAT_TOOL])
    (call,) = as_dict(message)["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"]
    assert not as_dict(message).get("content")
    if stream:  # the call joined from the deltas is the one the same request answers whole
        whole, _, _ = chat(client, False, **forced)
        assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == \
            [(call["function"]["name"], call["function"]["arguments"])]
    messages += [message, *run_calls([call])]

    answer, finish, usage = chat(client, stream, model=MODEL, messages=messages, tools=[CHAT_TOOL],
                                 tool_choice=answering, temperature=0, max_tokens=16)
    answer = as_dict(answer)
    assert finish in ("stop", "length")
    assert isinstance(answer["content"], str) and answer["content"].strip()
    assert "tool_calls" not in answer
    assert 0 < usage.completion_tokens <= 16
    # the call and the function's result are in the prompt the model answered (tool_choice
    # "none" renders the conversation without the tool list)
    rendered_tools = None if answering == "none" else [CHAT_TOOL]
    assert usage.prompt_tokens == prompt_length(tokenizer, messages, rendered_tools)


def streamed_response(stream) -> tuple[list[dict], object]:
    """A streamed response's output items as a client joins them from the events (a call's
    arguments from its argument deltas), and the final response."""
    items, final = {}, None
    for event in stream:
        if event.type == "response.output_item.added":
            items[event.output_index] = event.item.model_dump(exclude_none=True)
        elif event.type == "response.function_call_arguments.delta":
            items[event.output_index]["arguments"] += event.delta
        elif event.type == "response.function_call_arguments.done":
            assert event.arguments == items[event.output_index]["arguments"]
        elif event.type == "response.content_part.added":
            items[event.output_index]["content"].append(event.part.model_dump(exclude_none=True))
        elif event.type == "response.output_text.delta":
            items[event.output_index]["content"][event.content_index]["text"] += event.delta
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None, "the stream did not end with the response"
    return [items[i] for i in sorted(items)], final


def respond(client, stream: bool, **kwargs) -> tuple[list[dict], object]:
    """(the output items, the response) of one Responses request."""
    if stream:
        return streamed_response(client.responses.create(**kwargs, stream=True))
    out = client.responses.create(**kwargs)
    return [item.model_dump(exclude_none=True) for item in out.output], out


@pytest.mark.parametrize("stream,forcing,answering", [
    (False, {"type": "function", "name": "get_weather"}, "none"), (True, "required", "auto")],
    ids=["whole-named-then-none", "streamed-required-then-auto"])
def test_a_responses_agent_loop_sends_the_call_output_after_previous_response_id(client, tokenizer, stream, forcing,
                                                                                    answering):
    items, first = respond(client, stream, model=MODEL, input=QUESTION, tools=[RESPONSES_TOOL], tool_choice=forcing,
                           parallel_tool_calls=False, max_output_tokens=96, extra_body={"seed": 7})
    assert first.status == "completed"
    (call,) = items
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["call_id"]
    assert [(i.type, i.call_id, i.arguments) for i in first.output] == [("function_call", call["call_id"],
                                                                           call["arguments"])]
    (result,) = run_calls([{"id": call["call_id"], "function": {"name": call["name"], "arguments": call["arguments"]}}])

    items, second = respond(client, stream, model=MODEL, previous_response_id=first.id, tools=[RESPONSES_TOOL],
                            tool_choice=answering, temperature=0, max_output_tokens=16,
                            input=[{"type": "function_call_output", "call_id": call["call_id"],
                                    "output": result["content"]}])
    assert second.previous_response_id == first.id
    assert second.status in ("completed", "incomplete")
    assert [i["type"] for i in items] == ["message"] and [i.type for i in second.output] == ["message"]
    text = items[0]["content"][0]["text"]
    assert isinstance(text, str) and text.strip() and text == second.output_text
    assert 0 < second.usage.output_tokens <= 16
    # the stored turn (the question and the call) and the call's output are the prompt
    conversation = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call["call_id"], "type": "function",
                         "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                    {"role": "tool", "tool_call_id": call["call_id"], "content": result["content"]}]
    rendered_tools = None if answering == "none" else [CHAT_TOOL]
    assert second.usage.input_tokens == prompt_length(tokenizer, conversation, rendered_tools)
