"""The built-in models, so `moeferry serve` and `moeferry generate` run on a fresh machine with
no download.

``moeferry-tiny-moe`` (the default): a 7 M-parameter Qwen3-MoE (6 layers, 32 experts, top-4)
trained on Jane Austen's novels; it writes English. Its checkpoint ships in
moeferry/builtin_model/ (model card: that folder's README.md; recipe: moeferry/training/).

``moeferry-tiny-random``: a smaller Qwen3-MoE with seeded random weights, made on first use
into a cache directory, for tests that want routing and logits with no structure.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "moeferry-tiny-moe"
RANDOM_MODEL_NAME = "moeferry-tiny-random"
BUILTIN_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin_model")
_VERSION = 2  # 2: the chat template renders tools

_CORPUS = """\
moeferry serves mixture of experts language models larger than the memory of the graphics card.
The experts live in pinned host memory; a cache of slots on the device holds the ones in use.
Each decode step admits its experts, copies the missing ones, and runs a grouped product over the slots.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is.
One two three four five six seven eight nine ten. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
user assistant system: you are a helpful assistant. Please answer the question briefly and clearly.
"""

# ChatML; with tools, Qwen's hermes-style block (a system message listing them in <tools>,
# assistant calls as <tool_call> JSON, tool results as <tool_response> in a user turn).
# Without tools it renders exactly as plain ChatML: every message as <|im_start|>role, content.
_CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] ~ '\n\n' }}
{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}
{{- '\n' ~ (tool | tojson) }}
{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if tools and loop.first and message['role'] == 'system' %}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}
{{- '<|im_start|>assistant' }}
{%- if message['content'] %}
{{- '\n' ~ message['content'] }}
{%- endif %}
{%- for call in message['tool_calls'] %}
{%- set call = call['function'] if call['function'] is defined else call %}
{{- '\n<tool_call>\n{"name": "' ~ call['name'] ~ '", "arguments": ' }}
{%- if call['arguments'] is string %}
{{- call['arguments'] }}
{%- else %}
{{- call['arguments'] | tojson }}
{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' ~ message['content'] ~ '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' ~ message['role'] ~ '\n' ~ message['content'] ~ '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def random_model_dir() -> str:
    root = os.environ.get("MOEFERRY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "moeferry")
    return os.path.join(root, f"moeferry-tiny-moe-v{_VERSION}")  # v2: the template with tools


def build_tokenizer(texts, out_dir: str, vocab_size: int):
    """The built-in models' tokenizer: byte-level BPE of `vocab_size` tokens trained on the
    strings `texts` (bytes are the fallback, so any text encodes), with the special tokens and
    ChatML template both built-in models share; saved in `out_dir` (tokenizer.json and
    tokenizer_config.json). The trained model's comes from its corpus (moeferry/training/)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _build_checkpoint(out_dir: str, tokenizer) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(1234)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # larger weights than HF's init, so routing and sampling are not flat
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir)


def ensure_default_model() -> str:
    """Path of the default (trained) checkpoint, shipped with the package."""
    if not os.path.isfile(os.path.join(BUILTIN_MODEL_DIR, "model.safetensors")):
        raise FileNotFoundError(f"the built-in model is missing from {BUILTIN_MODEL_DIR}: reinstall moeferry")
    return BUILTIN_MODEL_DIR


def ensure_random_model() -> str:
    """Path of the random checkpoint, made on first use (atomically: a half-written one is never seen)."""
    path = random_model_dir()
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    logger.info("making the built-in random model in %s (first use)", path)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".building-")
    tokenizer = build_tokenizer(_CORPUS.splitlines(), tmp, vocab_size=512)
    _build_checkpoint(tmp, tokenizer)
    with open(os.path.join(tmp, "moeferry_default.json"), "w") as f:
        json.dump({"name": RANDOM_MODEL_NAME, "version": _VERSION}, f)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def builtin_model_dir(name: str | None) -> str | None:
    """The folder of a built-in model's name (None and "" mean the default), else None."""
    if name in (None, "", DEFAULT_MODEL_NAME):
        return ensure_default_model()
    if name == RANDOM_MODEL_NAME:
        return ensure_random_model()
    return None


def builtin_model_name(model_dir: str) -> str | None:
    """The built-in name of a checkpoint folder, or None for any other folder."""
    real = os.path.realpath(model_dir)
    for name, path in ((DEFAULT_MODEL_NAME, BUILTIN_MODEL_DIR), (RANDOM_MODEL_NAME, random_model_dir())):
        if real == os.path.realpath(path):
            return name
    return None

