"""Reasoning: the thinking a model writes before its answer, read from the text so that chat's
`reasoning_content` and the Responses API's reasoning items carry it apart from the answer.

One parser per syntax, by vLLM's --reasoning-parser names: qwen3 and deepseek_r1 read
`<think>REASONING</think>ANSWER`; openai is gpt-oss's harmony channels, which
tools/harmony.py reads together with its tool calls. The answer after the reasoning goes to
the request's tool-call parser, so calls are read from the answer only. Parsers keep
tools/base.py's streaming contract (a prefix's parse is a prefix of the whole text's).
"""

from __future__ import annotations

from moeferry.tools.base import OutputParser, ParsedOutput, partial_marker_len

THINK_START, THINK_END = "<think>", "</think>"

# name -> whether a text that opens with no <think> is still reasoning until </think>
_THINK_PARSERS = {"qwen3": False, "deepseek_r1": True}
HARMONY = "openai"

# The parser of each model family (config.json's model_type); the <think> parsers only when the
# tokenizer has the tags (DeepSeek-V3's does not, R1's does).
FAMILY_REASONING = {"qwen3_moe": "qwen3", "deepseek_v3": "deepseek_r1", "gpt_oss": HARMONY}


def reasoning_parser_names() -> list[str]:
    return [*_THINK_PARSERS, HARMONY]


def family_reasoning(model_type: str, tokenizer, chosen: str | None = None) -> str | None:
    """The reasoning parser's name for a model: `chosen` (--reasoning-parser) when given, else
    the family's (a <think> parser only for a tokenizer that has </think>), else None."""
    if chosen is not None:
        return chosen
    name = FAMILY_REASONING.get(model_type)
    if name in _THINK_PARSERS and THINK_END not in _vocabulary(tokenizer):
        return None
    return name


def _vocabulary(tokenizer) -> dict:
    try:
        return tokenizer.get_vocab() if tokenizer is not None else {}
    except (AttributeError, NotImplementedError):
        return {}


def prompt_opens_thinking(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends inside a reasoning block: the chat template opened `<think>`
    (Qwen3's and DeepSeek-R1's do when thinking is on), so the answer starts with reasoning."""
    if tokenizer is None or not prompt_ids:
        return False
    tail = tokenizer.decode(prompt_ids[-4:], skip_special_tokens=False)
    return tail.rstrip().endswith(THINK_START)


def is_think_parser(name: str | None) -> bool:
    """Whether the parser reads <think> tags (the constraint of structured output then waits
    for the end tag: structured.ReasoningGate)."""
    return name in _THINK_PARSERS


def reasoning_parser(name: str | None, inner: OutputParser | None, opens_thinking: bool) -> OutputParser | None:
    """The parser of a choice's text under reasoning parser `name`: a ThinkParser over `inner`
    (the tool-call parser, None: the answer is content) for the <think> syntaxes; `inner`
    itself for harmony (tools/harmony.py reads its analysis channel) or no reasoning parser."""
    if name not in _THINK_PARSERS:
        return inner
    return ThinkParser(inner, starts_thinking=opens_thinking or _THINK_PARSERS[name])


class ThinkParser(OutputParser):
    """`<think>REASONING</think>ANSWER`. The text is reasoning when it opens with `<think>` (after
    whitespace) or `starts_thinking` (the prompt opened the block, or the syntax always does);
    then everything up to `</think>` is reasoning and what follows, less its leading
    whitespace, is the answer. A text that is not reasoning is all answer. The answer goes
    through `inner` when there is one."""

    name = "think"

    def __init__(self, inner: OutputParser | None = None, starts_thinking: bool = False):
        self.inner, self.starts_thinking = inner, starts_thinking
        self.keeps_special_tokens = inner is not None and inner.keeps_special_tokens

    def parse(self, text: str, final: bool) -> ParsedOutput:
        opened = text.lstrip()
        if opened.startswith(THINK_START):
            body = opened[len(THINK_START):]
        elif not final and THINK_START.startswith(opened):
            return ParsedOutput()  # empty, or a start tag half written: nothing can be placed yet
        elif self.starts_thinking:
            body = text
        else:
            return self._answer(text, final, "")
        end = body.find(THINK_END)
        if end < 0:
            held = 0 if final else partial_marker_len(body, THINK_END)
            return ParsedOutput(reasoning=body[:len(body) - held])
        return self._answer(body[end + len(THINK_END):].lstrip(), final, body[:end])

    def _answer(self, answer: str, final: bool, reasoning: str) -> ParsedOutput:
        if self.inner is None:
            return ParsedOutput(answer, reasoning)
        parsed = self.inner.parse(answer, final)
        return ParsedOutput(parsed.content, reasoning + parsed.reasoning, parsed.calls)


class WithoutReasoning(OutputParser):
    """`inner`'s parse less its reasoning (a request's include_reasoning false)."""

    name = "without_reasoning"

    def __init__(self, inner: OutputParser):
        self.inner, self.keeps_special_tokens = inner, inner.keeps_special_tokens

    def parse(self, text: str, final: bool) -> ParsedOutput:
        parsed = self.inner.parse(text, final)
        return ParsedOutput(parsed.content, "", parsed.calls)
