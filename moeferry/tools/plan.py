"""What one chat request's `tools`, `tool_choice` and `parallel_tool_calls` make of it: the
tools the chat template renders, the parser that reads the answer, and the JSON schema the
grammar holds the answer to ("required" and a named function)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from moeferry.tools import parser_class
from moeferry.tools.choice import NamedCallParser, RequiredCallsParser, named_schema, required_schema
from moeferry.tools.harmony import HarmonyParser
from moeferry.tools.stream import OutputStream, mistral_call_id, openai_call_id


@dataclass(frozen=True)
class ToolPlan:
    """How a request treats tools. `template_tools`: the tool list the chat template renders
    (None: the request renders as one without tools, byte for byte); `parser`: reads the
    answer (None: the text is the content); `schema`: the JSON schema the answer must match
    (None: free); `max_calls`: 1 when parallel_tool_calls is false.

    Invariants: tool_choice "none" or no tools renders no tools and reads no calls (gpt-oss's
    channels are still read: its answer is always in them); a schema comes with the parser of
    the answer it describes."""

    template_tools: list[dict] | None = None
    parser: object = None
    schema: dict | None = None
    max_calls: int | None = None
    new_id: object = openai_call_id
    declared: frozenset[str] | None = None  # the functions offered: calls of any other are dropped

    @property
    def keeps_special_tokens(self) -> bool:
        return self.parser is not None and self.parser.keeps_special_tokens

    def output_stream(self) -> OutputStream | None:
        """A fresh reader of one choice's answer, or None when the text is the content."""
        if self.parser is None:
            return None
        return OutputStream(self.parser, self.new_id, self.max_calls, self.declared)


def plan_tools(tools: list[dict] | None, tool_choice, parallel: bool | None, parser_name: str | None) -> ToolPlan:
    """The plan of a request whose (checked) `tools` are OpenAI tool dicts and `tool_choice`
    is None, "none", "auto", "required" or {"type": "function", "function": {"name": ...}};
    `parser_name` is the model's parser (tools.family_parser)."""
    family = parser_class(parser_name) if parser_name is not None else None
    new_id = mistral_call_id if parser_name == "mistral" else openai_call_id
    if not tools or tool_choice == "none":
        return ToolPlan(parser=HarmonyParser(calls=False)) if family is HarmonyParser else ToolPlan()
    max_calls = 1 if parallel is False else None
    declared = frozenset(t["function"]["name"] for t in tools)
    base = partial(ToolPlan, template_tools=tools, max_calls=max_calls, new_id=new_id, declared=declared)
    if tool_choice == "required":
        return base(parser=RequiredCallsParser(), schema=required_schema(tools, parallel is not False))
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return base(parser=NamedCallParser(name), schema=named_schema(tools, name), max_calls=1)
    return base(parser=family() if family is not None else None)
