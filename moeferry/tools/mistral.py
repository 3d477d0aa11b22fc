"""Mistral's tool-call syntax (Mixtral-8x22B-Instruct and the v3 tokenizer's models): content,
then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}` objects.
`[TOOL_CALLS]` is a control token: the text must keep special tokens."""

from __future__ import annotations

from moeferry.tools.base import OutputParser, ParsedOutput, held_tail, read_call_list
from moeferry.tools.json_scan import Malformed

MARKER = "[TOOL_CALLS]"


class MistralParser(OutputParser):
    """The text before `[TOOL_CALLS]` is content (less the whitespace before the marker); the
    calls follow it. When what follows cannot be a call list, the marker and all after it are
    content."""

    name = "mistral"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        at = text.find(MARKER)
        if at < 0:
            return ParsedOutput(content=held_tail(text, final, MARKER))
        try:
            return ParsedOutput(content=text[:at].rstrip(), calls=read_call_list(text, at + len(MARKER)))
        except Malformed:
            return ParsedOutput(content=text[:at].rstrip() + held_tail(text[at:], final))
