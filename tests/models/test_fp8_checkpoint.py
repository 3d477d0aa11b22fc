"""Block-FP8 experts end to end (CPU, float32 reference path): a tiny Qwen3-MoE checkpoint in the
layout of the FP8 releases (made here: transformers saves a random model, its projections then
quantized with float32 `weight_scale_inv` per block) against transformers loading the same
checkpoint dequantized; every strategy bit-identical on it; `--quantization fp8` of a bf16
checkpoint against transformers over the same dequantized experts; the format and bytes per
expert in the memory plan and the statistics."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError
from moeferry.engine.loader import LoadError
from moeferry.kernels.fused_moe.reference import dequantize_blocks
from moeferry.moe.formats import quantize_fp8_blocks
from tests.support.fixtures import family_configs, make_checkpoint, make_fp8_checkpoint
from tests.models.test_hf_parity import PROMPTS, _all_logits, assert_logits_match

BLOCK = (16, 16)
QWEN3 = dict(family_configs())["qwen3_moe"]
ENGINE = dict(dtype="float32", device="cpu", max_running_requests=4)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(directory, the unquantized model it was made from)."""
    path = str(tmp_path_factory.mktemp("qwen3-fp8"))
    return path, make_fp8_checkpoint(QWEN3, path, seed=3, block_shape=BLOCK, shards=True)


@pytest.fixture(scope="module")
def fp8_dir(fp8_checkpoint):
    return fp8_checkpoint[0]


@pytest.fixture(scope="module")
def hf_dequantized(fp8_dir):
    """transformers' own FP8 loader, dequantizing (FineGrainedFP8Config(dequantize=True))."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32,
                                                 quantization_config=FineGrainedFP8Config(dequantize=True))
    return model.eval()


def test_the_checkpoint_is_in_the_fp8_layout(fp8_dir):
    tensors = {}
    for name in os.listdir(fp8_dir):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(fp8_dir, name)))
    gate = tensors["model.layers.1.mlp.experts.3.gate_proj.weight"]
    scale = tensors["model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv"]
    assert gate.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (1, 2)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router stays


def test_logits_match_transformers_loading_the_fp8_checkpoint_dequantized(fp8_checkpoint, hf_dequantized):
    fp8_dir, unquantized = fp8_checkpoint
    llm = LLM(fp8_dir, **ENGINE)
    strategy = llm.engine.runner.strategy
    assert strategy.banks[0].w13.dtype == torch.float8_e4m3fn and strategy.banks[0].w13_scale.shape == (8, 2, 2)
    for prompt, got in zip(PROMPTS, _all_logits(llm, PROMPTS)):
        with torch.no_grad():
            ref = hf_dequantized(torch.tensor([prompt])).logits[0].float()
        assert ref.std() > 1e-3
        err = (got - ref).abs().max().item()
        assert err < 1e-4, f"max abs logit difference {err}"
        with torch.no_grad():  # and the check can tell: FP8 rounding moves the logits far more than that
            assert (unquantized(torch.tensor([prompt])).logits[0] - ref).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2-lite"])
def test_a_deepseek_fp8_release_matches_transformers_loading_it_dequantized(tmp_path, family):
    """DeepSeek-V3's FP8 release layout (every projection block-scaled, MLA's kv_a_proj_with_mqa,
    the dense first layer and the shared experts included; the router, norms and head as they
    are): our fp32 logits within 1e-4 of transformers dequantizing the same files; the routed
    experts stay fp8 in the banks."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from tests.support.fixtures import deepseek_configs

    # 4x4 blocks divide every MLA width of the tiny configs (20, 24, 48, 56): transformers'
    # dequantizer assumes whole blocks (the real kv_a_proj_with_mqa, 576 rows, has a partial
    # one; the loader follows DeepSeek's row // 128, tests/kernels: dequantize_blocks)
    make_fp8_checkpoint(dict(deepseek_configs())[family], str(tmp_path), seed=6, block_shape=(4, 4))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == torch.float8_e4m3fn
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.engine.runner.strategy.banks[1].w13.dtype == torch.float8_e4m3fn
    assert_logits_match(llm, hf)


