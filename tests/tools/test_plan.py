"""What a request's tools and tool_choice make of it (tools/plan.py): the tools the template
renders, the parser of the answer, the schema the grammar holds it to, and the ids it gets."""

from moeferry.tools import family_parser
from moeferry.tools.choice import NamedCallParser, RequiredCallsParser
from moeferry.tools.harmony import HarmonyParser
from moeferry.tools.hermes import HermesParser
from moeferry.tools.plan import plan_tools

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g"}}]


def test_no_tools_or_tool_choice_none_renders_and_reads_nothing():
    for tools, choice in ((None, None), (TOOLS, "none"), ([], "auto")):
        plan = plan_tools(tools, choice, None, "hermes")
        assert plan.template_tools is None and plan.parser is None and plan.schema is None
        assert plan.output_stream() is None and not plan.keeps_special_tokens


def test_gpt_oss_answers_are_always_read_for_their_channels_but_calls_only_with_tools():
    quiet = plan_tools(None, None, None, "openai")
    assert isinstance(quiet.parser, HarmonyParser) and not quiet.parser.calls and quiet.keeps_special_tokens
    assert quiet.template_tools is None
    auto = plan_tools(TOOLS, "auto", None, "openai")
    assert isinstance(auto.parser, HarmonyParser) and auto.parser.calls and auto.template_tools == TOOLS


def test_auto_reads_the_family_syntax_and_required_and_named_their_schema_forms():
    auto = plan_tools(TOOLS, None, None, family_parser("qwen3_moe"))
    assert isinstance(auto.parser, HermesParser) and auto.schema is None and auto.template_tools == TOOLS
    required = plan_tools(TOOLS, "required", False, "hermes")
    assert isinstance(required.parser, RequiredCallsParser) and required.max_calls == 1
    assert required.schema["maxItems"] == 1 and required.schema["minItems"] == 1
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "g"}}, None, "hermes")
    assert isinstance(named.parser, NamedCallParser) and named.parser.function == "g"
    assert named.schema == {"type": "object"} and named.max_calls == 1


def test_family_parsers_and_the_flag():
    assert [family_parser(t) for t in ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss")] == \
        ["hermes", "hermes", "hermes", "mistral", "deepseek_v3", "openai"]
    assert family_parser("qwen3_moe", "mistral") == "mistral" and family_parser("llama") is None
    stream = plan_tools(TOOLS, "auto", None, "mistral").output_stream()
    assert len(stream.new_id()) == 9
