"""MXFP4 experts end to end (CPU, float32 reference path): `--quantization mxfp4` of a tiny
Qwen3-MoE checkpoint against transformers over the same experts dequantized by transformers'
own MXFP4 dequantizer (within 1e-4); every strategy (gpu, uva, offload with a partial cache,
cpu, hybrid) bit-identical on it; a checkpoint in gpt-oss's stacked MXFP4 layout (`*_blocks`,
`*_scales`, quant_method mxfp4) loads the bytes `--quantization mxfp4` makes; the gpt-oss
loader path (interleaved gate/up rows) against transformers loading a gpt-oss MXFP4 checkpoint;
`--load-format dummy`; the format and bytes per expert."""

import json

import pytest
import torch

from moeferry import LLM, SamplingParams
from moeferry.kernels.fused_moe.reference import dequantize_blocks
from moeferry.moe.formats import quantize_mxfp4
from tests.support.fixtures import family_configs, make_checkpoint, make_mxfp4_checkpoint, mxfp4_blocks
from tests.models.test_hf_parity import PROMPTS, _all_logits

QWEN3 = dict(family_configs())["qwen3_moe"]  # H = 32, I = 16: a partial block in every down row
ENGINE = dict(dtype="float32", device="cpu", max_running_requests=4)
BLOCK = (1, 32)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """(directory, the HF model it holds)."""
    path = str(tmp_path_factory.mktemp("qwen3"))
    return path, make_checkpoint(QWEN3, path, seed=7)


def _hf_over(model, experts_of):
    """A copy of the HF model with every layer's experts replaced by experts_of(layer_id) =
    (gate_up [E, 2I, H], down [E, H, I])."""
    import copy

    model = copy.deepcopy(model)
    with torch.no_grad():
        for layer_id, layer in enumerate(model.model.layers):
            gate_up, down = experts_of(layer_id)
            layer.mlp.experts.gate_up_proj.copy_(gate_up)
            layer.mlp.experts.down_proj.copy_(down)
    return model


