"""gpt-oss against transformers beyond the shared parity tests (tests/models/test_hf_parity.py
runs logits and greedy tokens of both configs): every position through chunked prefill and
batched decode past the sliding window, every strategy bit-identical (offload with a partial
cache; cpu and hybrid on the CPU: float32 through the reference, bf16 and MXFP4 experts through
the compiled host kernel), the de-interleaved expert banks, the loader's named errors, a
released-style MXFP4 checkpoint, the CLI on a tiny checkpoint, a dummy cut."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError
from moeferry.scheduler.request import Request
from tests.support.fixtures import gpt_oss_configs, make_checkpoint, make_checkpoint_with_builtin_tokenizer
from tests.models.mixed_batch import assert_mixed_batch_matches_transformers

CONFIGS = gpt_oss_configs()
PROMPTS = [[5, 17, 33, 2, 9, 71, 40], [88, 3, 12, 60], [12, 60, 61, 62, 7, 1, 90, 45, 23, 30, 31, 8, 19]]


@pytest.fixture(scope="module", params=CONFIGS, ids=[n for n, _ in CONFIGS])
def family(request, tmp_path_factory):
    name, config = request.param
    path = str(tmp_path_factory.mktemp(name))
    hf = make_checkpoint(config, path)  # clamping as the config declares, whatever the transformers version
    return name, config, hf, path


def test_logits_match_transformers_through_chunked_prefill_and_batched_decode(family):
    """Request a's 13-token prompt in two chunks, the second batched with b's whole prompt; then
    six decode steps of both in one batch: every position's fp32 logits within 1e-4 of
    transformers', both requests running well past the window of 4 tokens."""
    name, config, hf, path = family
    runner = LLM(path, dtype="float32", device="cpu", max_running_requests=4).engine.runner
    assert_mixed_batch_matches_transformers(runner, hf, name, decode_steps=6)


def test_the_window_sinks_and_clamp_each_change_the_output(family):
    """What the parity checks rest on: with the layers' window, the sinks or the SwiGLU limit
    taken away, transformers' own logits move (so matching them tests each)."""
    name, config, hf, path = family
    prompt = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        want = hf(prompt).logits
        changed = {}
        layer_types = hf.config.layer_types  # the model builds each layer's mask from them
        hf.config.layer_types = ["full_attention"] * len(layer_types)
        changed["window"] = hf(prompt).logits
        hf.config.layer_types = layer_types
        for attn in (layer.self_attn for layer in hf.model.layers):
            attn.saved_sinks = attn.sinks.clone()
            attn.sinks.fill_(-1e4)
        changed["sinks"] = hf(prompt).logits
        for attn in (layer.self_attn for layer in hf.model.layers):
            attn.sinks.copy_(attn.saved_sinks)
        for experts in (layer.mlp.experts for layer in hf.model.layers):
            experts.saved, experts.limit = experts.limit, 1e9
        changed["limit"] = hf(prompt).logits
        for experts in (layer.mlp.experts for layer in hf.model.layers):
            experts.limit = experts.saved
        assert torch.equal(hf(prompt).logits, want)
    moved = {k: (v - want).abs().max().item() for k, v in changed.items()}
    assert moved["window"] > 1e-3 and moved["sinks"] > 1e-3, moved
    if config.swiglu_limit < 1:
        assert moved["limit"] > 1e-3, moved


def _outputs(path, dtype="float32", **options):
    llm = LLM(path, dtype=dtype, device="cpu", max_running_requests=4, **options)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    return [(o.token_ids, list(o.logprobs)) for o in llm.generate(PROMPTS, params)], llm


