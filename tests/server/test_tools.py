"""Tool calling through the official `openai` client against the server on the built-in model,
most answers scripted (tests.support.scripted: the tiny model writes no family's syntax of
its own): a round trip per family's parser, streamed tool-call deltas that
join into the non-streamed call, tool_choice none / required / named, tool messages in the
history rendered as transformers renders them, and an agent loop that runs a local function;
unscripted, the grammar makes the model itself call a named or required tool."""

import contextlib
import json

import pytest

from tests.server.conftest import openai_client, serve_engine
from tests.support.scripted import scripted_answers

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Weather in Paris?"}]
ARGS = '{"city": "Paris"}'
CALL_TEXT = {  # each family's way of writing the same two calls, and text before them
    "hermes": f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "mistral": f'Checking. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}, '
               '{"name": "get_time", "arguments": {}}]',
    "deepseek_v3": f"Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{ARGS}"
                   "\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "openai": "<|channel|>analysis<|message|>Two tools.<|end|><|start|>assistant<|channel|>commentary "
              f"to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|end|><|start|>assistant<|channel|>"
              "commentary to=functions.get_time <|constrain|>json<|message|>{}",
}
EXPECTED = [("get_weather", ARGS), ("get_time", "{}")]


@contextlib.contextmanager
def serving(engine, **server_options):
    """An openai client of `engine` served with `server_options`."""
    with serve_engine(engine, **server_options) as running:
        yield openai_client(running)


@pytest.fixture(scope="module")
def engine(long_context_engine):
    return long_context_engine


@pytest.fixture(scope="module")
def client(engine):
    with serving(engine) as client:
        yield client


def answer(text):
    """A script answering `text` to every prompt."""
    return lambda _prompt: text


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def joined_stream(stream) -> dict:
    """A chat stream's deltas joined as a client joins them (tool calls by index)."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index == len(calls) and tc.type == "function" and tc.function.name
                assert tc.id.startswith("call_") or len(tc.id) == 9
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "reasoning": reasoning, "calls": [tuple(calls[i]) for i in sorted(calls)],
            "finish": finish}


@pytest.mark.parametrize("parser", list(CALL_TEXT))
def test_a_tool_call_round_trip_per_family_parser(engine, parser):
    with serving(engine, tool_call_parser=parser) as client, scripted_answers(engine, answer(CALL_TEXT[parser])):
        kwargs = dict(model="moeferry-tiny-moe", messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0)
        whole = client.chat.completions.create(**kwargs)
        joined = joined_stream(client.chat.completions.create(**kwargs, stream=True))
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == EXPECTED
    assert all(c.type == "function" for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2
    for _, arguments in calls_of(choice.message):
        json.loads(arguments)
    if parser == "openai":
        assert choice.message.content is None and choice.message.reasoning_content == "Two tools."
    else:
        assert choice.message.content == "Checking."
    assert joined == {"content": choice.message.content or "", "calls": EXPECTED, "finish": "tool_calls",
                      "reasoning": getattr(choice.message, "reasoning_content", None) or ""}


def test_tool_choice_none_renders_no_tools_and_reads_no_calls(engine, client):
    plain = client.chat.completions.create(model="moeferry-tiny-moe", messages=ASK, max_tokens=1)
    with scripted_answers(engine, answer(CALL_TEXT["hermes"])):
        out = client.chat.completions.create(model="moeferry-tiny-moe", messages=ASK, tools=[WEATHER_TOOL],
                                             tool_choice="none")
    assert out.usage.prompt_tokens == plain.usage.prompt_tokens
    assert out.choices[0].message.content == CALL_TEXT["hermes"] and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_a_text_answer_with_tools_offered_is_content(engine, client):
    with scripted_answers(engine, answer("It is sunny.")):
        out = client.chat.completions.create(model="moeferry-tiny-moe", messages=ASK, tools=[WEATHER_TOOL])
        joined = joined_stream(client.chat.completions.create(model="moeferry-tiny-moe", messages=ASK,
                                                              tools=[WEATHER_TOOL], stream=True))
    assert out.choices[0].message.content == "It is sunny." and out.choices[0].finish_reason == "stop"
    assert joined == {"content": "It is sunny.", "reasoning": "", "calls": [], "finish": "stop"}


def test_required_and_named_tool_choice_read_the_schema_forms(engine, client):
    required = f'[{{"name": "get_weather", "parameters": {ARGS}}}]'
    with scripted_answers(engine, answer(required)):
        out = client.chat.completions.create(model="moeferry-tiny-moe", messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL],
                                             tool_choice="required")
    assert calls_of(out.choices[0].message) == [("get_weather", ARGS)]
    named = {"type": "function", "function": {"name": "get_weather"}}
    with scripted_answers(engine, answer(ARGS)):
        out = client.chat.completions.create(model="moeferry-tiny-moe", messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL],
                                             tool_choice=named)
        joined = joined_stream(client.chat.completions.create(model="moeferry-tiny-moe", messages=ASK, stream=True,
                                                              tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named))
    assert calls_of(out.choices[0].message) == [("get_weather", ARGS)] and out.choices[0].finish_reason == "tool_calls"
    assert joined["calls"] == [("get_weather", ARGS)] and joined["content"] == ""


def test_parallel_tool_calls_false_keeps_the_first_call(engine, client):
    with scripted_answers(engine, answer(CALL_TEXT["hermes"])):
        out = client.chat.completions.create(model="moeferry-tiny-moe", messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL],
                                             parallel_tool_calls=False)
    assert calls_of(out.choices[0].message) == EXPECTED[:1]


HISTORY = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]


def test_tool_messages_in_the_history_render_as_transformers_renders_them(engine, client):
    """transformers' own rendering of the conversation in its convention (arguments as dicts)."""
    hf_messages = json.loads(json.dumps(HISTORY))
    hf_messages[2]["content"] = ""
    for call in hf_messages[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    tools = [WEATHER_TOOL, TIME_TOOL]
    reference = engine.tokenizer.apply_chat_template(hf_messages, tools=tools, add_generation_prompt=True,
                                                     tokenize=False)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in reference
    assert '"arguments": {"city": "Paris"}' in reference
    expected_ids = engine.tokenizer(reference, add_special_tokens=False)["input_ids"]
    out = client.chat.completions.create(model="moeferry-tiny-moe", messages=HISTORY, tools=tools, max_tokens=1)
    assert out.usage.prompt_tokens == len(expected_ids)
    from moeferry.server.protocol import ChatCompletionRequest
    from moeferry.tokenizer.tokenizer import apply_chat_template

    body = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": tools})
    assert apply_chat_template(engine.tokenizer, [m.as_template_input() for m in body.messages],
                               body.tool_dicts) == expected_ids


def get_weather(city: str) -> str:
    return {"Paris": "sunny, 21 C"}.get(city, "unknown")


def test_an_agent_loop_calls_a_local_function_and_answers(engine, client):
    """The client offers get_weather, the model calls it, the client runs it and sends the
    result back as a tool message, and the model answers from it (the script reads the tool's
    result from the prompt, so the answer proves the result reached the model)."""
    def script(prompt: str) -> str:
        if "<tool_response>" not in prompt:
            return f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
        result = prompt.split("<tool_response>\n")[-1].split("\n</tool_response>")[0]
        return f"In Paris it is {result}."

    messages = list(ASK)
    local_functions = {"get_weather": get_weather}
    with scripted_answers(engine, script):
        for _ in range(3):
            out = client.chat.completions.create(model="moeferry-tiny-moe", messages=messages, tools=[WEATHER_TOOL])
            message = out.choices[0].message
            if out.choices[0].finish_reason != "tool_calls":
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = local_functions[call.function.name](**json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert message.content == "In Paris it is sunny, 21 C."


def test_a_syntax_of_special_tokens_keeps_them_in_the_text_all_but_the_end_token(engine, client):
    """Mistral's [TOOL_CALLS] is a special token: its parser has the text keep them (here the
    built-in model's <|im_start|>); the end token that finishes the answer is never text."""
    kwargs = dict(model="moeferry-tiny-moe", messages=ASK, tools=[WEATHER_TOOL])
    with scripted_answers(engine, answer("A<|im_start|>B")):
        with serving(engine, tool_call_parser="mistral") as keeping:
            kept = keeping.chat.completions.create(**kwargs).choices[0].message.content
        skipped = client.chat.completions.create(**kwargs).choices[0].message.content
    assert (kept, skipped) == ("A<|im_start|>B", "AB")


# A city from a list: the tiny model's free strings never end (they run to max_tokens), so the
# schemas the grammar holds it to bound them, as a real tool's schema often does.
CITY_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                   "required": ["city"]}}}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_grammar_makes_the_tiny_model_itself_call_a_named_tool(client, seed):
    """No script: the built-in model would never write a call, but a named tool_choice holds its
    answer to the function's parameters (the grammar in the device sampler), so it returns a
    call whose arguments validate against the tool's schema, whatever the seed."""
    import jsonschema

    out = client.chat.completions.create(
        model="moeferry-tiny-moe", messages=ASK, tools=[CITY_TOOL], seed=seed, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY_TOOL["function"]["parameters"])


