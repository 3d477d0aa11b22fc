"""fused_moe over MXFP4 banks (FP4 E2M1 codes two to a byte, an E8M0 scale per row and 32
values): the dequantizer against transformers' own (convert_moe_packed_tensors, FP4_VALUES), the
OCP quantizer (exact on representable values, round to nearest even, its error bound), the
reference against a float64 oracle over dequantized weights, the Triton kernel
(TRITON_INTERPRET=1 on CPU) against the reference, slot-pool bit identity; GPU tests at the
Qwen3-30B-A3B expert shape."""
import pytest
import torch
import triton
import triton.language as tl

from moeferry.kernels.fused_moe import E2M1_VALUES, fused_moe
from moeferry.kernels.fused_moe.reference import dequantize_blocks, e8m0_to_float, unpack_mxfp4
from moeferry.kernels.fused_moe.triton import _e2m1_weight, _int4_weight
from moeferry.moe.formats import pack_mxfp4, quantize_mxfp4
from tests.kernels.test_fused_moe import make_layer, make_routes, oracle, rel_err
from tests.kernels.test_fused_moe_fp8 import assert_triton_matches_reference
from tests.kernels.test_fused_moe_int4 import assert_quantized_banks_match_reference_on_gpu, force_split_fields

BLOCK = (1, 32)


def mxfp4_layer(num_experts, hidden_size, intermediate_size, seed=0, device="cpu"):
    """((bytes w13, scales, bytes w2, scales), (float64 dequantized w13, w2))."""
    w13, w2 = make_layer(num_experts, hidden_size, intermediate_size, torch.float32, seed=seed)
    q13, s13 = quantize_mxfp4(w13)  # per row: gate and up rows never share a block
    q2, s2 = quantize_mxfp4(w2)

    def deq(q, s, cols):  # element by element: the definition
        values = torch.tensor(E2M1_VALUES, dtype=torch.float64)[unpack_codes(q, cols)]
        return values * torch.pow(2.0, s.double() - 127).repeat_interleave(32, dim=-1)[..., :cols]

    banks = tuple(t.to(device) for t in (q13, s13, q2, s2))
    return banks, (deq(q13, s13, hidden_size), deq(q2, s2, intermediate_size))


def unpack_codes(packed, cols):
    """E2M1 codes [..., cols] of bytes [..., ceil(cols / 2)], code 2j in the low nibble."""
    codes = torch.empty(*packed.shape[:-1], 2 * packed.shape[-1], dtype=torch.long)
    codes[..., 0::2] = (packed & 0xF).long()
    codes[..., 1::2] = (packed >> 4).long()
    return codes[..., :cols]


def test_the_e2m1_table_and_nibble_order_are_transformers():
    from transformers.integrations.mxfp4 import FP4_VALUES

    assert list(E2M1_VALUES) == FP4_VALUES
    codes = torch.randint(0, 16, (3, 7), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_mxfp4(codes)
    assert packed.shape == (3, 4) and torch.equal(unpack_codes(packed, 7), codes.long())
    assert torch.equal(unpack_mxfp4(packed, 7), torch.tensor(FP4_VALUES)[codes.long()])


@pytest.mark.parametrize("experts,rows,cols", [(2, 6, 64), (3, 4, 320)])
def test_dequantization_matches_transformers_convert_moe_packed_tensors(experts, rows, cols):
    """gpt-oss's layout: blocks [E, rows, cols / 32, 16], scales [E, rows, cols / 32]; transformers
    returns the dequantized matrix transposed, [E, cols, rows]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(cols)
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 140, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
    scales[0, 0, 0], scales[-1, -1, -1] = 1, 254  # the ends of E8M0's normal range
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    ours = dequantize_blocks(blocks.flatten(-2), scales, BLOCK)
    assert torch.equal(ours, theirs)


def test_e8m0_scales_are_exact_powers_of_two():
    s = torch.arange(0, 255, dtype=torch.uint8)
    assert torch.equal(e8m0_to_float(s).double(), torch.pow(2.0, s.double() - 127))


def test_the_quantizer_is_exact_on_representable_values():
    """Blocks of E2M1 values times a power of two (any block maximum, zeros, a partial last
    block of 16) come back exactly."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (5, 8, 80), generator=gen)
    exponents = torch.randint(-20, 10, (5, 8, 3), generator=gen).double()
    weight = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes] * torch.pow(2.0, exponents).repeat_interleave(
        32, dim=-1)[..., :80]
    weight[0, 0, :32] = 0
    packed, scales = quantize_mxfp4(weight.float())
    assert packed.dtype == torch.uint8 and packed.shape == (5, 8, 40) and scales.shape == (5, 8, 3)
    assert scales[0, 0, 0] == 127 and not packed[0, 0, :16].any()  # an all-zero block: scale 1, +0 codes
    assert torch.equal(dequantize_blocks(packed, scales, BLOCK, 80).double(), weight)


