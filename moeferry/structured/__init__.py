"""Structured output: what a request's text must match (a JSON schema, any JSON object, a regex,
one of a list of strings), compiled to a grammar over the model's vocabulary by xgrammar, and
per request a matcher that says, before each token, which tokens keep the text inside it.

    Constraint (request side: server/protocol.py, SamplingParams.structured)
      -> GrammarCompiler.compile (once per distinct constraint: xgrammar caches it)
      -> GrammarMatcher, held by the Request: its state is the tokens generated so far
      -> TokenMasks.fill: a packed bitmask per constrained row, on the host
      -> the device sampler sets the other tokens' logits to -inf (kernels/sampling)

xgrammar was chosen by measurement over llguidance and outlines-core: a JSON-schema mask over
a 151,936-token vocabulary took about 11 us (median; 55 us at the 90th percentile) where
llguidance took up to 100 ms inside object keys and outlines-core 1.5 s to compile each schema
(the commit that added the dependency has the table).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeferry.errors import InvalidRequest
from moeferry.structured.schema_check import check_regex, check_schema

__all__ = ["KINDS", "Constraint", "json_schema_constraint", "GrammarCompiler", "GrammarMatcher", "ReasoningGate",
           "ReasoningTags", "TokenMasks"]

KINDS = ("json_schema", "json_object", "regex", "choice")
MAX_CHOICES = 256  # strings of one choice constraint
MAX_CHOICE_CHARS = 4096  # one of them
MAX_CHOICES_CHARS = 1 << 14  # all of them: the compile's time grows with the square of this
MAX_SPEC_CHARS = 1 << 16  # a schema's JSON text, or a regex
GRAMMAR_CACHE_BYTES = 256 << 20  # compiled grammars kept for reuse (xgrammar's LRU); distinct schemas are unbounded


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. `kind` is one of KINDS; `spec` is the schema as
    canonical JSON text (json_schema), "" (json_object: any JSON object), the pattern (regex,
    the whole output must match it), or the strings (choice, a tuple: the output is one of them).
    `param` names the request field it came from, for error messages. A json_schema's output
    may be framed by fixed text: `prefix` before the JSON value and `suffix` after it (a tool
    call's markup, for example Qwen's "<tool_call>\n" and "\n</tool_call>").

    Invariant: hashable and compared by value, so equal constraints share one compiled grammar.
    """

    kind: str
    spec: str | tuple[str, ...]
    param: str = "response_format"
    prefix: str = ""
    suffix: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequest(f"unknown structured output kind {self.kind!r}; expected one of {KINDS}", self.param)
        if self.kind == "choice":
            if not self.spec or len(self.spec) > MAX_CHOICES or not all(isinstance(c, str) and c for c in self.spec):
                raise InvalidRequest(f"a choice needs 1 to {MAX_CHOICES} non-empty strings", self.param)
            longest, total = max(map(len, self.spec)), sum(map(len, self.spec))
            if longest > MAX_CHOICE_CHARS or total > MAX_CHOICES_CHARS:
                raise InvalidRequest(f"a choice string has at most {MAX_CHOICE_CHARS} characters and all of them "
                                     f"{MAX_CHOICES_CHARS} together; got {longest} and {total}", self.param)
        elif not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequest(f"the {self.kind} must be a string of at most {MAX_SPEC_CHARS} characters",
                                 self.param)
        elif self.kind == "regex":
            check_regex(self.spec, self.param)
        if (self.prefix or self.suffix) and self.kind != "json_schema":
            raise InvalidRequest("only a json_schema constraint takes a prefix or a suffix", self.param)


def json_schema_constraint(schema: dict | str, param: str = "response_format", prefix: str = "",
                           suffix: str = "") -> Constraint:
    """The Constraint that the output is a JSON value valid under `schema` (a dict or its JSON
    text), framed by the fixed texts `prefix` and `suffix`: what response_format json_schema
    asks, and what tool_choice "required" or a named function needs (the call as JSON, say
    {"name": {"const": ...}, "arguments": <the function's parameters>}, an "anyOf" of them for
    several functions, inside the model's tool-call markup)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequest(f"the JSON schema is not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict):
        raise InvalidRequest("the JSON schema must be a JSON object", param)
    # key order kept: the grammar emits an object's properties in the order the schema lists them
    constraint = Constraint("json_schema", json.dumps(schema, separators=(",", ":")), param, prefix, suffix)
    check_schema(schema, param)  # after the size bound
    return constraint


_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _one_line(exc: Exception) -> str:
    """xgrammar's error without its time stamp and C++ source location, on one line."""
    text = " ".join(str(exc).split())
    return _XGRAMMAR_PREFIX.sub("", text) or exc.__class__.__name__


