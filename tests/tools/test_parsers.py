"""Each family's tool-call parser on fixed model outputs: the calls and content it reads, and
the property streaming rests on: fed the text in pieces (every character alone, and random
splits), the deltas join into exactly the message of the whole text."""

import json
import random

import pytest

from moeferry.tools import parser_class, parser_names
from moeferry.tools.choice import NamedCallParser, RequiredCallsParser
from moeferry.tools.harmony import HarmonyParser
from moeferry.tools.stream import OutputStream, mistral_call_id

WEATHER = {"city": "Paris", "unit": "celsius"}
ARGS = json.dumps(WEATHER)
HERMES = f'I will look.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n' \
         f'<tool_call>\n{{"name": "get_time", "arguments": {{"zone": "CET"}}}}\n</tool_call>'
MISTRAL = f'Sure. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}, ' \
          f'{{"name": "get_time", "arguments": {{"zone": "CET"}}}}]'
DEEPSEEK_V3 = ("I will look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
               f"{ARGS}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
               '{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DEEPSEEK_V31 = (f"I will look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{ARGS}"
                '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET"}<｜tool▁call▁end｜>'
                "<｜tool▁calls▁end｜>")
HARMONY = ("<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>"
           f"commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}")
EMPTY_NAME = '<tool_call>{"name": "", "arguments": {}}</tool_call>'
EXPECTED_CALLS = [("get_weather", ARGS), ("get_time", '{"zone": "CET"}')]

CASES = [  # (parser, text, content, calls, reasoning)
    ("hermes", HERMES, "I will look.", EXPECTED_CALLS, None),
    ("mistral", MISTRAL, "Sure.", EXPECTED_CALLS, None),
    ("deepseek_v3", DEEPSEEK_V3, "I will look.", EXPECTED_CALLS, None),
    ("deepseek_v3", DEEPSEEK_V31, "I will look.", EXPECTED_CALLS, None),
    ("openai", HARMONY, None, EXPECTED_CALLS[:1], "The user wants the weather."),
    ("openai", "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Paris.",
     "Paris.", [], "Think."),
    ("hermes", "No tools needed: 4.", "No tools needed: 4.", [], None),
    ("hermes", "a <tool_call>not json</tool_call> b", "a<tool_call>not json</tool_call>b", [], None),
    ("hermes", "x <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2", "x", [("f", '{"a": [1, 2')], None),
    ("hermes", '<tool_call>{"arguments": {"q": 1}, "name": "f"}</tool_call>', None, [("f", '{"q": 1}')], None),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>', None, [("f", '{"q": 1}')], None),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")], None),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1]}</tool_call>', None, [("f", '{"a": 1')], None),
    ("hermes", "ends with <tool_ca", "ends with <tool_ca", [], None),
    ("mistral", "[TOOL_CALLS] not a list", "[TOOL_CALLS] not a list", [], None),
    ("hermes", EMPTY_NAME, EMPTY_NAME, [], None),
    ("deepseek_v3", "a<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><｜tool▁sep｜>{}<｜tool▁call▁end｜>", "a", [], None),
]


def message_of(parser, text: str) -> dict:
    return OutputStream(parser).message(text)


