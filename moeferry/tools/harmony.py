"""gpt-oss's harmony format, read from the text (special tokens kept). The answer is a run of
messages, each `<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY` ended by
`<|end|>` (then `<|start|>assistant` and the next header) or by `<|call|>` / `<|return|>`,
the model's end tokens (which the engine leaves out of the text). The recipient may also
come before the channel (`<|start|>assistant to=functions.f<|channel|>commentary`).

Not openai-harmony: its parser needs the o200k tokenizer file, fetched on first use (a
server may run offline), and reads token ids where this reads text; the format is small
enough to read from the text.
"""

from __future__ import annotations

import re

from moeferry.tools.base import OutputParser, ParsedOutput, PartialCall, partial_marker_len

MESSAGE, START = "<|message|>", "<|start|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTION_PREFIX = "functions."


class HarmonyParser(OutputParser):
    """analysis -> reasoning; a message to `functions.NAME` -> a call of NAME whose arguments
    are its body; final and commentary without recipient -> content. A message to another
    recipient (gpt-oss's built-in browser or python tools) is not this server's to run and is
    left out. With `calls` False (tool_choice "none"), a function's message is content."""

    name = "openai"
    keeps_special_tokens = True

    def __init__(self, calls: bool = True):
        self.calls = calls

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out = ParsedOutput()
        pos = 0
        while pos < len(text):
            body_at = text.find(MESSAGE, pos)
            if body_at < 0:
                break
            header = text[pos:body_at]
            body, pos = _body(text, body_at + len(MESSAGE), final)
            self._place(out, header, body)
            if pos is None:
                break
            if text.startswith(START, pos):
                pos += len(START)
        return out

    def _place(self, out: ParsedOutput, header: str, body: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            name = recipient.group(1)
            if name.startswith(FUNCTION_PREFIX) and len(name) > len(FUNCTION_PREFIX) and self.calls:
                out.calls.append(PartialCall(name[len(FUNCTION_PREFIX):], body))
            elif name.startswith(FUNCTION_PREFIX):
                out.content += body
        elif channel is not None and channel.group(1) == "analysis":
            out.reasoning += body
        else:
            out.content += body


def _body(text: str, start: int, final: bool) -> tuple[str, int | None]:
    """A message's body from `start`, and the index past its end token (None while it runs
    to the end of the text; then, until the text is final, less a half-written special token)."""
    ends = [(i, marker) for marker in BODY_ENDS if (i := text.find(marker, start)) >= 0]
    if ends:
        i, marker = min(ends)
        return text[start:i], i + len(marker)
    body = text[start:]
    return (body if final else body[:len(body) - partial_marker_len(body, *BODY_ENDS, START)]), None
