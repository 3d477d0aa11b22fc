"""DeepSeek-V2/V3 (MLA) against transformers beyond the shared parity tests: logits at every
position through chunked prefill and batched absorbed decode, the latent KV cache's size,
strategies bit-identical, the router against HF's own modules, and the loader's named errors."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError
from moeferry.scheduler.request import Request
from tests.support.fixtures import deepseek_configs, make_checkpoint, make_checkpoint_with_builtin_tokenizer
from tests.models.mixed_batch import assert_mixed_batch_matches_transformers

CONFIGS = deepseek_configs()


@pytest.fixture(scope="module", params=CONFIGS, ids=[n for n, _ in CONFIGS])
def family(request, tmp_path_factory):
    name, config = request.param
    path = str(tmp_path_factory.mktemp(name))
    hf = make_checkpoint(config, path, shards=True)
    return name, config, hf, path


def test_logits_match_transformers_through_chunked_prefill_and_batched_decode(family):
    """Request a's prompt in two chunks, the second batched with request b's whole prompt; then
    four decode steps of both in one batch (the absorbed form). Every position's fp32 logits
    within 1e-4 of transformers' over the whole sequence."""
    name, config, hf, path = family
    runner = LLM(path, dtype="float32", device="cpu", max_running_requests=4).engine.runner
    assert_mixed_batch_matches_transformers(runner, hf, name, decode_steps=4)


def test_the_kv_cache_holds_one_latent_row_per_token_and_layer(family):
    name, config, hf, path = family
    runner = LLM(path, dtype="float32", device="cpu").engine.runner
    width = config.kv_lora_rank + config.qk_rope_head_dim
    assert runner.kv.v == []
    assert [tuple(k.shape[1:]) for k in runner.kv.k] == [(1, width)] * config.num_hidden_layers
    assert runner.plan.kv_bytes == runner.kv.capacity_tokens * config.num_hidden_layers * width * 4


def test_strategies_give_bit_identical_logits(family):
    name, config, hf, path = family
    prompts = [[5, 17, 33, 2, 9, 71, 40], [88, 3, 12, 60]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = {}
    for strategy, extra in (("gpu", {}), ("offload", {"moe_cache_slots": 8}), ("uva", {})):
        llm = LLM(path, dtype="float32", device="cpu", moe_strategy=strategy, **extra)
        outs[strategy] = [(o.token_ids, [lp for lp in o.logprobs]) for o in llm.generate(prompts, params)]
    assert outs["offload"] == outs["gpu"]
    assert outs["uva"] == outs["gpu"]


def _hf_router(config):
    import transformers.models.deepseek_v2.modeling_deepseek_v2 as v2
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as v3

    cls = v3.DeepseekV3TopkRouter if config.model_type == "deepseek_v3" else v2.DeepseekV2TopkRouter
    router = cls(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(0, 0.2)
    return router


@pytest.mark.parametrize("name,config", CONFIGS, ids=[n for n, _ in CONFIGS])
def test_router_picks_the_experts_and_weights_of_transformers(name, config):
    from moeferry.models.registry import get_family
    from moeferry.config import ModelConfig

    hf = _hf_router(config)
    mc = ModelConfig(path="", hf=config)
    ours = get_family(config.model_type).router(mc)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(257, config.hidden_size)
    _, ref_w, ref_ids = hf(x)
    weights, ids = ours(x)
    order = ref_ids.sort(dim=-1)
    mine = ids.long().sort(dim=-1)
    assert torch.equal(mine.values, order.values)
    torch.testing.assert_close(weights.gather(1, mine.indices), ref_w.gather(1, order.indices), rtol=1e-6, atol=1e-7)
    if config.n_group and config.n_group > 1 and getattr(config, "topk_method", "noaux_tc") != "greedy":
        group = ids.long() // (config.n_routed_experts // config.n_group)
        assert int(max(len(set(row)) for row in group.tolist())) <= config.topk_group


# ---- the loader's named errors --------------------------------------------------------------

def _copy(path, tmp_path):
    dst = str(tmp_path / "m")
    shutil.copytree(path, dst)
    return dst


def _edit_shard(d, name, edit):
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    file = os.path.join(d, index["weight_map"][name])
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return os.path.basename(file)


@pytest.fixture(scope="module")
def v3_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v3"))
    make_checkpoint(dict(CONFIGS)["deepseek_v3"], path, shards=True)
    return path


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.kv_b_proj.weight",
                                  "model.layers.2.self_attn.q_a_proj.weight",
                                  "model.layers.1.mlp.gate.weight",
                                  "model.layers.2.mlp.shared_experts.up_proj.weight"])
