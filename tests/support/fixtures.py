"""Model fixtures shared by tests/ and benchmarks/, so neither imports the other.

- Tiny random checkpoints of every supported family, made with transformers' own model
  classes and saved with save_pretrained, so moeferry is checked against code nobody here
  wrote (``family_configs``, ``make_checkpoint``).
- The Qwen3-30B-A3B, DeepSeek-V3 and gpt-oss-20b config.json (``QWEN3_30B_DIR_CONFIG``,
  ``DEEPSEEK_V3_DIR_CONFIG``, ``GPT_OSS_20B_DIR_CONFIG``) and a checkpoint directory holding
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

# DeepSeek-V3's config.json (bf16: its FP8 quantization_config left out), for dummy loads.
DEEPSEEK_V3_DIR_CONFIG = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0,
    "eos_token_id": 1, "attention_bias": False,
}

# gpt-oss-20b's config.json in its dequantized bf16 form (the release's MXFP4 quantization_config
# left out), for dummy loads: 24 layers alternating a 128-token window and full attention, 64
# heads of 64 over 8 kv heads, 32 experts of 2880 rows with biases, top-4.
GPT_OSS_20B_DIR_CONFIG = {
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "initial_context_length": 4096, "rms_norm_eps": 1e-5,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "rope_theta": 150000, "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False,
    "hidden_act": "silu", "router_aux_loss_coef": 0.9, "output_router_logits": False, "eos_token_id": 200002,
    "pad_token_id": 199999, "torch_dtype": "bfloat16", "use_cache": True,
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
    ] + deepseek_configs() + gpt_oss_configs()


def gpt_oss_configs():
    """(name, config) pairs of gpt-oss shapes: sliding-window layers (a window of 4, shorter
    than the test prompts) alternating with full ones, sinks, biases on attention, router and
    experts, YaRN; a SwiGLU limit low enough that the tiny experts clamp both ways (the released
    7.0 with these weights would never clamp), and one with the released alpha and limit, tied
    embeddings and the layers' order reversed (full first). Weights wider than COMMON's: at its
    0.08 greedy decoding repeats two or three tokens, at 0.3 it wanders over 15-20."""
    import transformers as T

    base = dict(COMMON, initializer_range=0.3, num_hidden_layers=4, head_dim=8, intermediate_size=16, num_local_experts=8,
                sliding_window=4, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                   "beta_slow": 1.0, "truncate": False})
    return [
        ("gpt_oss", T.GptOssConfig(num_experts_per_tok=2, swiglu_limit=0.4, tie_word_embeddings=False, **base)),
        ("gpt_oss-full-first-tied", T.GptOssConfig(num_experts_per_tok=3, tie_word_embeddings=True,
                                                   layer_types=["full_attention", "sliding_attention"] * 2, **base)),
    ]


def deepseek_configs():
    """(name, config) pairs of DeepSeek-V3 and -V2 shapes: q_lora_rank or none (V2-Lite), YaRN,
    interleaved or plain rope pairs, sigmoid grouped routing with its bias, V2's softmax
    greedy and group-limited routers, dense first layers, shared experts, routed scaling.
    v_head_dim differs from qk_nope_head_dim, so a mixed-up width fails."""
    import transformers as T

    mla = dict(COMMON, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
               intermediate_size=48, moe_intermediate_size=16, first_k_dense_replace=1, tie_word_embeddings=False)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    return [
        ("deepseek_v3", T.DeepseekV3Config(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                           topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                                           norm_topk_prob=True, **mla)),
        ("deepseek_v3-yarn-plain-rope", T.DeepseekV3Config(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
                                                           n_group=2, topk_group=1, n_shared_experts=2,
                                                           routed_scaling_factor=1.5, norm_topk_prob=False,
                                                           rope_interleave=False, rope_parameters=yarn,
                                                           attention_bias=True, **mla)),
        ("deepseek_v2-lite", T.DeepseekV2Config(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
                                                n_shared_experts=2, routed_scaling_factor=1.0, topk_method="greedy",
                                                norm_topk_prob=False, **mla)),
        ("deepseek_v2-group-limited-yarn", T.DeepseekV2Config(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
                                                              n_group=4, topk_group=2, n_shared_experts=1,
                                                              routed_scaling_factor=2.0, norm_topk_prob=False,
                                                              topk_method="group_limited_greedy", rope_parameters=yarn,
                                                              **mla)),
    ]


def _randomize_zero_buffers(model, seed: int) -> None:
    """DeepSeek-V3's e_score_correction_bias starts at zero in transformers, and gpt-oss's
    attention and expert biases; random values make the checks see them (the correction bias
    changes which experts are chosen, not their weights)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
        if model.config.model_type == "gpt_oss":
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def _declared_swiglu(model, config) -> None:
    """A gpt-oss model clamps with the SwiGLU alpha and limit its config declares, as the engine
    reads them (models/gpt_oss.py: the released values where it declares none): transformers
    versions that hard-code those two in the experts ignore a config's own. Elsewhere this
    changes nothing."""
    if getattr(config, "model_type", None) != "gpt_oss":
        return
    from moeferry.models.gpt_oss import SPEC

    declared = SPEC.activation(config)
    for layer in model.model.layers:
        layer.mlp.experts.alpha, layer.mlp.experts.limit = declared.alpha, declared.limit


