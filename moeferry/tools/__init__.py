"""Tool calling: one output parser per model family's tool-call syntax, in a registry, and
what a chat request's `tools` and `tool_choice` make of its prompt and its output (plan.py).

Parsers read a choice's text (base.py states the contract that makes streamed deltas join
into exactly the non-streamed answer); stream.py turns successive parses into OpenAI deltas.
`--tool-call-parser NAME` (vLLM's flag and names) picks one; by default the model family's.
"""

from __future__ import annotations

import importlib

from moeferry.tools.base import OutputParser, ParsedOutput, PartialCall

_PARSERS = {
    "hermes": "moeferry.tools.hermes:HermesParser",
    "mistral": "moeferry.tools.mistral:MistralParser",
    "deepseek_v3": "moeferry.tools.deepseek_v3:DeepSeekV3Parser",
    "openai": "moeferry.tools.harmony:HarmonyParser",
}

# The parser of each model family (config.json's model_type): Qwen's ChatML templates (and
# the built-in model's) write <tool_call>; OLMoE is served through ChatML as well.
FAMILY_PARSERS = {"qwen3_moe": "hermes", "qwen2_moe": "hermes", "olmoe": "hermes", "mixtral": "mistral",
                  "deepseek_v3": "deepseek_v3", "gpt_oss": "openai"}


def parser_names() -> list[str]:
    return list(_PARSERS)


def parser_class(name: str) -> type[OutputParser]:
    """The parser registered under `name` (KeyError naming the choices otherwise)."""
    if name not in _PARSERS:
        raise KeyError(f"no tool-call parser {name!r}; choose one of {', '.join(_PARSERS)}")
    module, cls = _PARSERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def family_parser(model_type: str, chosen: str | None = None) -> str | None:
    """The parser's name for a model: `chosen` (--tool-call-parser) when given, else the
    family's, else None (the output is never parsed for calls)."""
    return chosen if chosen is not None else FAMILY_PARSERS.get(model_type)


__all__ = ["OutputParser", "ParsedOutput", "PartialCall", "FAMILY_PARSERS", "family_parser", "parser_class",
           "parser_names"]