def test_the_quantizer_takes_the_ocp_scale_and_rounds_to_nearest_even():
    # block maximum 7: scale 2^(floor(log2 7) - 2) = 1; ties go to the even code; 7 saturates at 6
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -0.2, 0.26, 5.01])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, 0.0, 0.5, 6.0])
    for scale in (1.0, 2.0 ** -9, 2.0 ** 6):
        packed, scales = quantize_mxfp4((ties * scale)[None])
        assert scales.tolist() == [[127 + round(torch.log2(torch.tensor(scale)).item())]]
        assert torch.equal(dequantize_blocks(packed, scales, BLOCK, 12)[0], want * scale)
    tiny = torch.full((1, 32), 2.0 ** -140)  # below E8M0's range: the scale clamps at 2^-127
    assert quantize_mxfp4(tiny)[1].item() == 0


@pytest.mark.parametrize("cols", [256, 100, 33])
def test_the_quantizer_error_is_half_a_step_of_its_blocks_grid(cols):
    gen = torch.Generator().manual_seed(cols)
    weight = torch.randn(6, cols, generator=gen) * torch.rand(6, 1, generator=gen) * 4
    packed, scales = quantize_mxfp4(weight)
    deq = dequantize_blocks(packed, scales, BLOCK, cols)
    scale = e8m0_to_float(scales).repeat_interleave(32, dim=-1)[:, :cols]
    amax = weight.abs().view(-1).new_zeros(6, scales.shape[1] * 32)
    amax[:, :cols] = weight.abs()
    amax = amax.view(6, -1, 32).amax(-1)
    assert torch.equal(scales.int() - 127, torch.floor(torch.log2(amax)).int() - 2)
    a = weight.abs() / scale  # in [0, 8)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    bound = torch.where(a <= 6, step / 2, a - 6) * scale
    assert ((deq - weight).abs() <= bound).all()
    assert (deq - weight).abs().max() > 0  # and it did round


def test_reference_matches_per_token_oracle_over_dequantized_weights():
    (q13, s13, q2, s2), (deq13, deq2) = mxfp4_layer(16, 80, 48)
    hidden, weights, ids = make_routes(21, 80, 16, 4, torch.float32)
    got = fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=16, impl="reference",
                    w13_scale=s13, w2_scale=s2, block_shape=BLOCK)
    assert got.abs().max() > 0.1
    torch.testing.assert_close(got.double(), oracle(hidden, deq13, deq2, weights, ids), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,assignment", [(3, "naive"), (21, "sorted"), (5, "sorted")])
def test_triton_matches_reference_on_mxfp4_banks(dtype, num_tokens, assignment):
    num_experts, top_k, hidden_size, intermediate_size = 32, 2, 80, 48  # ragged blocks, masked tails
    (q13, s13, q2, s2), _ = mxfp4_layer(num_experts, hidden_size, intermediate_size, seed=num_tokens)
    assert_triton_matches_reference(q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=BLOCK), num_tokens,
                                    top_k, assignment, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,assignment", [(3, "naive"), (21, "sorted")])
def test_split_field_tiles_match_reference_on_mxfp4_banks(monkeypatch, dtype, num_tokens, assignment):
    num_experts, top_k, hidden_size, intermediate_size = 32, 2, 80, 48  # K tiles of 64 and 32, masked tails
    taken = force_split_fields(monkeypatch)
    (q13, s13, q2, s2), _ = mxfp4_layer(num_experts, hidden_size, intermediate_size, seed=num_tokens)
    assert_triton_matches_reference(q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=BLOCK), num_tokens,
                                    top_k, assignment, dtype)
    assert taken == [True, True]


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_mxfp4_slot_pool_gives_bit_identical_output(impl):
    num_experts, top_k, hidden_size, intermediate_size, num_slots = 16, 2, 64, 32, 300
    banks, _ = mxfp4_layer(num_experts, hidden_size, intermediate_size)
    gen = torch.Generator().manual_seed(2)
    slot_of = torch.randperm(num_slots, generator=gen)[:num_experts]
    pools = []
    for bank in banks:  # random bytes elsewhere (scales near 2^0), the layer's rows at its slots
        pool = torch.randint(0, 256, (num_slots, *bank.shape[1:]), generator=gen, dtype=torch.uint8)
        if bank is banks[1] or bank is banks[3]:
            pool = pool % 16 + 120
        pool[slot_of] = bank
        pools.append(pool)
    hidden, weights, ids = make_routes(9, hidden_size, num_experts, top_k, torch.bfloat16)
    kwargs = dict(num_routed_experts=num_experts, impl=impl, block_shape=BLOCK)
    over_bank = fused_moe(hidden, banks[0], banks[2], weights, ids, w13_scale=banks[1], w2_scale=banks[3], **kwargs)
    over_pool = fused_moe(hidden, pools[0], pools[2], weights, slot_of[ids], w13_scale=pools[1], w2_scale=pools[3],
                          **kwargs)
    assert over_bank.abs().max() > 0.1 and torch.equal(over_bank, over_pool)