def streamed(parser, pieces: list[str]) -> dict:
    """The deltas of `pieces` joined as a client joins them (by tool call index)."""
    stream = OutputStream(parser)
    content, reasoning, calls = "", "", {}
    deltas = [stream.push(p, final=False) for p in pieces] + [stream.push("", final=True)]
    for delta in deltas:
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for tc in delta.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls and tc["index"] == len(calls), "a call opens once, in order"
                assert tc["type"] == "function" and tc["function"]["name"]
                calls[tc["index"]] = [tc["function"]["name"], ""]
            calls[tc["index"]][1] += tc["function"]["arguments"]
    return {"content": content, "reasoning": reasoning, "calls": [tuple(calls[i]) for i in sorted(calls)]}


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name, text, content, calls, reasoning", CASES)
def test_a_fixed_output_reads_as_its_calls_and_content(name, text, content, calls, reasoning):
    message = message_of(parser_class(name)(), text)
    assert message["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    assert message.get("reasoning_content") == reasoning
    for call in message.get("tool_calls", []):
        assert call["id"].startswith("call_") and call["type"] == "function"
        if call["function"]["arguments"].endswith("}"):
            json.loads(call["function"]["arguments"])  # whole arguments are the model's valid JSON


@pytest.mark.parametrize("name, text, content, calls, reasoning", CASES)
def test_streamed_deltas_join_into_the_whole_message(name, text, content, calls, reasoning):
    whole = message_of(parser_class(name)(), text)
    expected = {"content": whole["content"] or "", "reasoning": whole.get("reasoning_content") or "",
                "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]}
    assert streamed(parser_class(name)(), list(text)) == expected
    for seed in range(20):
        assert streamed(parser_class(name)(), splits(text, seed)) == expected


@pytest.mark.parametrize("name, text", [(c[0], c[1]) for c in CASES])
def test_no_markup_reaches_the_content_of_a_stream_of_calls(name, text):
    content = streamed(parser_class(name)(), list(text))["content"]
    for marker in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<｜tool", "<|channel|>", "<|message|>"):
        if EXPECTED_CALLS[0][0] in text and "not" not in text:
            assert marker not in content


def test_the_registry_names_vllms_parsers():
    assert set(parser_names()) == {"hermes", "mistral", "deepseek_v3", "openai"}
    with pytest.raises(KeyError, match="hermes"):
        parser_class("nope")


def test_harmony_without_calls_keeps_channels_and_gives_a_call_as_content():
    message = message_of(HarmonyParser(calls=False), HARMONY)
    assert message == {"content": ARGS, "reasoning_content": "The user wants the weather."}


def test_required_answer_is_its_json_array_of_calls():
    text = f'[{{"name": "get_weather", "parameters": {ARGS}}}, {{"name": "get_time", "parameters": {{}}}}]'
    message = message_of(RequiredCallsParser(), text)
    assert message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("get_weather", ARGS), ("get_time", "{}")]
    assert streamed(RequiredCallsParser(), list(text))["calls"] == [("get_weather", ARGS), ("get_time", "{}")]
    assert message_of(RequiredCallsParser(), "no calls here") == {"content": "no calls here"}


def test_a_named_function_answer_is_its_arguments():
    text = f" {ARGS}\n"
    assert message_of(NamedCallParser("get_weather"), text)["tool_calls"][0]["function"] == \
        {"name": "get_weather", "arguments": ARGS}
    assert streamed(NamedCallParser("get_weather"), list(text))["calls"] == [("get_weather", ARGS)]


def test_mistral_ids_are_nine_letters_or_digits():
    ids = {mistral_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)


def test_max_calls_keeps_the_first_call():
    message = OutputStream(parser_class("hermes")(), max_calls=1).message(HERMES)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


# Each syntax told to transformers' own response parser (tokenizer.parse_response, a parser
# nobody here wrote) as a response template: the calls it reads must be ours.
_ANCHOR = "<|im_start|>assistant\n"
_CONTENT = {"content": "text", "repeats": True, "join": ""}
_CALL = {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}}
HF_TEMPLATES = {
    "hermes": {"start_anchor": _ANCHOR, "fields": {"content": _CONTENT, "tool_calls": {
        "open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
        "transform": {"type": "function", "function": "{content}"}}}},
    "mistral": {"start_anchor": _ANCHOR, "fields": {"content": _CONTENT, "tool_calls": {
        "open": "[TOOL_CALLS]", "content": "json", "transform_each": True, "transform": _CALL}}},
    "deepseek_v3": {"start_anchor": _ANCHOR, "fields": {"content": _CONTENT, "tool_calls": {
        "open_pattern": r"<｜tool▁call▁begin｜>(?P<name>[^<]+)<｜tool▁sep｜>", "close": "<｜tool▁call▁end｜>",
        "content": "json", "repeats": True,
        "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}}}},
}
HF_CASES = [("hermes", HERMES, True), ("mistral", MISTRAL, True), ("deepseek_v3", DEEPSEEK_V31, False),
            ("hermes", '<tool_call>{"arguments": {"q": 1}, "name": "f"}</tool_call>', True),
            ("hermes", "No tools needed: 4.", True)]


@pytest.mark.parametrize("name, text, same_content", HF_CASES)
def test_the_calls_are_those_transformers_response_parser_reads(name, text, same_content):
    from moeferry.tokenizer.tokenizer import load_tokenizer
    from moeferry.default_model import BUILTIN_MODEL_DIR

    reference = load_tokenizer(BUILTIN_MODEL_DIR).parse_response(text, schema=HF_TEMPLATES[name], prefix=_ANCHOR)
    ours = message_of(parser_class(name)(), text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ours.get("tool_calls", [])] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in reference.get("tool_calls", [])]
    if same_content:
        assert (ours["content"] or "") == reference.get("content", "")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time"}}]
VALID_ANSWERS = [[{"name": "get_weather", "parameters": {"city": "Paris"}}],
                 [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]]
INVALID_ANSWERS = [[], [{"name": "get_date", "parameters": {}}], [{"name": "get_weather"}],
                   [{"name": "get_weather", "parameters": {"city": 5}}], {"name": "get_time", "parameters": {}},
                   [{"name": "get_weather", "parameters": {"city": "Paris", "country": "FR"}}]]


def test_the_required_schema_admits_exactly_calls_of_the_tools():
    """Checked by jsonschema_rs (a validator nobody here wrote); every answer it admits reads
    as its calls."""
    import jsonschema_rs

    from moeferry.tools.choice import named_schema, required_schema

    schema = required_schema(TOOLS, parallel=True)
    assert all(jsonschema_rs.is_valid(schema, answer) for answer in VALID_ANSWERS)
    assert not any(jsonschema_rs.is_valid(schema, answer) for answer in INVALID_ANSWERS)
    assert not jsonschema_rs.is_valid(required_schema(TOOLS, parallel=False), VALID_ANSWERS[1])
    for answer in VALID_ANSWERS:
        calls = message_of(RequiredCallsParser(), json.dumps(answer))["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [(a["name"], a["parameters"]) for a in answer]
    weather = named_schema(TOOLS, "get_weather")
    assert jsonschema_rs.is_valid(weather, {"city": "Paris"}) and not jsonschema_rs.is_valid(weather, {})
    assert named_schema(TOOLS, "get_time") == {"type": "object"}


_PIECES = {  # fragments each syntax's outputs are made of, in any order (well-formed or not)
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", "\n", " ", '{"name": "f"', '"arguments": ', '{"a": [1, "}"]}',
               ", ", "}", "{", "x", '"', "\\"],
    "mistral": ["[TOOL_CALLS]", " [", "]", '{"name": "f"', ', "arguments": ', '{"a": 1}', "}", ", ", "x", " "],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                    "function", "f", "\n", "```json", '{"a": 1}', "{", "}", "x", " "],
    "openai": ["<|channel|>", "analysis", "final", "commentary to=functions.f", "<|message|>", "<|end|>",
               "<|start|>", "assistant", '{"a": 1}', "x", " ", "<|"],
}


@pytest.mark.parametrize("name", list(_PIECES))
def test_any_output_streams_into_its_whole_message(name):
    """Hypothesis over texts made of each syntax's fragments, in any order: the deltas of the
    text fed a character at a time join into the message of the whole text."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(st.lists(st.sampled_from(_PIECES[name]), max_size=14))
    def streams_whole(pieces):
        text = "".join(pieces)
        whole = message_of(parser_class(name)(), text)
        expected = {"content": whole["content"] or "", "reasoning": whole.get("reasoning_content") or "",
                    "calls": [(c["function"]["name"], c["function"]["arguments"])
                              for c in whole.get("tool_calls", [])]}
        assert streamed(parser_class(name)(), list(text)) == expected
        assert streamed(parser_class(name)(), pieces) == expected

    streams_whole()
