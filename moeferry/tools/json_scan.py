"""How far a JSON value reaches in a text that may stop part-way (a model's output as it
streams): where a value ends, and the members of an object as far as they are written.

Nothing here builds the values: a tool call's arguments are handed on as the model's own JSON
text, so a streamed call's argument fragments join into exactly the text of the whole call.
The scan is left to right, so a text found malformed stays malformed however it goes on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SCALAR = re.compile(r"[-+0-9.eEtrufalsn]+")  # numbers, true, false, null (checked by json.loads later)


class Malformed(ValueError):
    """The text cannot be the start of what was expected, whatever follows; `at` is the index
    of the first character at fault (text[:at] is still a possible start)."""

    def __init__(self, message: str, at: int):
        super().__init__(message)
        self.at = at


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Past the closing quote of the JSON string opening at text[i], or None while it is open."""
    match = _STRING.match(text, i)
    return match.end() if match else None


def value_end(text: str, i: int) -> int | None:
    """Past the JSON value starting at text[i] (not whitespace), or None when the text stops
    first; Malformed when text[i] cannot start a value or a bracket closes the wrong one. A
    number or literal ends only at a character after it (it could still grow)."""
    first = text[i]
    if first == '"':
        return string_end(text, i)
    if first in "{[":
        return _container_end(text, i)
    match = _SCALAR.match(text, i)
    if match is None:
        raise Malformed(f"a JSON value cannot start with {first!r}", i)
    return match.end() if match.end() < len(text) else None


def _container_end(text: str, i: int) -> int | None:
    closers = []
    j = i
    while j < len(text):
        ch = text[j]
        if ch == '"':
            j = string_end(text, j)
            if j is None:
                return None
            continue
        if ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not closers or closers.pop() != ch:
                raise Malformed(f"{ch!r} closes nothing open", j)
            if not closers:
                return j + 1
        j += 1
    return None


@dataclass(frozen=True)
class Member:
    """One `key: value` of an object: the value's text is text[start:end]; `end` is None while
    the value is still being written (then the value runs to the end of the text)."""

    key: str
    start: int
    end: int | None


def object_members(text: str, i: int) -> tuple[list[Member], int | None]:
    """The members of the JSON object opening at text[i] ("{") as far as written, and the
    index past its closing brace (None while it is open); Malformed on broken syntax."""
    members: list[Member] = []
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        return members, j + 1
    while j < len(text):
        if text[j] != '"':
            raise Malformed(f"expected a key, got {text[j]!r}", j)
        key_end = string_end(text, j)
        if key_end is None:
            return members, None
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            raise Malformed("a key is not a valid JSON string", j) from None
        j = skip_ws(text, key_end)
        if j == len(text):
            return members, None
        if text[j] != ":":
            raise Malformed(f"expected ':', got {text[j]!r}", j)
        j = skip_ws(text, j + 1)
        if j == len(text):
            return members, None
        end = value_end(text, j)
        members.append(Member(key, j, end))
        if end is None:
            return members, None
        j = skip_ws(text, end)
        if j == len(text):
            return members, None
        if text[j] == "}":
            return members, j + 1
        if text[j] != ",":
            raise Malformed(f"expected ',' or '}}', got {text[j]!r}", j)
        j = skip_ws(text, j + 1)
    return members, None