def test_mxfp4_scales_must_be_e8m0_bytes():
    (q13, s13, q2, s2), _ = mxfp4_layer(4, 32, 32)
    hidden, weights, ids = make_routes(2, 32, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="must be torch.uint8"):
        fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=4, impl="triton", w13_scale=s13.float(),
                  w2_scale=s2.float(), block_shape=BLOCK)


# --- GPU: the Qwen3-30B-A3B expert shape --------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 600])
def test_triton_mxfp4_matches_reference_on_gpu(num_tokens):
    banks, _ = mxfp4_layer(128, 2048, 768, device="cuda")
    assert_quantized_banks_match_reference_on_gpu(banks, BLOCK, num_tokens,
                                                  ("sorted", "naive") if num_tokens <= 4 else ("sorted",))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64])
def test_split_field_mxfp4_tiles_match_reference_on_gpu(monkeypatch, num_tokens):
    taken = force_split_fields(monkeypatch)
    banks, _ = mxfp4_layer(128, 2048, 768, device="cuda")
    assert_quantized_banks_match_reference_on_gpu(banks, BLOCK, num_tokens)
    assert taken and all(taken)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 600])
def test_mxfp4_pinned_host_banks_give_the_device_banks_bits_on_gpu(num_tokens):
    banks, _ = mxfp4_layer(128, 2048, 768, device="cuda")
    hidden, weights, ids = make_routes(num_tokens, 2048, 128, 8, torch.bfloat16, "cuda", 1)
    host = [t.cpu().pin_memory() for t in banks]
    on_device = fused_moe(hidden, banks[0], banks[2], weights, ids, num_routed_experts=128,
                          block_assignment="sorted", w13_scale=banks[1], w2_scale=banks[3], block_shape=BLOCK)
    from_host = fused_moe(hidden, host[0], host[2], weights, ids, num_routed_experts=128,
                          w13_scale=host[1], w2_scale=host[3], block_shape=BLOCK)
    assert torch.equal(from_host, on_device)


@triton.jit
def _decode_every_field_kernel(out_int4, out_e2m1, DTYPE: tl.constexpr):
    codes = tl.arange(0, 16)
    tl.store(out_int4 + codes, _int4_weight(codes, DTYPE))
    tl.store(out_e2m1 + codes, _e2m1_weight(codes, DTYPE))


def _decode_every_field(dtype):
    """(int4, E2M1) values of the fields 0..15 through the kernel's decoders, in `dtype`."""
    int4, e2m1 = torch.full((16,), 99.0, dtype=dtype), torch.full((16,), 99.0, dtype=dtype)
    _decode_every_field_kernel[(1,)](int4, e2m1, DTYPE=tl.bfloat16 if dtype == torch.bfloat16 else tl.float32)
    return int4, e2m1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernels_4bit_decoders_give_every_code_exactly(dtype):
    """Every 4-bit field through the split-field tiles' decoders (bf16 built from the bits, other
    dtypes converted): int4 is field - 8, MXFP4 the E2M1 table (signed zero included)."""
    int4, e2m1 = _decode_every_field(dtype)
    assert torch.equal(int4, torch.arange(16, dtype=dtype) - 8)
    want = torch.tensor(E2M1_VALUES, dtype=dtype)
    assert torch.equal(e2m1, want) and torch.equal(torch.signbit(e2m1), torch.signbit(want))