def _transformers_dequantized(packed, scales, cols):
    """transformers' own MXFP4 dequantizer over the banks' rows (padded to whole blocks)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    padded = packed.new_zeros(*packed.shape[:-1], scales.shape[-1] * 16)
    padded[..., :packed.shape[-1]] = packed
    out = convert_moe_packed_tensors(padded.view(*scales.shape, 16), scales, dtype=torch.float32)
    return out.transpose(1, 2)[..., :cols]


def test_quantization_mxfp4_matches_transformers_over_the_dequantized_experts(bf16_checkpoint):
    path, hf = bf16_checkpoint
    llm = LLM(path, quantization="mxfp4", **ENGINE)
    strategy = llm.engine.runner.strategy
    assert llm.engine.runner.plan.expert_format == "mxfp4 e2m1, e8m0 scales per 32"
    hidden, inter = 32, 16
    for layer_id, banks in strategy.banks.items():
        experts = hf.model.layers[layer_id].mlp.experts
        assert banks.w13.dtype == torch.uint8 and banks.w13.shape == (8, 32, 16) and banks.w2.shape == (8, 32, 8)
        assert banks.w13_scale.dtype == torch.uint8 and banks.w13_scale.shape == (8, 32, 1)
        for ours, scales, theirs in ((banks.w13, banks.w13_scale, experts.gate_up_proj.data),
                                     (banks.w2, banks.w2_scale, experts.down_proj.data)):
            q, s = quantize_mxfp4(theirs)
            assert torch.equal(ours, q) and torch.equal(scales, s)
    deq = {layer_id: (_transformers_dequantized(b.w13, b.w13_scale, hidden),
                      _transformers_dequantized(b.w2, b.w2_scale, inter)) for layer_id, b in strategy.banks.items()}
    reference = _hf_over(hf, deq.__getitem__)
    for prompt, got in zip(PROMPTS, _all_logits(llm, PROMPTS)):
        with torch.no_grad():
            ref = reference(torch.tensor([prompt])).logits[0].float()
            unquantized = hf(torch.tensor([prompt])).logits[0].float()
        assert ref.std() > 1e-3
        assert (got - ref).abs().max().item() < 1e-4
        assert (unquantized - ref).abs().max().item() > 1e-3  # and the check can tell: MXFP4 moves the logits


def _run(path, strategy, **kwargs):
    llm = LLM(path, moe_strategy=strategy, **ENGINE, **kwargs)
    logits = _all_logits(llm, PROMPTS)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0))
    return (logits, [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]), llm


def test_every_strategy_gives_the_same_bits_on_mxfp4_experts(bf16_checkpoint):
    path = bf16_checkpoint[0]
    (want_logits, want_tokens, want_logprobs), _ = _run(path, "gpu", quantization="mxfp4")
    # 10 slots for 3 layers of 8 experts: decode misses and evicts every step
    for strategy, kwargs in (("uva", {}), ("offload", {"moe_cache_slots": 10, "moe_collect_stats": True}),
                             ("cpu", {}), ("hybrid", {"moe_cache_slots": 10, "moe_host_share": 0.5})):
        (logits, tokens, logprobs), llm = _run(path, strategy, quantization="mxfp4", **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(logits, want_logits)), strategy
        assert tokens == want_tokens and logprobs == want_logprobs, strategy
        stats = llm.engine.stats()["moe"]
        if strategy == "offload":
            assert stats["decode"]["total"]["misses"] > 0  # the slots really turned over
            assert stats["expert_format"] == "mxfp4 e2m1, e8m0 scales per 32"
            assert stats["expert_bytes"] == 3 * 16 * 32 // 2 + (2 * 16 * 1 + 32 * 1)  # nibbles + one E8M0 byte a row
        if strategy in ("cpu", "hybrid"):
            assert stats["host_experts"] > 0


def test_a_checkpoint_in_gpt_oss_mxfp4_layout_loads_the_quantized_bytes(tmp_path):
    """quant_method mxfp4, experts stacked as `mlp.experts.gate_up_proj_blocks` [E, 2I, H/32, 16]
    and `_scales` [E, 2I, H/32] (gate rows, then up rows), `down_proj_blocks` / `_scales`."""
    config = QWEN3.to_dict()
    config.update(moe_intermediate_size=32)  # whole blocks, as the layout needs
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(**config)
    make_checkpoint(config, str(tmp_path / "bf16"), seed=8)
    make_mxfp4_checkpoint(config, str(tmp_path / "mxfp4"), seed=8)
    with open(tmp_path / "mxfp4" / "config.json") as f:
        assert json.load(f)["quantization_config"] == {"quant_method": "mxfp4"}
    from_checkpoint = LLM(str(tmp_path / "mxfp4"), **ENGINE)
    quantized_at_load = LLM(str(tmp_path / "bf16"), quantization="mxfp4", **ENGINE)
    for ours, theirs in zip(from_checkpoint.engine.runner.strategy.banks.values(),
                            quantized_at_load.engine.runner.strategy.banks.values()):
        assert all(torch.equal(a, b) for a, b in zip(ours.tensors(), theirs.tensors()))
    assert from_checkpoint.engine.runner.plan.expert_format == "mxfp4 e2m1, e8m0 scales per 32"
    assert all(torch.equal(a, b) for a, b in zip(_all_logits(from_checkpoint, PROMPTS),
                                                 _all_logits(quantized_at_load, PROMPTS)))
    with pytest.raises(Exception, match="already quantized as mxfp4"):
        LLM(str(tmp_path / "mxfp4"), quantization="int4", **ENGINE)


def test_a_checkpoint_without_its_scales_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from moeferry.engine.loader import LoadError

    config = QWEN3.to_dict()
    config.update(moe_intermediate_size=32)
    from transformers import Qwen3MoeConfig

    make_mxfp4_checkpoint(Qwen3MoeConfig(**config), str(tmp_path), seed=8)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(LoadError, match="scale tensors"):
        LLM(str(tmp_path), **ENGINE)


class _OneLayer:
    """What the loader's expert writer reads of a model: a family spec, its experts per layer, and
    a layer's block (its banks, and the experts its strategy holds: all of them here)."""

    def __init__(self, banks, interleaved):
        from types import SimpleNamespace

        self.spec = SimpleNamespace(gate_up_interleaved=interleaved)
        self.config = SimpleNamespace(num_experts=banks.num_experts)
        self.block = SimpleNamespace(banks=banks, strategy=SimpleNamespace(owned_experts=range))

    def moe_block(self, layer_id):
        return self.block


