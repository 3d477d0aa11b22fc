"""The output of tool_choice "required" and of a named function, and the JSON schema the
grammar holds each to (vLLM's forms, the same for every family): "required" answers a JSON
array of `{"name": ..., "parameters": {...}}` objects, one or more calls of the tools given;
a named function answers its arguments' JSON object, and nothing else."""

from __future__ import annotations

from moeferry.tools.base import OutputParser, ParsedOutput, PartialCall, read_call_list
from moeferry.tools.json_scan import Malformed, skip_ws

ANY_OBJECT = {"type": "object"}


def function_parameters(tool: dict) -> dict:
    """A tool's parameters' schema (a function declared without any takes an object)."""
    return tool["function"].get("parameters") or ANY_OBJECT


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of one or more calls of `tools` (at most one unless `parallel`). Each
    tool's parameters are a definition of the root (`#/$defs/tool<i>`), their own local
    references ("#", "#/$defs/...") rewritten to point inside it, so they resolve as they would
    with the parameters at the root (a named tool_choice's schema, or the client's validator)."""
    defs = {f"tool{i}": _rebased(function_parameters(t), f"#/$defs/tool{i}") for i, t in enumerate(tools)}
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": {"$ref": f"#/$defs/tool{i}"}},
              "required": ["name", "parameters"]} for i, t in enumerate(tools)]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
    return schema if parallel else {**schema, "maxItems": 1}


def _rebased(schema, root: str):
    """`schema` with every local `$ref` ("#" or "#/...") made relative to `root` instead."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rebased(value, root) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = root + ref[1:]
    return out


def named_schema(tools: list[dict], name: str) -> dict:
    """The JSON schema of the arguments of the function `name` among `tools`."""
    return function_parameters(next(t for t in tools if t["function"]["name"] == name))


class RequiredCallsParser(OutputParser):
    """Reads the "required" answer: the calls in its JSON array. An answer that is not one (the
    grammar rules that out; a model without it may write anything) is content."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        if start == len(text):
            return ParsedOutput(content=text if final else "")
        if text[start] != "[":
            return ParsedOutput(content=text)
        try:
            return ParsedOutput(calls=read_call_list(text, start))
        except Malformed:
            return ParsedOutput(content=text)


class NamedCallParser(OutputParser):
    """Reads a named function's answer: the whole text is the call's arguments."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool) -> ParsedOutput:
        arguments = text.strip() if final else text.lstrip().rstrip()  # trailing whitespace: held
        return ParsedOutput(calls=[PartialCall(self.function, arguments)])