class GrammarCompiler:
    """Compiles Constraints for one tokenizer and vocabulary.

    Invariants: a constraint's grammar allows exactly the token sequences whose text matches
    it, then one of `stop_token_ids` (the model's end tokens: the only tokens it allows once
    the text is complete, and none of them before); JSON is compact (", " and ": " between
    items, no other whitespace), so a model cannot wander in whitespace. Thread-safe: the
    server compiles in worker threads (to refuse a bad schema with a 400 before the engine
    sees it, and to warm xgrammar's cache), the engine thread then finds the grammar cached.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=self.stop_token_ids)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)

    @property
    def mask_words(self) -> int:
        """int32 words of one row's token bitmask: ceil(vocab / 32)."""
        return -(-self.vocab_size // 32)

    def compile(self, constraint: Constraint):
        """The xgrammar CompiledGrammar of `constraint`; InvalidRequest naming its field, with a
        one-line reason, when it cannot be compiled (an unsupported schema, a bad regex)."""
        try:
            return self._compile(constraint)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequest(f"{constraint.param}: cannot compile the {constraint.kind.replace('_', ' ')}: "
                                 f"{_one_line(exc)}", constraint.param) from None

    def _compile(self, c: Constraint):
        if c.kind == "json_schema" and (c.prefix or c.suffix):
            grammar = self._xgr.Grammar
            parts = [grammar.from_ebnf(f"root ::= {json.dumps(c.prefix)}")] if c.prefix else []
            parts.append(grammar.from_json_schema(c.spec, any_whitespace=False, strict_mode=True))
            parts += [grammar.from_ebnf(f"root ::= {json.dumps(c.suffix)}")] if c.suffix else []
            return self._compiler.compile_grammar(grammar.concat(*parts))
        if c.kind == "json_schema":
            return self._compiler.compile_json_schema(c.spec, any_whitespace=False, strict_mode=True)
        if c.kind == "json_object":
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if c.kind == "regex":
            return self._compiler.compile_regex(c.spec)
        # choice: an EBNF alternation of the strings as JSON-escaped literals (ASCII escapes)
        return self._compiler.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in c.spec))

    def matcher(self, constraint: Constraint) -> "GrammarMatcher":
        return GrammarMatcher(self._xgr.GrammarMatcher(self.compile(constraint)), constraint)


class GrammarMatcher:
    """The grammar state of one request: the tokens it generated so far, fed in order.

    Invariants: `accept` is called once per generated token, in order, and only here: a
    preempted request keeps its matcher (its recomputed prefix is not fed again); after
    `finished` the request must stop (the grammar took an end token, or allows nothing more).
    """

    def __init__(self, matcher, constraint: Constraint):
        self.xgrammar_matcher, self.constraint = matcher, constraint

    def accept(self, token: int) -> bool:
        """Advance by one generated token; False when the grammar does not allow it (the mask
        should have made that impossible)."""
        return bool(self.xgrammar_matcher.accept_token(token))

    @property
    def finished(self) -> bool:
        return bool(self.xgrammar_matcher.is_terminated())

    constrains = True  # the next token is masked (ReasoningGate's is not while the model reasons)

    def fill(self, masks: torch.Tensor, row: int) -> None:
        """Row `row` of the int32 bitmask `masks` [rows, W] (CPU) := the tokens allowed next."""
        self.xgrammar_matcher.fill_next_token_bitmask(masks, row)

    def widen(self, masks: torch.Tensor, row: int) -> None:
        """Allow more than the grammar in row `row`, after `fill` (ReasoningGate's start tag)."""


@dataclass(frozen=True)
class ReasoningTags:
    """The token ids that open and close a model's reasoning (<think>, </think>), and whether
    the prompt opened it already: a constraint then applies to the answer after the close."""

    start: int
    end: int
    opened: bool = False


class ReasoningGate:
    """A GrammarMatcher held off while the model reasons, so structured output applies to the
    answer after the reasoning. States: undecided (the first token: the grammar's tokens or the
    start tag), reasoning (no mask, until the end tag), answer (the grammar's, from the next
    token). Invariant: the grammar is fed exactly the answer's tokens."""

    def __init__(self, inner: GrammarMatcher, tags: ReasoningTags):
        self.inner, self.tags = inner, tags
        self.xgrammar_matcher = inner.xgrammar_matcher
        self.state = "reasoning" if tags.opened else "undecided"

    @property
    def constrains(self) -> bool:
        return self.state != "reasoning"

    def accept(self, token: int) -> bool:
        if self.state == "reasoning":
            if token == self.tags.end:
                self.state = "answer"
            return True
        if self.state == "undecided":
            if token == self.tags.start:
                self.state = "reasoning"
                return True
            self.state = "answer"
        return self.inner.accept(token)

    @property
    def finished(self) -> bool:
        return self.state == "answer" and self.inner.finished

    def fill(self, masks: torch.Tensor, row: int) -> None:
        self.inner.fill(masks, row)
        self.widen(masks, row)

    def widen(self, masks: torch.Tensor, row: int) -> None:
        if self.state == "undecided":
            word, bit = divmod(self.tags.start, 32)
            value = 1 << bit
            masks[row, word] |= value - (1 << 32) if value >= 1 << 31 else value  # as an int32


class TokenMasks:
    """Host staging of one sampler call's token masks: `words` [rows, W] int32 and `flags`
    [rows] int32 (1: the row is constrained), pinned when the device is a GPU so the copy to
    the sampler's static device buffers is asynchronous.

    Invariant: `fill` writes every row it is asked for: a constrained row's mask and flag 1, any
    other row flag 0 (its words are then never read).
    """

    def __init__(self, rows: int, words: int, pinned: bool):
        self.words = torch.zeros((rows, words), dtype=torch.int32, pin_memory=pinned)
        self.flags = torch.zeros(rows, dtype=torch.int32, pin_memory=pinned)
        self._batch = None  # xgrammar.BatchGrammarMatcher, made at the first call of 2+ constrained rows

    def fill(self, matchers: Sequence[GrammarMatcher | None]) -> bool:
        """Rows [0, len(matchers)): each matcher's next-token mask (two or more at once on
        xgrammar's threads); True when any is constrained."""
        flags = self.flags.numpy()
        rows = []
        for row, matcher in enumerate(matchers):
            flags[row] = matcher is not None and matcher.constrains
            if flags[row]:
                rows.append(row)
        if len(rows) == 1:
            matchers[rows[0]].fill(self.words, rows[0])
        elif rows:
            if self._batch is None:
                import xgrammar

                self._batch = xgrammar.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([matchers[r].xgrammar_matcher for r in rows], self.words,
                                                      indices=rows)
            for row in rows:
                matchers[row].widen(self.words, row)
        return bool(rows)