def make_checkpoint(config, out_dir: str, seed: int = 0, shards: bool = False):
    """Save a random HF model of `config` to out_dir; returns the HF model (eval, float32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    _randomize_zero_buffers(model, seed)
    _declared_swiglu(model, config)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size="20KB" if shards else "5GB")
    return model


def make_checkpoint_with_builtin_tokenizer(config, out_dir: str, seed: int = 0):
    """`make_checkpoint` of `config` at the built-in model's vocabulary, with its tokenizer and
    chat template copied in: a tiny checkpoint of any family that `generate` and `serve` can
    take text for. Returns the HF model."""
    import shutil

    from moeferry.default_model import builtin_model_dir

    tokenizer_dir = builtin_model_dir("moeferry-tiny-moe")
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    model = make_checkpoint(type(config)(**{**config.to_dict(), "vocab_size": vocab}), out_dir, seed=seed)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
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


def _fp8_quantized(tensors: dict, block_shape) -> dict:
    """Every projection weight (2-D `*_proj*.weight`: attention, DeepSeek's
    `kv_a_proj_with_mqa` included, dense MLP, shared and routed experts) as float8 with its
    `weight_scale_inv`; embeddings, norms, the router and the head stay as they are, as Qwen3's
    and DeepSeek-V3's FP8 releases leave them."""
    from moeferry.moe.formats import quantize_fp8_blocks

    out = {}
    for name, tensor in tensors.items():
        if "_proj" in name.rsplit(".", 2)[-2] and name.endswith(".weight") and tensor.dim() == 2:
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(tensor, block_shape)
        else:
            out[name] = tensor
    return out


