"""fused_moe over block-FP8 banks: the block quantizer against transformers' FP8 dequantizer,
the reference against a float64 per-token oracle over dequantized weights, the Triton kernel
(TRITON_INTERPRET=1 on CPU) against the reference, and bit identity between a layer's banks and
a slot pool. GPU tests run the Qwen3-30B-A3B expert shape."""
import pytest
import torch

from moeferry.kernels.fused_moe import fused_moe
from moeferry.kernels.fused_moe.reference import dequantize_blocks, dequantize_w13
from moeferry.moe.formats import FP8_MAX, quantize_fp8_blocks, scale_grid
from tests.kernels.test_fused_moe import make_layer, make_routes, oracle, rel_err


def quantize_layer(w13, w2, block_shape):
    """(fp8 w13, w13 scales [E, 2 gate-blocks, ...], fp8 w2, w2 scales): gate and up blocked apart."""
    gate, up = w13.chunk(2, dim=1)
    q_gate, s_gate = quantize_fp8_blocks(gate, block_shape)
    q_up, s_up = quantize_fp8_blocks(up, block_shape)
    q2, s2 = quantize_fp8_blocks(w2, block_shape)
    return torch.cat([q_gate, q_up], dim=1), torch.cat([s_gate, s_up], dim=1), q2, s2


def expand_scales_elementwise(q, scales, block_shape):
    """float64 dequantization element by element (the definition, not the kernel's expansion)."""
    rows, cols = q.shape[-2:]
    r = torch.arange(rows) // block_shape[0]
    c = torch.arange(cols) // block_shape[1]
    return q.double() * scales.double()[..., r[:, None], c[None, :]]


def fp8_layer(num_experts, hidden_size, intermediate_size, block_shape, seed=0):
    w13, w2 = make_layer(num_experts, hidden_size, intermediate_size, torch.float32, seed=seed)
    q13, s13, q2, s2 = quantize_layer(w13, w2, block_shape)
    gate, up = q13.chunk(2, dim=1)
    s_gate, s_up = s13.chunk(2, dim=1)
    deq13 = torch.cat([expand_scales_elementwise(gate, s_gate, block_shape),
                       expand_scales_elementwise(up, s_up, block_shape)], dim=1)
    deq2 = expand_scales_elementwise(q2, s2, block_shape)
    return (q13, s13, q2, s2), (deq13, deq2)


@pytest.mark.parametrize("shape,block", [((3, 256, 384), (128, 128)), ((2, 64, 96), (32, 16))])
def test_dequantization_matches_transformers_fp8_dequantizer(shape, block):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    weight = torch.randn(shape, generator=torch.Generator().manual_seed(4)) * 3
    q, scales = quantize_fp8_blocks(weight, block)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (shape[0], *scale_grid(*shape[1:], block))
    theirs = torch.stack([Fp8Dequantize(None)._dequantize_one(q[i], scales[i], torch.float32)
                          for i in range(shape[0])])
    assert torch.equal(dequantize_blocks(q, scales, block), theirs)


@pytest.mark.parametrize("rows,cols,block", [(256, 384, (128, 128)), (80, 48, (32, 32)), (100, 70, (128, 128))])
def test_block_quantizer_uses_each_blocks_range_and_e4m3_precision(rows, cols, block):
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(2, rows, cols, generator=gen) * torch.rand(2, rows, 1, generator=gen) * 5
    weight[0, :block[0], :block[1]] = 0  # an all-zero block: scale 1, zeros
    q, scales = quantize_fp8_blocks(weight, block)
    deq = expand_scales_elementwise(q, scales, block)
    grid_r, grid_c = scale_grid(rows, cols, block)
    assert scales[0, 0, 0] == 1 and not q[0, :block[0], :block[1]].float().any()
    for b in range(2):
        for i in range(grid_r):
            for j in range(grid_c):
                tile = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
                w, d, s = weight[b][tile].double(), deq[b][tile], float(scales[b, i, j])
                if w.abs().max() == 0:
                    continue
                assert s == pytest.approx(float(w.abs().max()) / FP8_MAX, rel=1e-6)
                assert q[b][tile].float().abs().max() == FP8_MAX  # the block's largest value maps to 448
                # e4m3: 3 mantissa bits (half-ulp 2^-4 relative); subnormals below 2^-6 step by 2^-9
                assert ((d - w).abs() <= w.abs() * 2.0 ** -4 + s * 2.0 ** -10).all()


@pytest.mark.parametrize("block", [(16, 16), (32, 16), (128, 128)])
def test_reference_matches_per_token_oracle_over_dequantized_weights(block):
    (q13, s13, q2, s2), (deq13, deq2) = fp8_layer(16, 80, 48, block)
    hidden, weights, ids = make_routes(21, 80, 16, 4, torch.float32)
    got = fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=16, impl="reference",
                    w13_scale=s13, w2_scale=s2, block_shape=block)
    want = oracle(hidden, deq13, deq2, weights, ids)
    assert got.abs().max() > 0.1
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_the_reference_dequantizes_gate_and_up_apart():
    """With I not a multiple of the block rows, a gate block never spans into the up rows."""
    block = (32, 32)
    (q13, s13, _, _), (deq13, _) = fp8_layer(2, 64, 48, block)  # I = 48: gate blocks of 32 and 16 rows
    for e in range(2):
        assert torch.equal(dequantize_w13(q13[e], s13[e], block), deq13[e].float())  # one rounding of an exact product


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,assignment,block", [
    (3, "naive", (32, 32)), (3, "sorted", (16, 32)), (21, "sorted", (32, 32)), (5, "sorted", (128, 128)),
])
def test_triton_matches_reference_on_fp8_banks(dtype, num_tokens, assignment, block):
    num_experts, top_k, hidden_size, intermediate_size = 32, 2, 80, 48  # ragged blocks, masked tails
    (q13, s13, q2, s2), _ = fp8_layer(num_experts, hidden_size, intermediate_size, block)
    assert_triton_matches_reference(q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=block), num_tokens,
                                    top_k, assignment, dtype)