def test_gpt_oss_mxfp4_experts_land_in_the_banks_as_transformers_reads_them(tmp_path):
    """A gpt-oss MXFP4 checkpoint (made here: transformers saves a random GptOss model, its
    stacked experts then written as `*_blocks` / `*_scales`) loaded by transformers, which
    dequantizes it (Mxfp4Config(dequantize=True)) and uses gate = gate_up[..., ::2], up =
    gate_up[..., 1::2]; the same tensors through the loader's expert writer with interleaved
    gate/up rows give banks whose dequantized gate, up and down are transformers' bit for bit."""
    import transformers as T
    from safetensors.torch import load_file, save_file

    from moeferry.engine.loader import _ExpertWriter
    from moeferry.moe.formats import mxfp4_format
    from moeferry.moe.banks import ExpertBanks

    config = T.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=256, layer_types=["full_attention"])
    torch.manual_seed(9)
    T.AutoModelForCausalLM.from_config(config).float().save_pretrained(str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    prefix = "model.layers.0.mlp.experts."
    for proj in ("gate_up_proj", "down_proj"):  # transformers' layout [E, K, out]; the checkpoint's [E, out, ...]
        tensors[prefix + proj + "_blocks"], tensors[prefix + proj + "_scales"] = mxfp4_blocks(
            tensors.pop(prefix + proj).transpose(1, 2))
    save_file(tensors, path, metadata={"format": "pt"})
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    hf = T.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                quantization_config=T.Mxfp4Config(dequantize=True))
    experts = hf.model.layers[0].mlp.experts

    banks = ExpertBanks.allocate(4, 64, 64, mxfp4_format(), torch.float32, torch.device("cpu"), zero=True)
    writer = _ExpertWriter(_OneLayer(banks, interleaved=True), torch.device("cpu"))
    held = 0
    for name in sorted(n for n in tensors if n.startswith(prefix) and n.endswith(("_blocks", "_scales"))):
        proj, part = name.removeprefix(prefix).rsplit("_", 1)
        kind = {"gate_up_proj": "gate_up", "down_proj": "down"}[proj]
        held += writer.write(0, None, kind, {"blocks": "weight", "scales": "scale"}[part], lambda: tensors[name],
                             name, path)
    writer.check_scales(str(tmp_path))
    assert held == 3 * 4
    gate = dequantize_blocks(banks.w13[:, :64], banks.w13_scale[:, :64], BLOCK)
    up = dequantize_blocks(banks.w13[:, 64:], banks.w13_scale[:, 64:], BLOCK)
    down = dequantize_blocks(banks.w2, banks.w2_scale, BLOCK)
    assert torch.equal(gate, experts.gate_up_proj[..., ::2].transpose(1, 2))
    assert torch.equal(up, experts.gate_up_proj[..., 1::2].transpose(1, 2))
    assert torch.equal(down, experts.down_proj.transpose(1, 2))
    assert gate.abs().max() > 0 and not torch.equal(gate, up)


