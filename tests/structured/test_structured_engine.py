"""Structured output through the offline API on the built-in model (CPU): outputs always
validate (jsonschema is the oracle), the grammar state survives preemption (the same tokens as
alone), unconstrained requests beside constrained ones keep their tokens, bad constraints are
refused with the field named."""

import json
import re

import jsonschema
import pytest

from moeferry import LLM, SamplingParams
from moeferry.sampling import InvalidRequest
from moeferry.structured import Constraint, json_schema_constraint

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "proud"]},
                                      "scores": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1,
                                                 "maxItems": 3}},
     "required": ["mood", "scores"]},
    {"type": "object", "properties": {"who": {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 10}, "married": {"type": "boolean"}},
        "required": ["first", "married"]}, "year": {"type": "integer", "minimum": 1800, "maximum": 1820}},
     "required": ["who", "year"]},
]


@pytest.fixture(scope="module")
def llm(model_cache):
    return LLM(dtype="float32", device="cpu", max_running_requests=8, max_model_len=192)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_outputs_always_validate(llm, index):
    schema = SCHEMAS[index]
    constraint = json_schema_constraint(schema)
    params = [SamplingParams(temperature=t, seed=seed, max_tokens=120, structured=constraint)
              for t, seed in [(0.0, 0), (1.0, 1), (1.5, 2), (0.7, 3)]]
    outputs = llm.generate(["Mr. Darcy said", "Her age was", "It is a truth", "Emma"], params)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def closing_bias(tokenizer) -> dict[int, float]:
    """A logit bias toward '"' and away from ',': the tiny model writes prose inside free
    strings, and item after item, until max_tokens; so pushed it closes its strings and its
    object, and the grammar alone still decides where a quote, a comma or a brace may go."""
    return {tokenizer.encode('"')[0]: 8.0, tokenizer.encode(",")[0]: -30.0}


def test_json_object_regex_and_choice_outputs_match(llm):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ("Pride", "Prejudice", "Sense and Sensibility")
    params = [SamplingParams(temperature=1.0, seed=9, max_tokens=100, structured=Constraint("json_object", ""),
                             logit_bias=closing_bias(llm.tokenizer)),
              SamplingParams(temperature=1.0, seed=9, max_tokens=40, structured=Constraint("regex", phone)),
              SamplingParams(temperature=0.0, max_tokens=20, structured=Constraint("choice", choices)),
              SamplingParams(temperature=1.3, seed=5, max_tokens=20, structured=Constraint("choice", choices))]
    obj, number, greedy_choice, sampled_choice = llm.generate(["Lydia"] * 4, params)
    assert isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(phone, number.text), number.text
    assert greedy_choice.text in choices and sampled_choice.text in choices
    assert all(o.finish_reason == "stop" for o in (obj, number, greedy_choice, sampled_choice))


def test_unconstrained_requests_beside_constrained_ones_keep_their_tokens(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)]
    prompts = ["Jane Bennet", "Mr. Bingley"]
    alone = [o.token_ids for o in llm.generate(prompts, free)]
    constrained = SamplingParams(temperature=0.0, max_tokens=60, structured=json_schema_constraint(SCHEMAS[0]))
    mixed = llm.generate(prompts + ["Kitty"], free + [constrained])
    assert [o.token_ids for o in mixed[:2]] == alone
    jsonschema.validate(json.loads(mixed[2].text), SCHEMAS[0])


def test_a_preempted_constrained_request_keeps_its_grammar_state(model_cache):
    """8 KV pages of 4 tokens for 4 requests of up to 31 tokens: they preempt one another; a
    recomputed prefix is not fed to the grammar again, so each gives its tokens alone."""
    llm = LLM(dtype="float32", device="cpu", num_tokens=32, page_size=4, max_running_requests=4, max_model_len=32)
    schema = {"type": "object", "properties": {"w": {"type": "string", "minLength": 6, "maxLength": 9}},
              "required": ["w"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=24, structured=json_schema_constraint(schema))
    prompts = [[5 + i, 17, 33 + i, 2, 9, 71, 40 + i] for i in range(4)]
    alone = [llm.generate(p, params)[0] for p in prompts]
    assert llm.engine.scheduler.num_preemptions == 0
    together = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    for out in together:
        jsonschema.validate(json.loads(out.text), schema)


def test_a_json_schema_framed_by_fixed_text_as_a_tool_call_is(llm):
    """json_schema_constraint's prefix and suffix (what a forced tool call needs): the output is
    the prefix, a JSON value valid under the schema, then the suffix."""
    schema = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}},
        "required": ["name", "arguments"]}
    constraint = json_schema_constraint(schema, prefix="<tool_call>\n", suffix="\n</tool_call>")
    for out in llm.generate(["Call it", "Weather"], [SamplingParams(temperature=t, seed=2, max_tokens=80,
                                                                    structured=constraint) for t in (0.0, 1.0)]):
        assert out.finish_reason == "stop", out.text
        framed = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", out.text, re.DOTALL)
        assert framed, out.text
        jsonschema.validate(json.loads(framed.group(1)), schema)
    with pytest.raises(InvalidRequest):
        Constraint("regex", "a+", prefix="x")


def test_bad_constraints_are_refused_naming_the_field(llm):
    for constraint in (json_schema_constraint({"type": "nonsense"}), Constraint("regex", "a(b", param="guided_regex")):
        with pytest.raises(InvalidRequest) as err:
            llm.generate("Hi", SamplingParams(structured=constraint))
        assert err.value.param == constraint.param and "\n" not in str(err.value)
        assert "cannot compile" in str(err.value)
    with pytest.raises(InvalidRequest):
        Constraint("choice", ())
    with pytest.raises(InvalidRequest):
        json_schema_constraint("[1, 2")
