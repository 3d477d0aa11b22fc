"""What every output parser returns, and the pieces the family parsers share.

A parser reads a choice's whole text so far and says what it holds: the answer's content,
the reasoning (gpt-oss's analysis channel), and the tool calls. The contract that makes
streaming exact: for a text t and any prefix p of it, parse(p, final=False) is a prefix of
parse(t, final=True) - content and reasoning are prefixes, every call seen with a name keeps
it, and each call's arguments are a prefix of its final arguments. So the deltas between
successive parses (tools/stream.py) join into exactly the non-streamed answer. A parser holds
back what it cannot place yet (a marker half written, whitespace that may precede a call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from moeferry.tools.json_scan import Malformed, object_members, skip_ws


@dataclass(frozen=True)
class PartialCall:
    """A tool call as far as the text shows it: `name` None until the whole name is read;
    `arguments` the JSON text of its arguments so far (a prefix of the final one)."""

    name: str | None
    arguments: str


@dataclass
class ParsedOutput:
    """A choice's text split into what the OpenAI message carries."""

    content: str = ""
    reasoning: str = ""
    calls: list[PartialCall] = field(default_factory=list)

    def named_calls(self) -> list[PartialCall]:
        """The calls whose name is known: only those are reported (the rest are still held)."""
        return [c for c in self.calls if c.name is not None]


class OutputParser:
    """Reads a model's output text (see the module's contract). `keeps_special_tokens`: the
    syntax uses special tokens, so the text must be detokenized with them kept."""

    name = ""
    keeps_special_tokens = False

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError


def partial_marker_len(text: str, *markers: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of one of `markers`
    (a marker being written): that much must be held back."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def held_tail(text: str, final: bool, *markers: str) -> str:
    """A content run that no marker has ended yet: all of it once final; before that, less a
    half-written marker and trailing whitespace (both may turn out to open a call)."""
    if final:
        return text
    return text[:len(text) - partial_marker_len(text, *markers)].rstrip()


def read_call_object(text: str, i: int) -> tuple[PartialCall, int | None]:
    """The call in the JSON object opening at text[i], `{"name": ..., "arguments": {...}}` (or
    "parameters", the key of the JSON tool_choice="required" asks for), and
    the index past the object (None while open). Arguments written as an object or array are
    their own text, streamable as it grows; written as a string (some models quote them) they
    are its value once the string closes; left out, "{}" once the object closes. When the
    object breaks JSON's syntax, Malformed, unless the name was read before the break: then the
    call as it stood there (a call once named stays one), with its end None."""
    try:
        members, end = object_members(text, i)
    except Malformed as exc:
        members, end = object_members(text[:exc.at], i)
        call = _call_of(text[:exc.at], members, closed=False)
        if call.name is None:
            raise
        return call, None
    return _call_of(text, members, closed=end is not None), end


def _call_of(text: str, members, closed: bool) -> PartialCall:
    by_key = {m.key: m for m in members}
    name = None
    if "name" in by_key and by_key["name"].end is not None:
        name = json.loads(text[by_key["name"].start:by_key["name"].end])
        if not isinstance(name, str) or not name:
            raise Malformed("a tool call's name must be a non-empty string", by_key["name"].start)
    arg = next((by_key[k] for k in ("arguments", "parameters") if k in by_key), None)
    return PartialCall(name, _arguments_text(text, arg, closed))


def _arguments_text(text: str, arg, closed: bool) -> str:
    if arg is None:
        return "{}" if closed else ""
    raw = text[arg.start:arg.end] if arg.end is not None else text[arg.start:]
    if text[arg.start] in "{[":
        return raw
    if arg.end is None:
        return ""
    try:
        value = json.loads(raw)
    except ValueError:  # a number or literal _SCALAR let through that JSON does not read
        return raw
    return value if isinstance(value, str) else raw


def read_call_list(text: str, i: int) -> list[PartialCall]:
    """The calls written from text[i] on as a JSON array of call objects, or as call objects one
    after another. Malformed when the first call is not one; after that, a break ends the list
    where it stands."""
    calls: list[PartialCall] = []
    j = skip_ws(text, i)
    in_array = j < len(text) and text[j] == "["
    if in_array:
        j = skip_ws(text, j + 1)
    while j < len(text):
        if in_array and text[j] == "]":
            return calls
        try:
            if text[j] != "{":
                raise Malformed(f"expected a call object, got {text[j]!r}", j)
            call, end = read_call_object(text, j)
        except Malformed:
            if not calls:
                raise
            return calls
        calls.append(call)
        if end is None:
            return calls
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
    return calls
