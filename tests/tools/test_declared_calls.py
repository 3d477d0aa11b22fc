"""Tool schemas under tool_choice "required" keep their own local references ($defs and
"#"), as they would at the root under a named tool_choice; and a call of a function the
request never offered is not returned as a tool call."""

import json

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from moeferry.tools.choice import required_schema
from moeferry.tools.plan import plan_tools

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/Address"}},
          "required": ["name", "address"], "additionalProperties": False,
          "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                                "additionalProperties": False}}}
TREE = {"type": "object", "required": ["label", "child"], "additionalProperties": False,
        "properties": {"label": {"type": "string"}, "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def accepts(schema: dict, value) -> bool:
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return _is_grammar_accept_string(grammar, json.dumps(value))


def test_required_keeps_a_tools_own_defs():
    schema = required_schema([tool("save", PERSON), tool("other", {"type": "object"})], parallel=True)
    good = [{"name": "save", "parameters": {"name": "Ada", "address": {"city": "London"}}}]
    assert accepts(schema, good)
    assert not accepts(schema, [{"name": "save", "parameters": {"name": "Ada", "address": {"town": "London"}}}])


def test_required_resolves_a_root_reference_inside_the_tool():
    schema = required_schema([tool("grow", TREE)], parallel=False)
    nested = {"label": "a", "child": {"label": "b", "child": None}}
    assert accepts(schema, [{"name": "grow", "parameters": nested}])
    assert not accepts(schema, [{"name": "grow", "parameters": {"child": None}}])  # the wrapper's shape is not it


def test_two_tools_with_the_same_def_name_keep_their_own():
    other = {**PERSON, "$defs": {"Address": {"type": "object", "properties": {"zip": {"type": "integer"}},
                                             "required": ["zip"], "additionalProperties": False}}}
    schema = required_schema([tool("a", PERSON), tool("b", other)], parallel=True)
    assert accepts(schema, [{"name": "a", "parameters": {"name": "x", "address": {"city": "y"}}},
                            {"name": "b", "parameters": {"name": "x", "address": {"zip": 1}}}])
    assert not accepts(schema, [{"name": "b", "parameters": {"name": "x", "address": {"city": "y"}}}])


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
])
def test_a_call_of_an_undeclared_function_is_not_a_tool_call(text):
    plan = plan_tools([tool("get_weather", {"type": "object"})], "auto", None, "hermes")
    streamed = plan.output_stream()
    names = [c["function"]["name"] for i in range(0, len(text), 7)
             for c in streamed.push(text[i:i + 7], final=i + 7 >= len(text)).get("tool_calls", []) if "id" in c]
    whole = plan.output_stream().message(text)
    assert "rm_rf" not in names
    assert [c["function"]["name"] for c in whole.get("tool_calls", [])] == names
    assert all(name == "get_weather" for name in names)