def _int4_packed(tensors: dict, group_size: int) -> dict:
    """Every projection weight as compressed-tensors' pack-quantized int4 (`weight_packed` from
    compressed-tensors' own pack_to_int32, `weight_scale` in bfloat16, `weight_shape`), the rest
    as it is, as llm-compressor's W4A16 checkpoints leave it."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from moeferry.kernels.fused_moe.reference import unpack_int4
    from moeferry.moe.formats import quantize_int4_groups

    out = {}
    for name, tensor in tensors.items():
        if not (name.endswith("_proj.weight") and tensor.dim() == 2):
            out[name] = tensor
            continue
        packed, scales = quantize_int4_groups(tensor, group_size)
        base = name.removesuffix(".weight")
        out[base + ".weight_packed"] = pack_to_int32(unpack_int4(packed, tensor.shape[1]).to(torch.int8), 4)
        out[base + ".weight_scale"] = scales.to(torch.bfloat16)
        out[base + ".weight_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int64)
    return out


def _rewrite_checkpoint(out_dir: str, transform, quantization_config: dict) -> None:
    """Each safetensors file of out_dir through `transform` (name -> tensor dict), the index's
    weight map following, and `quantization_config` written into config.json."""
    from safetensors.torch import load_file, save_file

    weight_map = {}
    for file in [n for n in os.listdir(out_dir) if n.endswith(".safetensors")]:
        path = os.path.join(out_dir, file)
        tensors = transform(load_file(path))
        save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
    index_path = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"] = weight_map
        with open(index_path, "w") as f:
            json.dump(index, f)
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        raw = json.load(f)
    raw["quantization_config"] = quantization_config
    with open(config_path, "w") as f:
        json.dump(raw, f)


def make_fp8_checkpoint(config, out_dir: str, seed: int = 0, block_shape=(16, 16), shards: bool = False):
    """A block-FP8 checkpoint in the layout of DeepSeek-V3 / Qwen3 FP8 releases: a random HF
    model of `config` saved by transformers, its projection weights then quantized file by file
    (float8_e4m3fn + float32 `weight_scale_inv` per `block_shape` block), and config.json's
    `quantization_config` saying so. Returns the unquantized HF model (eval, float32)."""
    model = make_checkpoint(config, out_dir, seed=seed, shards=shards)
    _rewrite_checkpoint(out_dir, lambda tensors: _fp8_quantized(tensors, block_shape),
                        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": list(block_shape)})
    return model


def make_int4_checkpoint(config, out_dir: str, seed: int = 0, group_size: int = 16, shards: bool = False):
    """A W4A16 checkpoint in compressed-tensors' pack-quantized layout (llm-compressor's output):
    a random HF model of `config` saved by transformers, its projection weights then quantized
    to symmetric int4 groups of `group_size` and packed by compressed-tensors. Returns the
    unquantized HF model (eval, float32)."""
    model = make_checkpoint(config, out_dir, seed=seed, shards=shards)
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
               "dynamic": False, "observer": "minmax"}
    _rewrite_checkpoint(out_dir, lambda tensors: _int4_packed(tensors, group_size),
                        {"quant_method": "compressed-tensors", "format": "pack-quantized",
                         "quantization_status": "compressed", "ignore": ["lm_head", "re:.*mlp.gate$"],
                         "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                       "input_activations": None, "output_activations": None}}})
    return model


def mxfp4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's MXFP4 tensors of stacked expert weights [E, rows, K] (K a multiple of 32):
    `*_blocks` uint8 [E, rows, K/32, 16] and `*_scales` uint8 [E, rows, K/32], as transformers'
    Mxfp4 integration reads them."""
    from moeferry.moe.formats import quantize_mxfp4

    packed, scales = quantize_mxfp4(weight)
    return packed.view(*scales.shape, 16), scales


def _mxfp4_stacked(tensors: dict, interleaved: bool) -> dict:
    """Every layer's routed experts (`mlp.experts.{e}.{gate,up,down}_proj.weight`) stacked in
    gpt-oss's MXFP4 layout: `mlp.experts.gate_up_proj_blocks` / `_scales` (gate rows then up
    rows, or alternating when `interleaved`) and `mlp.experts.down_proj_blocks` / `_scales`;
    the rest as it is."""
    import re

    pattern = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    out, experts = {}, {}
    for name, tensor in tensors.items():
        m = pattern.match(name)
        if m is None:
            out[name] = tensor
        else:
            experts.setdefault(m.group(1), {})[(m.group(3), int(m.group(2)))] = tensor
    for prefix, parts in experts.items():
        count = len(parts) // 3
        gate, up, down = (torch.stack([parts[(kind, e)] for e in range(count)]) for kind in ("gate", "up", "down"))
        gate_up = torch.stack([gate, up], dim=2).flatten(1, 2) if interleaved else torch.cat([gate, up], dim=1)
        for proj, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
            out[f"{prefix}.{proj}_blocks"], out[f"{prefix}.{proj}_scales"] = mxfp4_blocks(weight)
    return out


def make_mxfp4_checkpoint(config, out_dir: str, seed: int = 0, interleaved: bool = False):
    """A checkpoint whose routed experts are stacked in gpt-oss's MXFP4 layout (`*_blocks`,
    `*_scales`; see `_mxfp4_stacked`) and config.json's `quantization_config` saying
    `quant_method: mxfp4`: a random HF model of `config` saved by transformers, rewritten. The
    experts' sizes must be multiples of 32. Returns the unquantized HF model (eval, float32)."""
    model = make_checkpoint(config, out_dir, seed=seed)
    _rewrite_checkpoint(out_dir, lambda tensors: _mxfp4_stacked(tensors, interleaved), {"quant_method": "mxfp4"})
    return model
