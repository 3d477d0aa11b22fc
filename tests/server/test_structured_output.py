"""Structured output through the official `openai` client against the server on the built-in
model: json_schema answers always validate (jsonschema) over seeds and schemas, json_object
answers parse to objects, completions' regex and choice (vLLM's extra-body names) match, and a
schema the compiler refuses is a one-line 400."""

import json
import re

import jsonschema
import openai
import pytest

MODEL = "moeferry-tiny-moe"
CHAT = [{"role": "user", "content": "Describe a character as JSON."}]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "rank": {"enum": ["captain", "admiral"]},
                                      "ships": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                           "maximum": 9}, "maxItems": 3}},
     "required": ["name", "rank", "ships"], "additionalProperties": False},
    {"type": "object", "properties": {"place": {"type": "object", "properties": {
        "town": {"type": "string", "maxLength": 10}, "far": {"type": "boolean"}}, "required": ["town", "far"]},
        "miles": {"type": "integer", "minimum": 0, "maximum": 500}}, "required": ["place", "miles"]},
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_answers_validate_over_seeds(client, index):
    schema = SCHEMAS[index]
    fmt = {"type": "json_schema", "json_schema": {"name": f"schema{index}", "schema": schema, "strict": True}}
    for seed, temperature in [(0, 0.0), (1, 1.0), (2, 1.4)]:
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=100, seed=seed,
                                             temperature=temperature, response_format=fmt)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_a_streamed_json_schema_answer_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}}
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=100, seed=5, temperature=1.0,
                                            response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[0])


def test_json_object_answers_parse_to_objects(client, server):
    """With a logit bias toward '"' and away from ',' (the tiny model otherwise writes prose in
    a free string, and item after item, until max_tokens); the grammar alone decides where a
    quote, a comma or a brace may go."""
    encode = server.engine.tokenizer.encode
    bias = {str(encode('"')[0]): 8, str(encode(",")[0]): -30}
    for seed in range(2):
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, seed=seed, temperature=1.0,
                                             response_format={"type": "json_object"}, logit_bias=bias)
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_completions_regex_and_choice_match(client):
    date = r"1[78]\d\d-(0[1-9]|1[0-2])-[0-2]\d"
    for seed in range(2):
        out = client.completions.create(model=MODEL, prompt="The letter is dated", max_tokens=30, seed=seed,
                                        temperature=1.0, extra_body={"guided_regex": date})
        assert re.fullmatch(date, out.choices[0].text), out.choices[0].text
    choices = ["Darcy", "Wickham", "Mr. Collins"]
    out = client.completions.create(model=MODEL, prompt="She married", max_tokens=10, temperature=1.0, seed=3,
                                    extra_body={"guided_choice": choices})
    assert out.choices[0].text in choices
    out = client.completions.create(model=MODEL, prompt="She married", max_tokens=10, temperature=0,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop"


def test_a_schema_the_compiler_refuses_is_a_one_line_400(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": 3}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, response_format=fmt)
    message = err.value.body["message"]
    assert err.value.body["param"] == "response_format" and "\n" not in message and "properties" in message
