"""uva: the block-assignment rule seen through the MoE layer and through the model.

Host-resident banks always take the sorted path (moe_align runs, each routed expert is read
once per step); device banks take the naive path while T * K * 4 <= E. On the CPU, residency
is simulated (is_host_resident patched) and the Triton kernel is forced under the
interpreter, so the path the kernel takes can be observed by counting moe_align calls.
GPU tests use real pinned, device-mapped memory with device banks as the control."""

import pytest
import torch

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError, EngineConfig, ModelConfig
from moeferry.kernels.fused_moe import fused_moe
from moeferry.kernels.fused_moe import reference
from moeferry.kernels.router import softmax_topk
from moeferry.kernels.fused_moe import triton as triton_fused_moe
from moeferry.layers.moe import MoEBlock
from moeferry.moe import strategy as strategy_module
from moeferry.engine.planner import plan_memory
from moeferry.moe.strategies import create_strategy
from tests.support.fixtures import family_configs, make_checkpoint

E, K, H, I = 32, 2, 32, 16  # naive allowed while T * 2 * 4 <= 32, i.e. up to 4 tokens


def make_block(strategy, device="cpu", dtype=torch.float32, seed=0, **options):
    """A one-layer MoEBlock over `strategy` ("uva" or "gpu"; engine `options`), banks filled with
    O(1)-output weights."""
    import transformers

    hf = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                                     norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, vocab_size=64)
    mc = ModelConfig(path="", hf=hf)
    ec = EngineConfig(device=device, dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
                      moe_strategy=strategy, moe_collect_stats=True, **options)
    torch.manual_seed(seed)
    block = MoEBlock(mc, 0, create_strategy(strategy, ec, mc), renormalize=True, shared_expert=False)
    block.to(device=device, dtype=dtype).requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    block.banks.w13.copy_(torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5)
    block.banks.w2.copy_(torch.randn(E, H, I, generator=gen) / I ** 0.25)
    block.strategy.finalize(plan_memory(block.strategy.engine_config, block.strategy.memory_needs()))
    return block


def tokens(num_tokens, device="cpu", dtype=torch.float32, seed=1):
    return torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def reference_out(block, x):
    """The plain-torch grouped reference over the block's own banks and routing."""
    weights, ids = softmax_topk(block.gate(x), K, True)
    return reference.fused_moe(x, block.banks.w13.to(x.device), block.banks.w2.to(x.device), weights, ids,
                               num_routed_experts=E)


def rel_err(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm())


@pytest.fixture
def align_calls(monkeypatch):
    """The moe_align calls the Triton fused_moe makes: one per sorted-path call, none on naive."""
    calls = []
    real = triton_fused_moe.moe_align_block_size
    monkeypatch.setattr(triton_fused_moe, "moe_align_block_size", lambda *a: calls.append(a) or real(*a))
    return calls


@pytest.fixture
def kernel_calls(monkeypatch):
    """Forces the Triton kernel (interpreted on the CPU) for every strategy; records each call's T."""
    calls = []

    def forced(hidden, *args, **kwargs):
        calls.append(hidden.shape[0])
        return fused_moe(hidden, *args, impl="triton", **kwargs)

    monkeypatch.setattr(strategy_module, "fused_moe", forced)
    return calls


def simulate_host(monkeypatch, tensors):
    """is_host_resident is true for exactly these tensors (pinned memory needs a GPU)."""
    monkeypatch.setattr(triton_fused_moe, "is_host_resident", lambda t: any(t is h for h in tensors))


# --- the layer ----------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["both", "w2", "none"])
@pytest.mark.parametrize("num_tokens", [1, 2, 4, 5])
def test_layer_path_follows_residency(monkeypatch, align_calls, kernel_calls, host, num_tokens):
    block = make_block("uva")
    simulate_host(monkeypatch, {"both": [block.banks.w13, block.banks.w2], "w2": [block.banks.w2], "none": []}[host])
    x = tokens(num_tokens, seed=num_tokens)
    got = block(x, is_decode=True)
    sorted_path = host != "none" or num_tokens * K * 4 > E
    assert kernel_calls == [num_tokens]
    assert len(align_calls) == (1 if sorted_path else 0)
    assert got.abs().max() > 0.1
    assert rel_err(got, reference_out(block, x)) < 1e-5


@pytest.mark.parametrize("override,num_tokens,aligned", [
    ("naive", 1, False), ("naive", 4, False), ("naive", 5, True),  # naive only where the rule allows it
    ("sorted", 1, True), ("auto", 1, True),
])
def test_block_assignment_override(monkeypatch, align_calls, kernel_calls, override, num_tokens, aligned):
    block = make_block("uva", moe_uva_block_assignment=override)
    simulate_host(monkeypatch, [block.banks.w13, block.banks.w2])
    x = tokens(num_tokens, seed=num_tokens)
    got = block(x, is_decode=True)
    assert len(align_calls) == (1 if aligned else 0)
    assert rel_err(got, reference_out(block, x)) < 1e-5
    _, ids = softmax_topk(block.gate(x), K, True)
    reads = block.strategy.stats()["expert_reads"]
    assert reads == (len(torch.unique(ids)) if aligned else ids.numel())  # naive reads an expert per route


def test_block_assignment_refuses_unknown_values():
    with pytest.raises(ConfigError, match="--moe-uva-block-assignment 'grouped' is unknown"):
        EngineConfig(moe_strategy="uva", moe_uva_block_assignment="grouped").check()