def test_strategies_give_bit_identical_outputs(family):
    """gpu, offload over a cache of a quarter of the experts (the bias banks copied with them),
    uva, and cpu on the CPU (a float32 model: the reference computes its experts) bit for bit;
    hybrid gives the same tokens."""
    name, config, hf, path = family
    want, _ = _outputs(path)
    total = config.num_local_experts * config.num_hidden_layers
    offload, llm = _outputs(path, moe_strategy="offload", moe_cache_slots=total // 4, moe_collect_stats=True)
    assert offload == want
    assert llm.engine.runner.strategy.stats()["decode"]["total"]["misses"] > 0
    assert _outputs(path, moe_strategy="uva")[0] == want
    assert _outputs(path, moe_strategy="cpu")[0] == want
    hybrid, llm = _outputs(path, moe_strategy="hybrid", moe_cache_slots=config.num_local_experts, moe_host_share=0.5,
                           moe_collect_stats=True)
    # hybrid's device share groups the host's routes (weight 0) with slot 0's rows, so a matmul
    # of other rows may round its rows differently: its promise is gpu's tokens, not its bits
    assert [tokens for tokens, _ in hybrid] == [tokens for tokens, _ in want]
    assert llm.engine.runner.strategy.stats()["host_experts"] > 0


@pytest.mark.parametrize("options", [{}, {"quantization": "mxfp4"}], ids=["bf16", "mxfp4"])
def test_cpu_and_hybrid_compute_bf16_models_experts_in_the_host_kernel_bit_for_bit(family, options):
    """A bf16 model on the CPU, its experts bf16 or MXFP4 (the released format): `gpu` runs the
    host op there, which computes the biased, clamped experts in the compiled kernel, and so do
    `cpu` and `hybrid`'s host channel; a route's bits do not depend on which routes share its
    call, so every token and log-prob is gpu's, bit for bit (the host's exact path: the int8
    one has its own tolerance, tests/moe/test_host_strategies.py)."""
    from moeferry.kernels.fused_moe import host as host_kernel

    name, config, hf, path = family
    bf16 = dict(dtype="bfloat16", **options)
    calls = host_kernel.timing()["calls"]
    want, _ = _outputs(path, **bf16)
    assert host_kernel.timing()["calls"] > calls  # gpu's experts ran in the kernel, not the reference
    for strategy, extra in (("cpu", {}), ("hybrid", dict(moe_cache_slots=config.num_local_experts, moe_host_share=0.5,
                                                          moe_collect_stats=True))):
        calls = host_kernel.timing()["calls"]
        got, llm = _outputs(path, moe_strategy=strategy, moe_host_activations="bf16", **bf16, **extra)
        moe = llm.engine.runner.strategy
        assert moe.host.channel.compiled and moe.stats()["host_experts"] > 0
        bank = next(iter(moe.host.channel.banks.values()))
        assert bank.w13.dtype == (torch.uint8 if options else torch.bfloat16) and bank.w13_bias is not None
        assert host_kernel.timing()["calls"] > calls
        assert got == want, strategy


def test_expert_banks_hold_gate_rows_then_up_rows(family):
    """The checkpoint's [E, H, 2I] gate_up_proj with gate and up interleaved lands as [E, 2I, H]
    gate rows then up rows, its bias alike; down_proj [E, I, H] as [E, H, I]."""
    name, config, hf, path = family
    llm = LLM(path, dtype="float32", device="cpu")
    experts = hf.model.layers[1].mlp.experts
    banks = llm.engine.runner.model.moe_block(1).banks
    inter = config.intermediate_size
    assert torch.equal(banks.w13[:, :inter], experts.gate_up_proj[..., ::2].transpose(1, 2))
    assert torch.equal(banks.w13[:, inter:], experts.gate_up_proj[..., 1::2].transpose(1, 2))
    assert torch.equal(banks.w13_bias, torch.cat([experts.gate_up_proj_bias[:, ::2],
                                                  experts.gate_up_proj_bias[:, 1::2]], dim=1))
    assert torch.equal(banks.w2, experts.down_proj.transpose(1, 2))
    assert torch.equal(banks.w2_bias, experts.down_proj_bias)


# ---- the loader's named errors --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    make_checkpoint(dict(CONFIGS)["gpt_oss"], path)
    return path


def _copy_and_edit(path, tmp_path, edit):
    d = str(tmp_path / "m")
    shutil.copytree(path, d)
    file = os.path.join(d, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return d


def test_a_released_style_mxfp4_checkpoint_matches_transformers_dequantizing_it(tmp_path):
    """gpt-oss as released: experts as MXFP4 `*_blocks` [E, rows, K/32, 16] / `*_scales`, gate
    and up rows interleaved, `quant_method: mxfp4`, biases and attention in float. Our fp32
    logits at every position within 1e-4 of transformers loading the same files with
    Mxfp4Config(dequantize=True); the banks hold the bytes (mxfp4 format), not bf16."""
    import transformers as T

    from tests.support.fixtures import mxfp4_blocks

    config = T.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=256, sliding_window=4,
                            layer_types=["sliding_attention", "full_attention"], initializer_range=0.3,
                            swiglu_limit=0.4, tie_word_embeddings=False)
    torch.manual_seed(11)
    T.AutoModelForCausalLM.from_config(config).float().save_pretrained(str(tmp_path))
    file = str(tmp_path / "model.safetensors")
    tensors = load_file(file)
    for layer_id in range(2):
        prefix = f"model.layers.{layer_id}.mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):  # transformers' [E, K, out]; the released files' [E, out, ...]
            tensors[prefix + proj + "_blocks"], tensors[prefix + proj + "_scales"] = mxfp4_blocks(
                tensors.pop(prefix + proj).transpose(1, 2))
    save_file(tensors, file, metadata={"format": "pt"})
    raw = json.load(open(tmp_path / "config.json"))
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    json.dump(raw, open(tmp_path / "config.json", "w"))
    hf = T.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                quantization_config=T.Mxfp4Config(dequantize=True)).eval()
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_running_requests=4)
    banks = llm.engine.runner.strategy.banks[0]
    assert banks.w13.dtype == torch.uint8 and banks.w13_scale.dtype == torch.uint8 and banks.w13_bias is not None
    assert llm.engine.runner.plan.expert_format == "mxfp4 e2m1, e8m0 scales per 32"
    from tests.models.test_hf_parity import assert_logits_match

    assert_logits_match(llm, hf, PROMPTS)