def test_an_agent_loop_on_the_model_itself_under_tool_choice_required(client):
    """The agent loop with no script: tool_choice "required" makes the model call get_weather
    (the only tool; one call: parallel calls would let the tiny model add calls until
    max_tokens), the client runs it and sends the result back, and with tool_choice "none" the
    model answers in text."""
    import jsonschema

    messages = list(ASK)
    out = client.chat.completions.create(model="moeferry-tiny-moe", messages=messages, tools=[CITY_TOOL],
                                         tool_choice="required", parallel_tool_calls=False, seed=3, max_tokens=96)
    assert out.choices[0].finish_reason == "tool_calls"
    message = out.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        assert call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, CITY_TOOL["function"]["parameters"])
        messages.append({"role": "tool", "tool_call_id": call.id, "content": get_weather(**arguments)})
    final = client.chat.completions.create(model="moeferry-tiny-moe", messages=messages, tools=[CITY_TOOL],
                                           tool_choice="none", max_tokens=16)
    assert final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str) and final.choices[0].message.content


DEFS_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
                   "$defs": {"City": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}}}


def test_tool_choice_required_keeps_a_tools_own_defs(client):
    """A tool schema with $defs (as pydantic writes them) under tool_choice "required": its
    references resolve inside the tool, and the call validates against the tool's schema."""
    import jsonschema

    out = client.chat.completions.create(model="moeferry-tiny-moe", messages=ASK, tools=[DEFS_TOOL],
                                         tool_choice="required", parallel_tool_calls=False, seed=3, max_tokens=96)
    assert out.choices[0].finish_reason == "tool_calls"
    (call,) = out.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), DEFS_TOOL["function"]["parameters"])