def test_quantization_mxfp4_with_dummy_weights(tmp_path):
    from tests.support.fixtures import write_config_dir

    config = QWEN3.to_dict()
    config.update(hidden_size=256, moe_intermediate_size=192, head_dim=64)
    path = write_config_dir(str(tmp_path), config)
    llm = LLM(path, load_format="dummy", quantization="mxfp4", **ENGINE)
    strategy = llm.engine.runner.strategy
    bf16_bytes = 3 * 256 * 192 * 2
    assert strategy.expert_bytes == 3 * 256 * 192 // 2 + (2 * 192 * 8 + 256 * 6)  # nibbles + a byte per 32 values
    assert strategy.expert_bytes < bf16_bytes / 3.7
    banks = strategy.banks[0]
    assert banks.w13_scale.dtype == torch.uint8 and banks.w13.ne(0).any()
    values = dequantize_blocks(banks.w2, banks.w2_scale, BLOCK)
    assert values.abs().max() < 0.2 and values.std() > 0.01  # N(0, 0.02) experts, quantized
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_the_host_channel_computes_a_bf16_models_mxfp4_experts_in_the_kernel():
    """The compiled host kernel reads MXFP4 banks for a bf16 model (on a GPU too); a float32
    model's host routes take the reference on a CPU-only machine and are refused on a GPU."""
    from moeferry.config import ConfigError
    from moeferry.moe.host_channel import HostExpertChannel
    from moeferry.moe.formats import mxfp4_format
    from moeferry.moe.banks import ExpertBanks

    banks = {0: ExpertBanks.allocate(4, 32, 32, mxfp4_format(), torch.bfloat16, torch.device("cpu"), zero=True)}
    assert HostExpertChannel(banks, 4, 2, torch.device("cpu"), 1, torch.bfloat16).compiled
    assert not HostExpertChannel(banks, 4, 2, torch.device("cpu"), 1, torch.float32).compiled
    with pytest.raises(ConfigError, match="computes bfloat16 experts, not torch.float32"):
        HostExpertChannel(banks, 4, 2, torch.device("cuda"), 1, torch.float32)


# --- GPU: the Triton path, CUDA graphs, pinned host banks ---------------------------------

GPU_ENGINE = dict(dtype="bfloat16", device="cuda", max_running_requests=4, num_tokens=4096)


@pytest.mark.gpu
def test_every_strategy_gives_the_same_bits_on_mxfp4_experts_on_gpu(bf16_checkpoint):
    """Triton over MXFP4 slots (graph-captured decode, gather copies of the byte and scale rows,
    the prefill stream, demand prefill) gives gpu's bits; the logits stay within bf16 rounding of
    the float32 reference path's."""
    path = bf16_checkpoint[0]
    results = []
    for strategy, kwargs in (("gpu", {}), ("uva", {}), ("offload", {"moe_cache_slots": 10}),
                             ("offload", {"moe_cache_slots": 10, "moe_prefill_demand_tokens": 64})):
        llm = LLM(path, moe_strategy=strategy, quantization="mxfp4", **GPU_ENGINE, **kwargs)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0))
        results.append((_all_logits(llm, PROMPTS), [o.token_ids for o in outs]))
        del llm
    for logits, tokens in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(logits, results[0][0])) and tokens == results[0][1]
    reference = LLM(path, quantization="mxfp4", **ENGINE)
    for got, ref in zip(results[0][0], _all_logits(reference, PROMPTS)):
        assert (got.cpu() - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.gpu
def test_quantization_mxfp4_dummy_at_the_qwen3_30b_shape_on_gpu(tmp_path):
    """12 layers of Qwen3-30B-A3B with --quantization mxfp4 --load-format dummy: 2.39 MiB per
    expert (int4's bytes), 3.76x the experts of bf16 in the same --moe-cache-gb, offload decodes
    gpu's tokens."""
    from tests.models.dummy_30b import offload_decodes_gpus_tokens

    expert_bytes, plan = offload_decodes_gpus_tokens(tmp_path, "mxfp4", 2.0)
    assert expert_bytes == 3 * 2048 * 768 // 2 + (2 * 768 * 64 + 2048 * 24)
    assert plan.expert_slots == int(2.0 * 2**30 // expert_bytes) == 856  # bf16: 227
    assert "mxfp4 e2m1" in plan.table()


def test_fixture_shapes_are_gpt_oss_s():
    blocks, scales = mxfp4_blocks(torch.randn(2, 6, 64))
    assert blocks.shape == (2, 6, 2, 16) and scales.shape == (2, 6, 2) and blocks.dtype == scales.dtype == torch.uint8