@pytest.mark.parametrize("name", ["model.layers.2.mlp.experts.gate_up_proj_bias",
                                  "model.layers.1.mlp.experts.down_proj_bias"])
def test_a_missing_expert_bias_is_named(tiny_path, tmp_path, name):
    d = _copy_and_edit(tiny_path, tmp_path, lambda t: t.pop(name))
    layer = name.split(".")[2]
    with pytest.raises(ConfigError, match=rf"layer {layer} lacks its expert biases"):
        LLM(d, device="cpu")


@pytest.mark.parametrize("name,says", [
    ("model.layers.0.mlp.experts.down_proj_bias", r"has shape \(8, 31\), the model expects \(8, 32\)"),
    ("model.layers.1.mlp.experts.gate_up_proj", r"has shape \(8, 32, 31\), the model expects \(8, 32, 32\)"),
    ("model.layers.0.self_attn.sinks", r"has shape \(3,\), the model expects \(4,\)"),
    ("model.layers.3.mlp.router.bias", r"has shape \(7,\), the model expects \(8,\)"),
])
def test_a_gpt_oss_tensor_of_the_wrong_shape_is_named(tiny_path, tmp_path, name, says):
    d = _copy_and_edit(tiny_path, tmp_path, lambda t: t.__setitem__(name, t[name][..., :-1].contiguous()))
    with pytest.raises(ConfigError, match=rf"tensor '{name}' {says}"):
        LLM(d, device="cpu")


def test_a_missing_sink_is_named(tiny_path, tmp_path):
    name = "model.layers.1.self_attn.sinks"
    d = _copy_and_edit(tiny_path, tmp_path, lambda t: t.pop(name))
    with pytest.raises(ConfigError, match=rf"lacks 1 tensor.*{name}"):
        LLM(d, device="cpu")


