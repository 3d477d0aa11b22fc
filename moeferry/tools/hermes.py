"""Qwen's tool-call syntax (Hermes' before it), used by Qwen2-MoE, Qwen3-MoE, OLMoE through
ChatML, and the built-in model: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

from moeferry.tools.base import OutputParser, ParsedOutput, PartialCall, held_tail, partial_marker_len, read_call_object
from moeferry.tools.json_scan import Malformed, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesParser(OutputParser):
    """Calls inside `<tool_call>` blocks; the text outside them is content, less the whitespace
    next to a block (it belongs to the markup). A block that names no function (closed, cut
    off, or not a JSON object) is content, markup and all; one that names a function is a
    call even when the output stops inside it (its arguments as far as they got)."""

    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out, pieces = ParsedOutput(), []
        pos, after_block = 0, False
        while True:
            start = text.find(START, pos)
            run = text[pos:] if start < 0 else text[pos:start]
            run = run.lstrip() if after_block else run
            if start < 0:
                pieces.append(held_tail(run, final, START))
                break
            pieces.append(run.rstrip())
            end = text.find(END, start + len(START))
            region = text[start + len(START):end] if end >= 0 else _open_region(text[start + len(START):])
            call, malformed = _call_in(region)
            if call is not None and call.name is not None:
                out.calls.append(call)
            elif end >= 0 or final or malformed:
                block = text[start:end + len(END)] if end >= 0 else text[start:]
                pieces.append(block if end >= 0 else held_tail(block, final, END))
            if end < 0:
                break
            pos, after_block = end + len(END), True
        out.content = "".join(pieces)
        return out


def _open_region(body: str) -> str:
    """A block's body while its end marker is not written: less a half-written end marker."""
    return body[:len(body) - partial_marker_len(body, END)]


def _call_in(region: str) -> tuple[PartialCall | None, bool]:
    """(the call the block's body holds so far or None, whether the body can never be one)."""
    j = skip_ws(region, 0)
    if j == len(region):
        return None, False
    if region[j] != "{":
        return None, True
    try:
        return read_call_object(region, j)[0], False
    except Malformed:
        return None, True
