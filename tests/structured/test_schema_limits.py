"""What structured output refuses before compiling: schema keywords the grammar would not
enforce (or that no value satisfies) with a 400 naming the keyword, regexes that can never
match, and choice lists past their size bounds. And what it keeps enforcing: each keyword
listed as enforced is held to by xgrammar's grammar."""

import re

import pytest

from moeferry.errors import InvalidRequest
from moeferry.structured import (MAX_CHOICE_CHARS, MAX_CHOICES_CHARS, Constraint, GrammarCompiler,
                                 json_schema_constraint)
from moeferry.structured.schema_check import ENFORCED_FORMATS, UNENFORCED_KEYWORDS


@pytest.fixture(scope="module")
def compiler(model_cache):
    from moeferry.default_model import ensure_default_model
    from moeferry.tokenizer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ensure_default_model())
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(compiler, schema: dict, text: str) -> bool:
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiler.compile(json_schema_constraint(schema)),
                                      terminate_without_stop_token=True)
    return bool(matcher.accept_string(text)) and matcher.is_terminated()


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "string", "format": "iri"}, "format"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
    ({"anyOf": []}, "anyOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}}}, "contains"),
    ({"$defs": {"x": {"type": "object", "dependentRequired": {"a": ["b"]}}}, "$ref": "#/$defs/x"},
     "dependentRequired"),
])
def test_an_unenforced_or_unsatisfiable_keyword_is_refused_naming_it(schema, keyword):
    with pytest.raises(InvalidRequest, match=f"`{keyword}`") as info:
        json_schema_constraint(schema, param="response_format")
    assert info.value.param == "response_format"


def test_a_property_named_like_a_keyword_is_not_mistaken_for_one():
    json_schema_constraint({"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}})


def test_every_keyword_listed_as_unenforced_is_refused():
    for keyword in UNENFORCED_KEYWORDS:
        with pytest.raises(InvalidRequest, match=re.escape(f"`{keyword}`")):
            json_schema_constraint({"type": "object", keyword: {}})


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer", "multipleOf": 7}, "14", "8"),
    ({"type": "integer", "minimum": 5}, "5", "4"),
    ({"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    ({"type": "string", "pattern": "^a+$"}, '"aa"', '"b"'),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}, "additionalProperties": False},
     '{"a": 1}', '{"a": "x"}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "minProperties": 2},
     '{"a": 1, "b": 2}', '{"a": 1}'),
    ({"allOf": [{"type": "integer", "minimum": 3}]}, "3", "1"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1]", "[1, 2]"),
])
def test_an_enforced_keyword_is_held_to(compiler, schema, good, bad):
    assert accepts(compiler, schema, good)
    assert not accepts(compiler, schema, bad)


@pytest.mark.parametrize("fmt", ENFORCED_FORMATS)
def test_every_format_listed_as_enforced_refuses_junk(compiler, fmt):
    assert not accepts(compiler, {"type": "string", "format": fmt}, '"%% %%"')


@pytest.mark.parametrize("pattern", ["a[^\\s\\S]", "[^\\d\\D]+", "(x[^\\w\\W])+y"])
def test_a_regex_that_can_never_match_is_refused_when_built(pattern):
    with pytest.raises(InvalidRequest, match="never match") as info:
        Constraint("regex", pattern, "guided_regex")
    assert info.value.param == "guided_regex"


@pytest.mark.parametrize("pattern", ["a|[^\\s\\S]", "(x[^\\s\\S])*y", "[^a]b"])
def test_a_regex_with_an_empty_class_on_an_optional_path_is_kept(pattern):
    Constraint("regex", pattern, "guided_regex")


def test_choices_are_bounded_each_and_together():
    Constraint("choice", ("a" * MAX_CHOICE_CHARS,), "guided_choice")
    with pytest.raises(InvalidRequest, match="at most"):
        Constraint("choice", ("a" * (MAX_CHOICE_CHARS + 1),), "guided_choice")
    each = MAX_CHOICE_CHARS
    with pytest.raises(InvalidRequest, match="together"):
        Constraint("choice", tuple(str(i) * each for i in range(MAX_CHOICES_CHARS // each + 1)), "guided_choice")