def test_a_dummy_cut_of_the_config_runs(tiny_path, tmp_path):
    d = str(tmp_path / "cfg")
    os.makedirs(d)
    shutil.copy(os.path.join(tiny_path, "config.json"), d)
    llm = LLM(d, load_format="dummy", device="cpu", hf_overrides={"num_hidden_layers": 3})
    assert llm.engine.mc.hf.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    banks = llm.engine.runner.model.moe_block(0).banks
    assert banks.w13_bias.abs().sum() > 0 and banks.w2_bias.abs().sum() > 0  # dummy biases are filled too
    assert len(llm.generate([4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids) == 5


def test_moeferry_generate_runs_a_tiny_gpt_oss_checkpoint(tmp_path):
    """`moeferry generate --model DIR` end to end on a tiny gpt-oss checkpoint carrying the
    built-in model's tokenizer (its vocabulary sizes the checkpoint)."""
    import subprocess
    import sys

    d = str(tmp_path / "g")
    make_checkpoint_with_builtin_tokenizer(dict(CONFIGS)["gpt_oss"], d)
    out = subprocess.run([sys.executable, "-m", "moeferry.cli", "generate", "--model", d, "--prompt", "Hello",
                          "--max-tokens", "6", "--ignore-eos", "--device", "cpu"],
                         capture_output=True, text=True, env={**os.environ, "MOEFERRY_CACHE": str(tmp_path)},
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[6 tokens, finish_reason=length]" in out.stderr


# ---- GPU: the Triton kernels (sinks, windows, biased clamped experts) in captured graphs ------

@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["gpu", "offload", "uva"])
def test_greedy_tokens_match_transformers_on_cuda_with_graphs(family, strategy):
    """fp32 on CUDA, decode through CUDA graphs: 24 greedy tokens of a mixed batch equal this
    engine's CPU path (which the CPU tests hold to transformers at every position), then
    transformers' generate, for every device strategy (offload over a partial cache). The first
    comparison tells a kernel's error from a transformers version reading the config otherwise."""
    name, config, hf, path = family
    extra = {"moe_cache_slots": 8} if strategy == "offload" else {}
    llm = LLM(path, dtype="float32", device="cuda", max_running_requests=4, moe_strategy=strategy, **extra)
    assert llm.engine.runner.graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    cpu_llm = LLM(path, dtype="float32", device="cpu", max_running_requests=4)
    on_cpu = [o.token_ids for o in cpu_llm.generate(PROMPTS, params)]
    assert got == on_cpu, f"{name} {strategy}: CUDA against the CPU path"
    for prompt, tokens in zip(PROMPTS, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == want, f"{name} {strategy}"



def test_the_clamped_swiglu_values_default_to_the_released_ones():
    """Released config.json files, and transformers versions whose GptOssConfig has no
    `swiglu_alpha` (or no `swiglu_limit`), leave them out: the family takes gpt-oss's 1.702 and
    7.0; a config that sets them wins."""
    from types import SimpleNamespace

    from moeferry.models.gpt_oss import SPEC

    assert SPEC.activation(SimpleNamespace(swiglu_limit=7.0)).alpha == pytest.approx(1.702)
    assert SPEC.activation(SimpleNamespace(swiglu_limit=7.0)).limit == 7.0
    assert SPEC.activation(SimpleNamespace(swiglu_limit=3.0, swiglu_alpha=2.0)).alpha == 2.0
    assert SPEC.activation(SimpleNamespace(swiglu_limit=3.0)).limit == 3.0
    bare = SPEC.activation(SimpleNamespace())
    assert (bare.alpha, bare.limit) == (pytest.approx(1.702), 7.0)


def test_the_swiglu_values_come_from_the_first_layer_where_the_config_refuses_a_model_wide_read():
    """transformers versions that treat them as per-layer values of a config with `layer_types`
    raise an AttributeError on `config.swiglu_limit`."""
    from types import SimpleNamespace

    from moeferry.models.gpt_oss import SPEC

    class PerLayer:
        per_layer_config = [SimpleNamespace(swiglu_limit=5.0), SimpleNamespace(swiglu_limit=5.0)]

        def __getattr__(self, name):
            raise AttributeError(f"{name!r} is a per-layer attribute")

    activation = SPEC.activation(PerLayer())
    assert activation.limit == 5.0 and activation.alpha == pytest.approx(1.702)
