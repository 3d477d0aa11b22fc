"""Turn trained weights into a checkpoint every loader reads: transformers' Qwen3-MoE layout
(config.json, model.safetensors in bfloat16, generation_config.json) beside the tokenizer."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def hf_config(arch, eos_token_id: int | None = None, pad_token_id: int | None = None):
    """The transformers Qwen3MoeConfig of an Architecture (every layer sparse)."""
    from transformers import Qwen3MoeConfig

    fields = dataclasses.asdict(arch)
    return Qwen3MoeConfig(**fields, intermediate_size=4 * arch.moe_intermediate_size, decoder_sparse_step=1,
                          mlp_only_layers=[], norm_topk_prob=True, eos_token_id=eos_token_id,
                          pad_token_id=pad_token_id, bos_token_id=None, torch_dtype="bfloat16")


def write_checkpoint(weights: dict[str, torch.Tensor], arch, out_dir: str, tokenizer_dir: str | None = None,
                     generation: dict | None = None) -> None:
    """Write ``weights`` (transformers' names; ``lm_head.weight`` left out, it is tied) as a
    bfloat16 checkpoint of ``arch`` in ``out_dir``, with the tokenizer files of
    ``tokenizer_dir`` and ``generation`` as generation_config.json."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    eos = pad = None
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer_dir, name)):
                shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
        eos, pad = tok.eos_token_id, tok.pad_token_id
    hf_config(arch, eos, pad).save_pretrained(out_dir)
    _add_legacy_keys(os.path.join(out_dir, "config.json"), arch)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items() if k != "lm_head.weight"}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if generation is not None:
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump(generation, f, indent=2)


def _add_legacy_keys(path: str, arch) -> None:
    """transformers 5 writes ``num_local_experts`` and ``rope_parameters``; older versions read
    ``num_experts`` and ``rope_theta`` (and would silently take their defaults): write both."""
    with open(path) as f:
        config = json.load(f)
    config.update(num_experts=arch.num_experts, rope_theta=arch.rope_theta)
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
