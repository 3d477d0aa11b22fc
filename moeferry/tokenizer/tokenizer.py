"""Tokenizer: the checkpoint's HF tokenizer and chat template, and an incremental detokenizer."""

from __future__ import annotations

import logging

from moeferry.config import ConfigError, first_line

logger = logging.getLogger(__name__)


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer (tokenizer.json / tokenizer_config.json), or None if it has none."""
    import os

    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in files):
        logger.warning("no tokenizer files in %s: token ids only", model_dir)
        return None
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        logger.warning("no tokenizer in %s (%s): token ids only", model_dir, exc.__class__.__name__)
        return None


def apply_chat_template(tokenizer, messages: list[dict], tools: list[dict] | None = None, *,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        chat_template: str | None = None, template_kwargs: dict | None = None) -> list[int]:
    """The token ids of `messages` through the tokenizer's chat template (or `chat_template`),
    with the generation prompt (or, `continue_final_message`, the last message left open for the
    answer to continue), the OpenAI tool list `tools` when given (transformers' `tools=`), and
    `template_kwargs` as the template's own variables (enable_thinking, ...); ValueError (one
    line) when there is no template or it does not render them."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: chat needs one")
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model's tokenizer has no chat template")
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message,
                                            chat_template=chat_template, tokenize=True, **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - a Jinja template raises anything (raise_exception, a type error)
        raise ValueError(f"the chat template does not render: {first_line(exc)}") from None
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def use_chat_template(tokenizer, path: str) -> None:
    """Make the Jinja file at `path` the tokenizer's chat template (--chat-template), once it
    renders a one-message conversation; ConfigError (one line) otherwise."""
    if tokenizer is None:
        raise ConfigError(f"--chat-template {path}: this model has no tokenizer to apply it with")
    try:
        with open(path, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise ConfigError(f"--chat-template {path}: cannot read it: {first_line(exc)}") from None
    try:
        apply_chat_template(tokenizer, [{"role": "user", "content": "Hello"}])
    except ValueError as exc:
        raise ConfigError(f"--chat-template {path}: {exc}") from None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Invariant: `text` is the decoding of every id so far, except a trailing incomplete UTF-8
    sequence (shown as U+FFFD by the tokenizer), which is held back until it completes.
    Decodes only a window from `prefix_offset`, so each step costs O(window), not O(length).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def push(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""