# --- the model ----------------------------------------------------------------------------

PROMPTS = [[5, 17, 33, 2, 9, 71, 40], [88, 3]]
# Different lengths: decode runs at 2 tokens, then at 1 once the short request is done.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)]


@pytest.fixture(scope="module")
def qwen3_ckpt(tmp_path_factory):
    name, config = family_configs()[0]  # qwen3_moe: 8 experts, top-2: naive only at 1 token
    assert name == "qwen3_moe"
    path = str(tmp_path_factory.mktemp(name))
    make_checkpoint(config, path)
    return config, path


@pytest.fixture(scope="module")
def gpu_tokens(qwen3_ckpt):
    _, path = qwen3_ckpt
    return [o.token_ids for o in LLM(path, dtype="float32", device="cpu").generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("host_resident", [True, False])
def test_model_uva_matches_gpu_on_either_path(monkeypatch, align_calls, kernel_calls, qwen3_ckpt, gpu_tokens,
                                              host_resident):
    config, path = qwen3_ckpt
    llm = LLM(path, dtype="float32", device="cpu", moe_strategy="uva")
    monkeypatch.setattr(triton_fused_moe, "is_host_resident", lambda t: host_resident)
    got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == gpu_tokens
    experts, top_k = config.num_experts, config.num_experts_per_tok
    assert {1, 2} <= set(kernel_calls)  # decode ran at both widths
    want_sorted = [t for t in kernel_calls if host_resident or not triton_fused_moe.naive_allowed(t, top_k, experts)]
    assert len(align_calls) == len(want_sorted)
    if not host_resident:
        assert len(want_sorted) < len(kernel_calls)  # the one-token steps took the naive path


def test_stats_report_expert_bytes_read_per_step(tmp_path):
    config = dict(family_configs())["qwen2_moe-dense-layer-tied"]  # layer 1 dense; top-4 of 8
    make_checkpoint(config, str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", moe_strategy="uva", moe_collect_stats=True)
    strategy = llm.engine.runner.strategy
    seen = []  # (layer, distinct experts, routes) per decode forward
    real_forward = strategy.forward

    def recording(layer_id, hidden, topk_weights, topk_ids, is_decode, **kwargs):
        if is_decode:
            seen.append((layer_id, len(set(topk_ids.reshape(-1).tolist())), topk_ids.numel()))
        return real_forward(layer_id, hidden, topk_weights, topk_ids, is_decode, **kwargs)

    strategy.forward = recording
    llm.generate(PROMPTS, PARAMS)
    moe_layers = {layer for layer, _, _ in seen}
    assert len(moe_layers) == 2  # layer 1 is dense
    steps = len(seen) // len(moe_layers)
    expert_bytes = 3 * config.hidden_size * config.moe_intermediate_size * 4  # gate, up, down in float32
    distinct = sum(d for _, d, _ in seen)
    stats = strategy.stats()
    assert stats["decode_steps"] == steps == 5  # 6 tokens: the first comes from prefill
    assert stats["expert_reads"] == distinct and stats["routes"] == sum(r for _, _, r in seen)
    assert stats["pcie_bytes_read"] == distinct * expert_bytes
    assert stats["pcie_bytes_per_step"] == pytest.approx(distinct / steps * expert_bytes)


# --- GPU: real pinned, device-mapped memory -----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 4])
def test_pinned_banks_take_sorted_path_device_banks_naive(align_calls, num_tokens):
    uva = make_block("uva", "cuda", torch.bfloat16)
    gpu = make_block("gpu", "cuda", torch.bfloat16)
    assert uva.banks.w13.is_pinned() and uva.banks.w2.is_pinned()
    assert triton_fused_moe.is_host_resident(uva.banks.w13) and gpu.banks.w13.is_cuda
    x = tokens(num_tokens, "cuda", torch.bfloat16, seed=num_tokens)
    from_host = uva(x, is_decode=True)
    assert len(align_calls) == 1  # sorted over mapped host memory
    on_device = gpu(x, is_decode=True)
    assert len(align_calls) == 1  # the control: naive over device memory
    weights, ids = softmax_topk(gpu.gate(x), K, True)
    sorted_on_device = fused_moe(x, gpu.banks.w13, gpu.banks.w2, weights, ids, num_routed_experts=E,
                                     block_assignment="sorted")
    assert torch.equal(from_host, sorted_on_device)  # same kernel, same bytes, read in place
    assert rel_err(on_device, reference_out(gpu, x)) < 2e-2
    assert len(align_calls) == 2  # the explicit sorted call above
    naive = make_block("uva", "cuda", torch.bfloat16, moe_uva_block_assignment="naive")
    naive_from_host = naive(x, is_decode=True)
    assert len(align_calls) == 2  # forced naive over host memory: no alignment
    assert rel_err(naive_from_host, reference_out(gpu, x)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"disable_cuda_graph": True}], ids=["graphs", "eager"])
def test_uva_greedy_equals_gpu_on_the_default_model(options):
    from moeferry.default_model import ensure_default_model

    path = ensure_default_model()
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(10, 50))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM(path, max_running_requests=4).generate(prompts, params)]
    llm = LLM(path, max_running_requests=4, moe_strategy="uva", moe_collect_stats=True, **options)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    stats = llm.engine.runner.strategy.stats()
    assert stats["decode_steps"] > 0 and stats["pcie_bytes_per_step"] > 0
    assert stats["expert_reads"] <= stats["routes"]
