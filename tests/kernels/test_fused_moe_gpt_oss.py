"""fused_moe's gpt-oss options: per-expert biases on both GEMMs and the clamped SwiGLU.
Triton (under TRITON_INTERPRET=1 on CPU) against the reference, the reference against a
per-route float64 oracle written from transformers' GptOssExperts, bit-identity over a slot
pool, the host op's fallback; GPU tests at gpt-oss-20b's expert shape."""
import pytest
import torch

from moeferry.kernels.fused_moe import SILU, clamped_swiglu, fused_moe
from tests.kernels.test_fused_moe import make_layer, make_routes, rel_err, scatter_into_pool

GPT_OSS = clamped_swiglu(1.702, 7.0)


def make_biases(num_experts, hidden_size, intermediate_size, dtype, device="cpu", seed=5, scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    b13 = (scale * torch.randn(num_experts, 2 * intermediate_size, generator=gen)).to(dtype).to(device)
    b2 = (scale * torch.randn(num_experts, hidden_size, generator=gen)).to(dtype).to(device)
    return b13, b2


def oracle(hidden, w13, w2, b13, b2, topk_weights, topk_ids, alpha, limit):
    """Per route in float64, as GptOssExperts computes it (gate and up already de-interleaved)."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(hidden.shape[0]):
        x = hidden[t].double().cpu()
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate_up = w13[e].double().cpu() @ x + b13[e].double().cpu()
            gate = gate_up[:inter].clamp(max=limit)
            up = gate_up[inter:].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(gate * alpha)
            out[t] += float(topk_weights[t, k]) * (w2[e].double().cpu() @ act + b2[e].double().cpu())
    return out


def _layer(num_experts, hidden_size, inter, num_tokens, top_k, dtype, device="cpu", gain=3.0):
    """Weights scaled by `gain` so that some gate/up values pass the limit and clamp."""
    w13, w2 = make_layer(num_experts, hidden_size, inter, dtype, device)
    w13 = (w13.float() * gain).to(dtype)
    b13, b2 = make_biases(num_experts, hidden_size, inter, dtype, device)
    hidden, weights, ids = make_routes(num_tokens, hidden_size, num_experts, top_k, dtype, device)
    return hidden, w13, w2, b13, b2, weights, ids


def test_the_layer_clamps_some_values():
    hidden, w13, w2, b13, b2, _, _ = _layer(16, 80, 48, 9, 2, torch.float32)
    gate_up = torch.einsum("th,eih->tei", hidden, w13) + b13
    assert (gate_up.abs() > 7.0).float().mean() > 0.02


def test_reference_matches_the_oracle():
    hidden, w13, w2, b13, b2, weights, ids = _layer(16, 80, 48, 9, 2, torch.float32)
    got = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=16, w13_bias=b13, w2_bias=b2,
                    activation=GPT_OSS, impl="reference")
    assert rel_err(got, oracle(hidden, w13, w2, b13, b2, weights, ids, 1.702, 7.0)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,assignment", [(3, "naive"), (3, "sorted"), (21, "sorted")])
@pytest.mark.parametrize("biases", [True, False])
def test_triton_matches_reference(dtype, num_tokens, assignment, biases):
    num_experts, top_k = 32, 2
    hidden, w13, w2, b13, b2, weights, ids = _layer(num_experts, 80, 48, num_tokens, top_k, dtype)
    kwargs = dict(num_routed_experts=num_experts, activation=GPT_OSS,
                  w13_bias=b13 if biases else None, w2_bias=b2 if biases else None)
    got = fused_moe(hidden, w13, w2, weights, ids, block_assignment=assignment, impl="triton", **kwargs)
    ref = fused_moe(hidden, w13, w2, weights, ids, impl="reference", **kwargs)
    assert got.abs().max() > 0.1
    assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_triton_biases_with_silu_match_reference():
    hidden, w13, w2, b13, b2, weights, ids = _layer(16, 64, 32, 7, 2, torch.float32, gain=1.0)
    kwargs = dict(num_routed_experts=16, w13_bias=b13, w2_bias=b2, activation=SILU)
    got = fused_moe(hidden, w13, w2, weights, ids, impl="triton", **kwargs)
    ref = fused_moe(hidden, w13, w2, weights, ids, impl="reference", **kwargs)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_slot_pool_with_bias_banks_gives_bit_identical_output(impl):
    """The bias banks travel with the experts: the same routes over a layer's banks and over a
    pool holding the same rows (biases included) at other slots give the same bits."""
    hidden, w13, w2, b13, b2, weights, ids = _layer(16, 64, 32, 9, 2, torch.float32)
    pool13, pool2, slot_of = scatter_into_pool(w13, w2, 300)
    pool_b13 = torch.randn(300, b13.shape[1])
    pool_b2 = torch.randn(300, b2.shape[1])
    pool_b13[slot_of], pool_b2[slot_of] = b13, b2
    over_bank = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=16, w13_bias=b13, w2_bias=b2,
                          activation=GPT_OSS, impl=impl)
    over_pool = fused_moe(hidden, pool13, pool2, weights, slot_of[ids], num_routed_experts=16, w13_bias=pool_b13,
                          w2_bias=pool_b2, activation=GPT_OSS, impl=impl)
    assert torch.equal(over_bank, over_pool)


def test_host_op_computes_the_clamped_swiglu_within_bf16_rounding():
    """The host op (the compiled kernel where it builds; its own tests check it bit for bit
    against a model of its rounding) against the reference, biases and clamp included."""
    hidden, w13, w2, b13, b2, weights, ids = _layer(16, 64, 32, 5, 2, torch.bfloat16)
    kwargs = dict(num_routed_experts=16, w13_bias=b13, w2_bias=b2, activation=GPT_OSS)
    got = fused_moe(hidden, w13, w2, weights, ids, impl="host", **kwargs)
    ref = fused_moe(hidden, w13, w2, weights, ids, impl="reference", **kwargs)
    assert got.abs().max() > 0.1
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=2e-2)


def test_one_bias_alone_is_refused():
    hidden, w13, w2, b13, _, weights, ids = _layer(8, 32, 16, 3, 2, torch.float32)
    for impl in ("reference", "triton"):
        with pytest.raises(ValueError, match="w13_bias and w2_bias"):
            fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=8, w13_bias=b13, impl=impl)


# --- GPU: gpt-oss-20b's expert shape (H = I = 2880, 32 experts, top-4) -----------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 600])
def test_triton_matches_reference_at_gpt_oss_20b_shape_on_gpu(num_tokens):
    hidden, w13, w2, b13, b2, weights, ids = _layer(32, 2880, 2880, num_tokens, 4, torch.bfloat16, "cuda")
    kwargs = dict(num_routed_experts=32, w13_bias=b13, w2_bias=b2, activation=GPT_OSS)
    got = fused_moe(hidden, w13, w2, weights, ids, **kwargs)
    ref = fused_moe(hidden, w13, w2, weights, ids, impl="reference", **kwargs)
    assert rel_err(got, ref) < 1e-2
    pool13, pool2, slot_of = scatter_into_pool(w13, w2, 100)
    pool_b13 = torch.zeros(100, b13.shape[1], dtype=b13.dtype, device="cuda")
    pool_b2 = torch.zeros(100, b2.shape[1], dtype=b2.dtype, device="cuda")
    pool_b13[slot_of], pool_b2[slot_of] = b13, b2
    over_pool = fused_moe(hidden, pool13, pool2, weights, slot_of[ids], num_routed_experts=32, w13_bias=pool_b13,
                          w2_bias=pool_b2, activation=GPT_OSS)
    assert torch.equal(got, over_pool)
