"""The <think> reasoning parsers: reasoning and answer split where the tags say, tool calls read
from the answer only, and the streaming contract of tools/base.py (every prefix's parse is a
prefix of the whole text's)."""

import pytest

from moeferry.reasoning import ThinkParser, WithoutReasoning, family_reasoning, reasoning_parser
from moeferry.tools.hermes import HermesParser

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize("parser,text,reasoning,content", [
    (ThinkParser(), "<think>plan</think>\n\nanswer", "plan", "answer"),
    (ThinkParser(), "  <think>plan", "plan", ""),
    (ThinkParser(), "no tags at all", "", "no tags at all"),
    (ThinkParser(), "<think>\n\n</think>\n\nanswer", "\n\n", "answer"),
    (ThinkParser(starts_thinking=True), "plan</think>answer", "plan", "answer"),
    (ThinkParser(starts_thinking=True), "plan, still", "plan, still", ""),
    (ThinkParser(starts_thinking=True), "<think>plan</think>answer", "plan", "answer"),
    (reasoning_parser("deepseek_r1", None, False), "plan</think>answer", "plan", "answer"),
    (reasoning_parser("qwen3", None, False), "plan</think>answer", "", "plan</think>answer"),
    (WithoutReasoning(ThinkParser()), "<think>plan</think>answer", "", "answer"),
])
def test_reasoning_and_answer_split_where_the_tags_say(parser, text, reasoning, content):
    parsed = parser.parse(text, final=True)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)


def test_a_tool_call_is_read_from_the_answer_after_the_reasoning_only():
    parser = ThinkParser(HermesParser())
    parsed = parser.parse(f"<think>I could write {CALL} here</think>\n{CALL}", final=True)
    assert parsed.reasoning == f"I could write {CALL} here"
    assert [(c.name, c.arguments) for c in parsed.calls] == [("f", '{"x": 1}')]


@pytest.mark.parametrize("parser,text", [
    (ThinkParser(), "<think>a</th plan </think>\n\nthe answer </thi"),
    (ThinkParser(starts_thinking=True), "step one\nstep two</think>  done"),
    (ThinkParser(), "plain answer with < and <th in it"),
    (ThinkParser(HermesParser()), f"<think>why</think>text {CALL}"),
])
def test_every_prefix_parses_to_a_prefix_of_the_whole(parser, text):
    whole = parser.parse(text, final=True)
    for end in range(len(text) + 1):
        part = parser.parse(text[:end], final=False)
        assert whole.reasoning.startswith(part.reasoning), (end, part)
        assert whole.content.startswith(part.content), (end, part)
        for call, final_call in zip(part.named_calls(), whole.named_calls()):
            assert call.name == final_call.name and final_call.arguments.startswith(call.arguments)


class _Vocab:
    def __init__(self, *tokens):
        self.tokens = tokens

    def get_vocab(self):
        return {t: i for i, t in enumerate(self.tokens)}


def test_the_family_parser_needs_the_think_tags_in_the_vocabulary_unless_chosen():
    assert family_reasoning("qwen3_moe", _Vocab("<think>", "</think>")) == "qwen3"
    assert family_reasoning("qwen3_moe", _Vocab("a")) is None
    assert family_reasoning("deepseek_v3", _Vocab("a")) is None  # DeepSeek-V3 writes no reasoning
    assert family_reasoning("gpt_oss", _Vocab("a")) == "openai"
    assert family_reasoning("mixtral", _Vocab("a"), chosen="deepseek_r1") == "deepseek_r1"