def assert_triton_matches_reference(q13, q2, scales: dict, num_tokens: int, top_k: int, assignment: str, dtype):
    """The Triton kernel over quantized banks (fp8, or int4 words) against the reference, every
    element, on fresh routes; from 4 tokens one expert is shared by every token (a group of
    several blocks)."""
    num_experts, hidden_size = q2.shape[0], q2.shape[1]
    hidden, weights, ids = make_routes(num_tokens, hidden_size, num_experts, top_k, dtype)
    if num_tokens > 3:
        ids[:, 0] = ids[0, 0]
    got = fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=num_experts, block_assignment=assignment,
                    impl="triton", **scales)
    ref = fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=num_experts, impl="reference", **scales)
    assert got.dtype == dtype and got.abs().max() > 0.1
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:  # the activations are rounded to bf16 between the GEMMs; every element within that
        torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=2e-2)
        assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fp8_slot_pool_gives_bit_identical_output(impl):
    num_experts, top_k, hidden_size, intermediate_size, num_slots = 16, 2, 64, 32, 300
    block = (32, 32)
    banks, _ = fp8_layer(num_experts, hidden_size, intermediate_size, block)
    gen = torch.Generator().manual_seed(2)
    slot_of = torch.randperm(num_slots, generator=gen)[:num_experts]
    pools = []
    for bank in banks:  # random rows elsewhere, the layer's rows at its slots
        pool = torch.randn((num_slots, *bank.shape[1:]), generator=gen).to(bank.dtype)
        pool[slot_of] = bank
        pools.append(pool)
    hidden, weights, ids = make_routes(9, hidden_size, num_experts, top_k, torch.bfloat16)
    q13, s13, q2, s2 = banks
    p13, ps13, p2, ps2 = pools
    over_bank = fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=num_experts, impl=impl,
                          w13_scale=s13, w2_scale=s2, block_shape=block)
    over_pool = fused_moe(hidden, p13, p2, weights, slot_of[ids], num_routed_experts=num_experts, impl=impl,
                          w13_scale=ps13, w2_scale=ps2, block_shape=block)
    assert over_bank.abs().max() > 0.1 and torch.equal(over_bank, over_pool)


def test_scales_come_with_their_block_shape_and_match_it():
    (q13, s13, q2, s2), _ = fp8_layer(4, 32, 16, (16, 16))
    hidden, weights, ids = make_routes(2, 32, 4, 2, torch.float32)
    for impl in ("reference", "triton"):
        with pytest.raises(ValueError, match="come together"):
            fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=4, impl=impl, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="do not match"):
        fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=4, impl="triton", w13_scale=s13,
                  w2_scale=s2, block_shape=(8, 16))


# --- GPU: the Qwen3-30B-A3B expert shape, 128x128 blocks ----------------------------------

def _qwen3_fp8_layer(num_tokens, seed=0):
    w13, w2 = make_layer(128, 2048, 768, torch.float32, "cpu", seed)
    q13, s13, q2, s2 = (t.cuda() for t in quantize_layer(w13, w2, (128, 128)))
    hidden, weights, ids = make_routes(num_tokens, 2048, 128, 8, torch.bfloat16, "cuda", seed + 1)
    return hidden, (q13, s13, q2, s2), weights, ids


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 600])
def test_triton_fp8_matches_reference_on_gpu(num_tokens):
    hidden, (q13, s13, q2, s2), weights, ids = _qwen3_fp8_layer(num_tokens)
    scales = dict(w13_scale=s13, w2_scale=s2, block_shape=(128, 128))
    ref = fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=128, impl="reference", **scales)
    for assignment in ("sorted", "naive") if num_tokens <= 4 else ("sorted",):
        got = fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=128, block_assignment=assignment,
                        **scales)
        assert rel_err(got, ref) < 1e-2
        torch.testing.assert_close(got.float(), ref.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 600])
def test_fp8_pinned_host_banks_give_the_device_banks_bits_on_gpu(num_tokens):
    hidden, banks, weights, ids = _qwen3_fp8_layer(num_tokens)
    host = [t.cpu().pin_memory() for t in banks]
    on_device = fused_moe(hidden, banks[0], banks[2], weights, ids, num_routed_experts=128,
                          block_assignment="sorted", w13_scale=banks[1], w2_scale=banks[3], block_shape=(128, 128))
    from_host = fused_moe(hidden, host[0], host[2], weights, ids, num_routed_experts=128,
                          w13_scale=host[1], w2_scale=host[3], block_shape=(128, 128))
    assert torch.equal(from_host, on_device)