def _run(path, strategy, **kwargs):
    """(prefill logits of PROMPTS, greedy tokens and their log-probs decoding them together)."""
    llm = LLM(path, moe_strategy=strategy, **ENGINE, **kwargs)
    logits = _all_logits(llm, PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params)
    return logits, [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs], llm


def test_every_strategy_gives_the_same_bits_on_the_fp8_checkpoint(fp8_dir):
    gpu_logits, gpu_tokens, gpu_logprobs, _ = _run(fp8_dir, "gpu")
    # 10 slots for 3 layers of 8 experts: decode misses and evicts every step
    for strategy, kwargs in (("uva", {}), ("offload", {"moe_cache_slots": 10, "moe_collect_stats": True})):
        logits, tokens, logprobs, llm = _run(fp8_dir, strategy, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(logits, gpu_logits)), strategy
        assert tokens == gpu_tokens and logprobs == gpu_logprobs, strategy
    moe = llm.engine.stats()["moe"]
    assert moe["decode"]["total"]["misses"] > 0  # the slots really turned over
    assert moe["expert_format"] == "fp8 e4m3, 16x16 blocks"
    assert moe["expert_bytes"] == 3 * 16 * 32 + 4 * (2 * 2 + 2 * 1)  # fp8 gate, up, down + float32 scales


