"""Model fixtures shared by tests/ and benchmarks/, so neither imports the other.

- Tiny random checkpoints of every supported family, made with transformers' own model
  classes and saved with save_pretrained, so moeferry is checked against code nobody here
  wrote (``family_configs``, ``make_checkpoint``).
- The Qwen3-30B-A3B config.json (``QWEN3_30B_DIR_CONFIG``) and a checkpoint directory holding
  only a config (``write_config_dir``): enough for ``--load-format dummy``, the shape the
  benchmarks measure; a tokenizer of any vocabulary size for it (``write_wide_tokenizer``),
  for what needs one (structured output's grammars).
"""

from __future__ import annotations

import json
import os

import torch

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.08, rms_norm_eps=1e-6, eos_token_id=None,
              bos_token_id=None, pad_token_id=None)

QWEN3_30B_DIR_CONFIG = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16", "eos_token_id": 151645,
    "bos_token_id": 151643, "attention_bias": False, "hidden_act": "silu",
}


def family_configs():
    """(name, config) pairs: each family, tied and untied heads, the family's own options."""
    import transformers as T

    return [
        ("qwen3_moe", T.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, head_dim=8, num_experts=8,
                                       num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                                       **COMMON)),
        ("qwen3_moe-tied-top4", T.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, head_dim=8,
                                                 num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
                                                 tie_word_embeddings=True, **COMMON)),
        ("mixtral", T.MixtralConfig(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                                    tie_word_embeddings=False, **COMMON)),
        ("mixtral-window", T.MixtralConfig(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                                           sliding_window=5, tie_word_embeddings=True, **COMMON)),
        ("olmoe", T.OlmoeConfig(intermediate_size=16, num_experts=12, num_experts_per_tok=3, tie_word_embeddings=False,
                                **COMMON)),
        ("qwen2_moe", T.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                       tie_word_embeddings=False, **COMMON)),
        ("qwen2_moe-dense-layer-tied", T.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=16,
                                                        shared_expert_intermediate_size=24, num_experts=8,
                                                        num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1],
                                                        tie_word_embeddings=True, **COMMON)),
    ]


def make_checkpoint(config, out_dir: str, seed: int = 0, shards: bool = False):
    """Save a random HF model of `config` to out_dir; returns the HF model (eval, float32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size="20KB" if shards else "5GB")
    return model


def write_config_dir(path: str, config: dict) -> str:
    """A checkpoint directory holding only config.json (enough for --load-format dummy)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def write_wide_tokenizer(path: str, vocab_size: int, seed: int = 0) -> str:
    """A byte-level BPE tokenizer of `vocab_size` tokens in `path` (tokenizer.json and
    tokenizer_config.json): the built-in model's 4,096 tokens (its special tokens and end
    token included), then merges of two random tokens of it, seeded, up to the size. Realistic
    enough pieces (words, spaces, punctuation, and their joins) for a grammar's token masks to
    cost what they cost at a real vocabulary of that size (Qwen3's 151,936); no network."""
    import random

    from moeferry.default_model import ensure_default_model

    builtin = ensure_default_model()
    with open(os.path.join(builtin, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    special = {t["content"] for t in spec["added_tokens"]}
    pieces = sorted(t for t in vocab if t not in special)
    rng = random.Random(seed)
    while len(vocab) < vocab_size:
        left, right = rng.choice(pieces), rng.choice(pieces)
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append([left, right])
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    with open(os.path.join(builtin, "tokenizer_config.json"), encoding="utf-8") as f:
        config = f.read()
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        f.write(config)
    return path
