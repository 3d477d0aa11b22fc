"""DeepSeek-V3's tool-call tokens. Content, then the calls between `<｜tool▁calls▁begin｜>` and
`<｜tool▁calls▁end｜>`, each `<｜tool▁call▁begin｜>HEAD<｜tool▁sep｜>REST<｜tool▁call▁end｜>` in one
of two forms: V3 and R1 write HEAD `function` and REST the name, a newline and the arguments
in a ```json fence; V3.1 writes HEAD the name and REST the arguments' JSON."""

from __future__ import annotations

from moeferry.tools.base import OutputParser, ParsedOutput, PartialCall, held_tail, partial_marker_len
from moeferry.tools.json_scan import Malformed, skip_ws, value_end

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```json"


class DeepSeekV3Parser(OutputParser):
    """The text before the calls is content (less the whitespace before them); a call is
    reported once its name is whole; what cannot be a call ends the calls where they stand
    (a call whose arguments break keeps them as far as they were JSON)."""

    name = "deepseek_v3"
    keeps_special_tokens = True  # its tool tokens are added tokens: kept in the text whether special or not

    def parse(self, text: str, final: bool) -> ParsedOutput:
        at = text.find(CALLS_BEGIN)
        if at < 0:
            return ParsedOutput(content=held_tail(text, final, CALLS_BEGIN))
        calls, pos = [], at + len(CALLS_BEGIN)
        while pos is not None:
            pos = skip_ws(text, pos)
            if not text.startswith(CALL_BEGIN, pos):
                break
            call, pos = _read_call(text, pos + len(CALL_BEGIN))
            if call is None or not call.name:  # not whole yet, or naming nothing: the calls end here
                break
            calls.append(call)
        return ParsedOutput(content=text[:at].rstrip(), calls=calls)


def _read_call(text: str, pos: int) -> tuple[PartialCall | None, int | None]:
    """The call whose head starts at `pos`, and the index past its end marker (None while
    open or broken); (None, None) while its name is not whole."""
    sep = text.find(SEP, pos)
    if sep < 0:
        return None, None
    head, rest = text[pos:sep], sep + len(SEP)
    if head.strip() != "function":
        return _with_arguments(text, head.strip(), skip_ws(text, rest))
    newline = text.find("\n", rest)
    if newline < 0:
        return None, None
    name, fence = text[rest:newline].strip(), skip_ws(text, newline)
    if not text.startswith(FENCE, fence):  # still being written, or not the V3 form: no arguments
        return PartialCall(name, ""), None
    return _with_arguments(text, name, skip_ws(text, fence + len(FENCE)))


def _with_arguments(text: str, name: str, start: int) -> tuple[PartialCall, int | None]:
    """The call named `name` with the arguments' JSON from `start` as far as written, and the
    index past its end marker (None while open)."""
    if start == len(text) or text[start] not in "{[":
        return PartialCall(name, ""), None
    try:
        end = value_end(text, start)
    except Malformed as exc:
        return PartialCall(name, text[start:exc.at]), None
    if end is None:
        body = text[start:]
        return PartialCall(name, body[:len(body) - partial_marker_len(body, CALL_END)]), None
    close = text.find(CALL_END, end)
    return PartialCall(name, text[start:end]), None if close < 0 else close + len(CALL_END)