def test_quantization_fp8_quantizes_a_bf16_checkpoints_experts_at_load(tmp_path):
    hf = make_checkpoint(QWEN3, str(tmp_path), seed=4)
    llm = LLM(str(tmp_path), quantization="fp8", **ENGINE)
    strategy = llm.engine.runner.strategy
    assert llm.engine.runner.plan.expert_format == "fp8 e4m3, 128x128 blocks"
    for layer_id, banks in strategy.banks.items():
        experts = hf.model.layers[layer_id].mlp.experts
        gate, up = experts.gate_up_proj.data.chunk(2, dim=1)
        for ours, theirs in ((banks.w13[:, :16], gate), (banks.w13[:, 16:], up), (banks.w2, experts.down_proj.data)):
            q, _ = quantize_fp8_blocks(theirs, (128, 128))
            assert torch.equal(ours.view(torch.uint8), q.view(torch.uint8))
        # transformers over the same dequantized experts is the reference for the logits
        deq13 = torch.cat([dequantize_blocks(banks.w13[:, :16], banks.w13_scale[:, :1], (128, 128)),
                           dequantize_blocks(banks.w13[:, 16:], banks.w13_scale[:, 1:], (128, 128))], dim=1)
        experts.gate_up_proj.data.copy_(deq13)
        experts.down_proj.data.copy_(dequantize_blocks(banks.w2, banks.w2_scale, (128, 128)))
    for prompt, got in zip(PROMPTS, _all_logits(llm, PROMPTS)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert (got - ref).abs().max().item() < 1e-4


def test_quantization_fp8_with_dummy_weights_halves_the_bytes_per_expert(tmp_path):
    from tests.support.fixtures import write_config_dir

    config = QWEN3.to_dict()
    config.update(hidden_size=256, moe_intermediate_size=192, head_dim=64)
    path = write_config_dir(str(tmp_path), config)
    dense = LLM(path, load_format="dummy", **ENGINE)
    quant = LLM(path, load_format="dummy", quantization="fp8", **ENGINE)
    bf16_bytes = 3 * 256 * 192 * 2
    assert dense.engine.runner.strategy.expert_bytes == 3 * 256 * 192 * 4  # float32 on the CPU
    banks = quant.engine.runner.strategy.banks[0]
    assert quant.engine.runner.strategy.expert_bytes == 3 * 256 * 192 + 4 * (2 * 2 * 2 + 2 * 2)
    assert quant.engine.runner.strategy.expert_bytes < 0.51 * bf16_bytes
    assert banks.w13_scale.min() > 0 and banks.w13.float().abs().amax() == 448  # each block's max reaches e4m3's
    out = quant.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_an_fp8_weight_without_its_scales_is_refused(tmp_path, fp8_dir):
    import shutil

    broken = str(tmp_path / "broken")
    shutil.copytree(fp8_dir, broken)
    for name in os.listdir(broken):
        if name.endswith(".safetensors"):
            path = os.path.join(broken, name)
            tensors = load_file(path)
            kept = {k: v for k, v in tensors.items() if k != "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"
                    and k != "model.layers.0.self_attn.o_proj.weight_scale_inv"}
            save_file(kept, path, metadata={"format": "pt"})
    index_path = os.path.join(broken, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    for gone in ("model.layers.2.mlp.experts.5.down_proj.weight_scale_inv",
                 "model.layers.0.self_attn.o_proj.weight_scale_inv"):
        index["weight_map"].pop(gone)
    with open(index_path, "w") as f:
        json.dump(index, f)
    with pytest.raises(LoadError, match="weight_scale_inv"):
        LLM(broken, **ENGINE)


def test_unsupported_quantization_configs_are_refused(tmp_path):
    from tests.support.fixtures import write_config_dir

    config = QWEN3.to_dict()
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    path = write_config_dir(str(tmp_path / "awq"), config)
    with pytest.raises(ConfigError, match="quant_method 'awq'"):
        LLM(path, load_format="dummy", **ENGINE)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"}
    path = write_config_dir(str(tmp_path / "per-tensor"), config)
    with pytest.raises(ConfigError, match="weight_block_size"):
        LLM(path, load_format="dummy", **ENGINE)


# --- GPU: the Triton path, CUDA graphs, pinned host banks ---------------------------------

GPU_ENGINE = dict(dtype="bfloat16", device="cuda", max_running_requests=4, num_tokens=4096)


@pytest.mark.gpu
def test_every_strategy_gives_the_same_bits_on_the_fp8_checkpoint_on_gpu(fp8_dir, hf_dequantized):
    """Triton over fp8 slots (graph-captured decode, gather copies of fp8 and scale rows, the
    prefill stream) gives gpu's bits; the logits stay within bf16 rounding of transformers'."""
    results = {}
    for strategy, kwargs in (("gpu", {}), ("uva", {}), ("offload", {"moe_cache_slots": 10}),
                             ("offload", {"moe_cache_slots": 10, "moe_prefill_demand_tokens": 64})):
        llm = LLM(fp8_dir, moe_strategy=strategy, **GPU_ENGINE, **kwargs)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
        outs = llm.generate(PROMPTS, params)
        logits = _all_logits(llm, PROMPTS)
        results[(strategy, tuple(kwargs.items()))] = (logits, [o.token_ids for o in outs],
                                                      [[lp.logprob for lp in o.logprobs] for o in outs])
        del llm
    (gpu_logits, gpu_tokens, gpu_logprobs), *others = results.values()
    for logits, tokens, logprobs in others:
        assert all(torch.equal(a, b) for a, b in zip(logits, gpu_logits))
        assert tokens == gpu_tokens and logprobs == gpu_logprobs
    for prompt, got in zip(PROMPTS, gpu_logits):
        with torch.no_grad():
            ref = hf_dequantized(torch.tensor([prompt])).logits[0].float()
        assert (got.cpu() - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.gpu
def test_quantization_fp8_dummy_at_the_qwen3_30b_shape_on_gpu(tmp_path):
    """12 layers of Qwen3-30B-A3B with --quantization fp8 --load-format dummy, offloaded at half
    the experts: 4.5 MiB per expert, twice the experts of bf16 in the same --moe-cache-gb, and
    offload decodes gpu's tokens."""
    from tests.models.dummy_30b import offload_decodes_gpus_tokens

    expert_bytes, plan = offload_decodes_gpus_tokens(tmp_path, "fp8", 3.0)
    assert expert_bytes == 3 * 2048 * 768 + 4 * (2 * 6 * 16 + 16 * 6)
    assert plan.expert_slots == int(3.0 * 2**30 // (3 * 2048 * 768 + 1152)) == 682  # bf16: 341
    assert plan.expert_format == "fp8 e4m3, 128x128 blocks" and "fp8 e4m3" in plan.table()