def test_a_latent_or_router_weight_of_the_wrong_shape_is_named(v3_path, tmp_path, name):
    d = _copy(v3_path, tmp_path)
    shard = _edit_shard(d, name, lambda t: t.__setitem__(name, t[name][:-1].contiguous()))
    with pytest.raises(ConfigError, match=rf"{shard}: tensor '{name}' has shape"):
        LLM(d, device="cpu")


@pytest.mark.parametrize("name", ["model.layers.1.mlp.gate.e_score_correction_bias",
                                  "model.layers.0.self_attn.kv_a_layernorm.weight",
                                  "model.layers.0.mlp.down_proj.weight"])
def test_a_missing_deepseek_tensor_is_named(v3_path, tmp_path, name):
    d = _copy(v3_path, tmp_path)
    _edit_shard(d, name, lambda t: t.pop(name))
    with pytest.raises(ConfigError, match=rf"lacks 1 tensor.*{name}"):
        LLM(d, device="cpu")


def test_an_expert_in_a_dense_first_layer_is_named(v3_path, tmp_path):
    d = _copy(v3_path, tmp_path)
    src, name = "model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight"
    _edit_shard(d, src, lambda t: t.__setitem__(name, t[src].clone()))
    with pytest.raises(ConfigError, match=rf"'{name}' is an expert of layer 0, which the model's config makes a "
                                          r"dense layer"):
        LLM(d, device="cpu")


@pytest.mark.parametrize("field,value,says", [
    ("n_group", 3, "n_group 3 does not divide the 8 routed experts"),
    ("topk_group", 5, r"topk_group must be in \[1, 4\]"),
])
def test_a_router_config_the_engine_cannot_run_is_refused(v3_path, tmp_path, field, value, says):
    d = _copy(v3_path, tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump({**cfg, field: value}, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match=rf"config\.json: {says}"):
        LLM(d, device="cpu", load_format="dummy")


def test_a_dummy_cut_of_the_config_runs(v3_path, tmp_path):
    d = str(tmp_path / "cfg")
    os.makedirs(d)
    shutil.copy(os.path.join(v3_path, "config.json"), d)
    llm = LLM(d, load_format="dummy", device="cpu", hf_overrides={"num_hidden_layers": 2})
    assert llm.engine.mc.moe_layer_ids == (1,)
    assert len(llm.generate([4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids) == 5


def test_a_kimi_k2_config_runs_as_deepseek_v3(v3_path, tmp_path):
    """Kimi-K2's checkpoints say model_type kimi_k2 (with remote code transformers does not
    need): the same weights give the same tokens as under deepseek_v3."""
    d = _copy(v3_path, tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump({**cfg, "model_type": "kimi_k2", "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}},
              open(os.path.join(d, "config.json"), "w"))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kimi = LLM(d, dtype="float32", device="cpu")
    assert kimi.engine.mc.model_type == "kimi_k2"
    want = LLM(v3_path, dtype="float32", device="cpu").generate([[3, 1, 4, 1, 5]], params)[0].token_ids
    assert kimi.generate([[3, 1, 4, 1, 5]], params)[0].token_ids == want


def test_moeferry_generate_runs_a_tiny_deepseek_checkpoint(tmp_path):
    """`moeferry generate --model DIR` end to end on a tiny DeepSeek-V3 checkpoint that carries
    the built-in model's tokenizer (its vocabulary sizes the checkpoint)."""
    import subprocess
    import sys

    d = str(tmp_path / "ds")
    make_checkpoint_with_builtin_tokenizer(dict(CONFIGS)["deepseek_v3"], d)
    out = subprocess.run([sys.executable, "-m", "moeferry.cli", "generate", "--model", d, "--prompt", "Hello",
                          "--max-tokens", "6", "--ignore-eos", "--device", "cpu"],
                         capture_output=True, text=True, env={**os.environ, "MOEFERRY_CACHE": str(tmp_path)},
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[6 tokens, finish_reason=length]" in out.stderr


# ---- GPU: the Triton MLA kernel inside captured decode graphs ------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["gpu", "offload", "uva"])
def test_greedy_tokens_match_transformers_on_cuda_with_graphs(family, strategy):
    """fp32 on CUDA, decode through CUDA graphs (the Triton MLA kernel, the grouped router in the
    graph): 24 greedy tokens of a mixed batch equal transformers' generate, for every strategy."""
    name, config, hf, path = family
    extra = {"moe_cache_slots": 8} if strategy == "offload" else {}
    llm = LLM(path, dtype="float32", device="cuda", max_running_requests=4, moe_strategy=strategy, **extra)
    assert llm.engine.runner.graphs is not None
    prompts = [[5, 17, 33, 2, 9, 71, 40], [88, 3], [12, 60, 61, 62, 7, 1, 90, 45, 23, 30, 31, 8, 19]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == want, f"{name} {strategy}"
