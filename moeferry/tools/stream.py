"""One choice's output as OpenAI chat shapes: the deltas of a stream as its text grows, and
the whole message once it is done. Both come from the same parser over the same text, so a
stream's deltas join into exactly the non-streamed message (tools/base.py's contract)."""

from __future__ import annotations

import secrets
import string
import uuid

from moeferry.tools.base import OutputParser, ParsedOutput

_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    """`call_` and 24 hex digits, as OpenAI's ids look."""
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other id in the history."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


class OutputStream:
    """Parses one choice's growing text and says what is new since the last call.

    Invariants: content and reasoning deltas are the new ends of the parse's content and
    reasoning; a call appears first with its index, id, type and name (arguments ""), then
    only its argument fragments, in order; at most `max_calls` calls are reported (the first
    ones); with `declared` given, a call of a function not among those names is never
    reported (the request did not offer it); `message` of the whole text gives the same
    content, reasoning and calls (ids included) as the deltas sent joined."""

    def __init__(self, parser: OutputParser, new_id=openai_call_id, max_calls: int | None = None,
                 declared: frozenset[str] | None = None):
        self.parser, self.new_id, self.max_calls, self.declared = parser, new_id, max_calls, declared
        self.text = ""
        self.sent = ParsedOutput()
        self.ids: list[str] = []

    @property
    def called(self) -> bool:
        """Whether a tool call was reported (the finish_reason is then "tool_calls")."""
        return bool(self.ids)

    def push(self, text: str, final: bool) -> dict:
        """The delta fields (content, reasoning_content, tool_calls) new after `text`; {} when
        nothing is new. `final`: the text is complete, hold nothing back."""
        self.text += text
        parsed = self.parser.parse(self.text, final)
        delta = {}
        for key, now, before in (("content", parsed.content, self.sent.content),
                                 ("reasoning_content", parsed.reasoning, self.sent.reasoning)):
            if len(now) > len(before):
                delta[key] = now[len(before):]
        named = [c for c in parsed.named_calls() if self.declared is None or c.name in self.declared]
        calls = self._call_deltas(named[:self.max_calls])
        if calls:
            delta["tool_calls"] = calls
        self.sent = ParsedOutput(parsed.content, parsed.reasoning, named[:self.max_calls])
        return delta

    def _call_deltas(self, calls) -> list[dict]:
        out = []
        for index, call in enumerate(calls):
            known = index < len(self.sent.calls)
            sent = len(self.sent.calls[index].arguments) if known else 0
            if not known:
                self.ids.append(self.new_id())
                out.append({"index": index, "id": self.ids[index], "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > sent:
                out.append({"index": index, "function": {"arguments": call.arguments[sent:]}})
        return out

    def message(self, text: str) -> dict:
        """The whole answer `text` as an assistant message's fields: content (None when the
        answer is only calls), reasoning_content (when there is any), tool_calls (when any)."""
        self.push(text, final=True)
        parsed = self.sent
        fields = {"content": parsed.content if parsed.content or not parsed.calls else None}
        if parsed.reasoning:
            fields["reasoning_content"] = parsed.reasoning
        if parsed.calls:
            fields["tool_calls"] = [{"id": i, "type": "function",
                                     "function": {"name": c.name, "arguments": c.arguments}}
                                    for i, c in zip(self.ids, parsed.calls)]
        return fields
