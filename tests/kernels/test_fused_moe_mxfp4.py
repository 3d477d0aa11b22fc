"""fused_moe over MXFP4 banks (FP4 E2M1 codes two to a byte, an E8M0 scale per row and 32
values): the dequantizer against transformers' own (convert_moe_packed_tensors, FP4_VALUES), the
OCP quantizer (exact on representable values, round to nearest even, its error bound), the
reference against a float64 oracle over dequantized weights, the Triton kernel
(TRITON_INTERPRET=1 on CPU) against the reference, in its byte tiles and in its word tiles (the
bytes read as int32 words, each E8M0 power of two folded into its weights: every code times
every scale exactly; the default where a launch allows it), slot-pool bit identity; GPU tests
at the Qwen3-30B-A3B expert shape and gpt-oss's."""
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from moeferry.kernels.fused_moe import E2M1_VALUES, clamped_swiglu, fused_moe
from moeferry.kernels.fused_moe import triton as fm
from moeferry.kernels.fused_moe.reference import dequantize_blocks, e8m0_to_float, unpack_mxfp4
from moeferry.kernels.fused_moe.triton import _e2m1_scaled_weight, _e2m1_weight, _e8m0_fold, _int4_weight
from moeferry.moe.formats import pack_mxfp4, quantize_mxfp4
from tests.kernels.test_fused_moe import make_layer, make_routes, oracle, rel_err
from tests.kernels.test_fused_moe_fp8 import assert_triton_matches_reference
from tests.kernels.test_fused_moe_gpt_oss import make_biases
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


def record_word_tiles(monkeypatch) -> list[bool]:
    """Per MXFP4 GEMM launch of the tensor-core kernel (naive calls too: the route GEMV is
    turned off), whether its K tiles read the bytes as int32 words."""
    taken, words = [], fm._mxfp4_words
    select = fm.select_config
    monkeypatch.setattr(fm, "select_config", lambda *args, **kwargs: replace(select(*args, **kwargs),
                                                                             route_gemv=False))

    def recording(*args):
        taken.append(words(*args))
        return taken[-1]
    monkeypatch.setattr(fm, "_mxfp4_words", recording)
    return taken


def spread_scales(scales: torch.Tensor, seed: int) -> torch.Tensor:
    """`scales` times a random power of two per block, 2^-12 .. 2^2, so the blocks of a K tile
    span a checkpoint's spread of exponents while the outputs stay near 1."""
    gen = torch.Generator().manual_seed(seed)
    return (scales.int() + torch.randint(-12, 3, scales.shape, generator=gen)).to(torch.uint8)


def word_layer(num_experts, hidden_size, intermediate_size, seed):
    """An MXFP4 layer with spread scales, zero codes of both signs and a few all-zero blocks."""
    (q13, s13, q2, s2), _ = mxfp4_layer(num_experts, hidden_size, intermediate_size, seed=seed)
    q13[:, :, 3], q2[:, :, 5] = 0x80, 0x08  # -0 and +0 codes in every row
    q13[0, :, :16] = 0  # expert 0's first gate/up block all zero
    return q13, spread_scales(s13, seed), q2, spread_scales(s2, seed + 1)


# H = 288 (two 128-deep K tiles and a 32-value tail), I = 160 (one tile and a tail): the masks
WORD_SHAPE = (32, 2, 288, 160)  # experts, top-k, hidden, intermediate


@pytest.mark.parametrize("num_tokens,assignment", [(3, "naive"), (9, "sorted")])
def test_word_tiles_are_the_bf16_default_and_match_reference(monkeypatch, num_tokens, assignment):
    taken = record_word_tiles(monkeypatch)
    num_experts, top_k, hidden_size, intermediate_size = WORD_SHAPE
    q13, s13, q2, s2 = word_layer(num_experts, hidden_size, intermediate_size, seed=num_tokens)
    assert_triton_matches_reference(q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=BLOCK), num_tokens,
                                    top_k, assignment, torch.bfloat16)
    assert taken == [True, True]


@pytest.mark.parametrize("dtype,block_k", [(torch.float32, 128), (torch.bfloat16, 256), (torch.float32, 256)])
def test_word_tiles_of_any_depth_match_reference(monkeypatch, dtype, block_k):
    """float32's own K tile (32) is too shallow for words: 128 and 256 forced, 4 and 8 blocks a tile."""
    words = record_word_tiles(monkeypatch)
    split = force_split_fields(monkeypatch, block_k=block_k)
    num_experts, top_k, hidden_size, intermediate_size = WORD_SHAPE
    q13, s13, q2, s2 = word_layer(num_experts, hidden_size, intermediate_size, seed=block_k)
    assert_triton_matches_reference(q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=BLOCK), 5, top_k,
                                    "sorted", dtype)
    assert words == [True, True] and split == [True, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_word_tiles_with_gpt_oss_biases_and_clamped_swiglu_match_reference(monkeypatch, dtype):
    taken = record_word_tiles(monkeypatch)
    force_split_fields(monkeypatch, block_k=128)
    num_experts, top_k, hidden_size, intermediate_size = WORD_SHAPE
    q13, s13, q2, s2 = word_layer(num_experts, hidden_size, intermediate_size, seed=7)
    b13, b2 = make_biases(num_experts, hidden_size, intermediate_size, dtype)
    hidden, weights, ids = make_routes(4, hidden_size, num_experts, top_k, dtype)
    kwargs = dict(num_routed_experts=num_experts, w13_scale=s13, w2_scale=s2, block_shape=BLOCK, w13_bias=b13,
                  w2_bias=b2, activation=clamped_swiglu(1.702, 0.5))  # a limit the gate and up values pass
    got = fused_moe(hidden, q13, q2, weights, ids, impl="triton", **kwargs)
    ref = fused_moe(hidden, q13, q2, weights, ids, impl="reference", **kwargs)
    assert got.abs().max() > 0.1 and taken == [True, True]
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=2e-2)
        assert rel_err(got, ref) < 1e-2


def test_byte_tiles_still_run_when_words_are_turned_off(monkeypatch):
    words = record_word_tiles(monkeypatch)
    split = force_split_fields(monkeypatch, mxfp4_words=False)
    num_experts, top_k, hidden_size, intermediate_size = WORD_SHAPE
    q13, s13, q2, s2 = word_layer(num_experts, hidden_size, intermediate_size, seed=3)
    assert_triton_matches_reference(q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=BLOCK), 5, top_k,
                                    "sorted", torch.bfloat16)
    assert words == [False, False] and split == [True, True]


def test_a_gemm_whose_k_is_not_whole_scale_blocks_reads_bytes(monkeypatch):
    """H = 272 (8.5 blocks): the gate/up GEMM falls back to byte tiles, the down GEMM (I = 160)
    still reads words; both match the reference."""
    taken = record_word_tiles(monkeypatch)
    (q13, s13, q2, s2), _ = mxfp4_layer(32, 272, 160, seed=4)
    assert_triton_matches_reference(q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=BLOCK), 3, 2, "naive",
                                    torch.bfloat16)
    assert taken == [False, True]


def test_words_need_aligned_rows_deep_tiles_and_bf16_or_float32():
    config = fm.select_config(1, 8, 2048, 768, 128, torch.bfloat16)
    bank = torch.zeros(4, 64, 160, dtype=torch.uint8)  # K = 320
    assert config.split_fields and config.mxfp4_words and fm._mxfp4_words(config, bank, torch.bfloat16, 320, 32)
    assert fm._mxfp4_words(config, bank, torch.float32, 320, 32)
    assert fm._mxfp4_words(config, bank[1:3, 5:], torch.bfloat16, 320, 32)  # a pool's rows: aligned still
    refused = [
        (config, bank, torch.float16, 320, 32),  # fp16's exponent range could round a folded scale
        (config, bank, torch.bfloat16, 304, 32),  # not whole scale blocks
        (replace(config, block_k=64), bank, torch.bfloat16, 320, 32),  # 8-deep dots
        (replace(config, mxfp4_words=False), bank, torch.bfloat16, 320, 32),
        (replace(config, split_fields=False), bank, torch.bfloat16, 320, 32),
        (config, torch.zeros(4, 64, 162, dtype=torch.uint8)[..., :160], torch.bfloat16, 320, 32),  # row stride 162
        (config, torch.zeros(4 * 64 * 160 + 2, dtype=torch.uint8)[2:].view(4, 64, 160), torch.bfloat16, 320, 32),
    ]
    for args in refused:
        assert not fm._mxfp4_words(*args), args[1:]


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
@pytest.mark.parametrize("words", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 4, 64])
def test_split_field_mxfp4_tiles_match_reference_on_gpu(monkeypatch, num_tokens, words):
    """Both split tiles: int32 words (the default) and 32-value blocks of bytes."""
    taken = force_split_fields(monkeypatch, mxfp4_words=words)
    read_words = record_word_tiles(monkeypatch)
    banks, _ = mxfp4_layer(128, 2048, 768, device="cuda")
    assert_quantized_banks_match_reference_on_gpu(banks, BLOCK, num_tokens)
    assert taken and all(taken) and read_words and all(w == words for w in read_words)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64])
def test_word_tiles_match_reference_at_gpt_oss_shapes_on_gpu(monkeypatch, num_tokens):
    """gpt-oss-20b's expert shape (H = I = 2880: 128-deep K tiles end in a 64-value tail), its
    biases and clamped SwiGLU, scales spread over a checkpoint's range; 8 experts, top-4.
    Outputs here reach 40 (mean 5), so the absolute tolerance is bf16's own: how far the
    reference in bf16 lies from the reference in float32 on this very layer."""
    taken = record_word_tiles(monkeypatch)
    q13, s13, q2, s2 = (t.cuda() for t in word_layer(8, 2880, 2880, seed=num_tokens))
    b13, b2 = make_biases(8, 2880, 2880, torch.bfloat16, "cuda")
    hidden, weights, ids = make_routes(num_tokens, 2880, 8, 4, torch.bfloat16, "cuda", 1)
    kwargs = dict(num_routed_experts=8, w13_scale=s13, w2_scale=s2, block_shape=BLOCK, w13_bias=b13, w2_bias=b2,
                  activation=clamped_swiglu(1.702, 7.0))
    ref = fused_moe(hidden, q13, q2, weights, ids, impl="reference", **kwargs)
    ref_fp32 = fused_moe(hidden.float(), q13, q2, weights, ids, impl="reference", **kwargs)
    bf16_error = (ref.float() - ref_fp32).abs().max().item()
    got = fused_moe(hidden, q13, q2, weights, ids, **kwargs)
    assert taken == [True, True] and rel_err(got, ref) < 1e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=max(5e-2, bf16_error), rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 600])
def test_mxfp4_pinned_host_banks_give_the_device_banks_bits_on_gpu(monkeypatch, num_tokens):
    """Pinned host banks are read in place (UVA) as int32 words, as device banks are."""
    taken = record_word_tiles(monkeypatch)
    banks, _ = mxfp4_layer(128, 2048, 768, device="cuda")
    hidden, weights, ids = make_routes(num_tokens, 2048, 128, 8, torch.bfloat16, "cuda", 1)
    host = [t.cpu().pin_memory() for t in banks]
    on_device = fused_moe(hidden, banks[0], banks[2], weights, ids, num_routed_experts=128,
                          block_assignment="sorted", w13_scale=banks[1], w2_scale=banks[3], block_shape=BLOCK)
    from_host = fused_moe(hidden, host[0], host[2], weights, ids, num_routed_experts=128,
                          w13_scale=host[1], w2_scale=host[3], block_shape=BLOCK)
    assert torch.equal(from_host, on_device) and taken == [True] * 4


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


@triton.jit
def _scaled_codes_kernel(scales_ptr, out_ptr, NUM_SCALES: tl.constexpr, DTYPE: tl.constexpr):
    codes, rows = tl.arange(0, 16), tl.arange(0, NUM_SCALES)
    fold = _e8m0_fold(tl.load(scales_ptr + rows).to(tl.int32), DTYPE)
    tl.store(out_ptr + rows[:, None] * 16 + codes[None, :], _e2m1_scaled_weight(codes[None, :], fold[:, None], DTYPE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_word_tiles_fold_every_scale_into_every_code_exactly(dtype):
    """Every E2M1 code times every E8M0 scale 2..252 (2^-125 .. 2^125, beyond any real
    checkpoint's spread), as the word tiles decode it (bf16: the scale added to the exponent
    bits), is the float32 product exactly, zeros keeping their sign; in bf16 a scale outside
    that range is taken as the nearest end."""
    scales = torch.arange(256, dtype=torch.uint8)
    scales[255 if dtype == torch.bfloat16 else 253:] = 127  # E8M0's NaN; 6 x 2^126 overflows float32
    got = torch.full((256, 16), 99.0, dtype=dtype)
    _scaled_codes_kernel[(1,)](scales, got, NUM_SCALES=256,
                               DTYPE=tl.bfloat16 if dtype == torch.bfloat16 else tl.float32)
    want = (torch.tensor(E2M1_VALUES, dtype=torch.float64)[None, :]
            * torch.pow(2.0, scales.double() - 127)[:, None]).float()
    inside = slice(2, 253)
    assert torch.equal(got[inside].float(), want[inside])
    assert torch.equal(torch.signbit(got[inside]), torch.signbit(want[inside]))
    if dtype == torch.bfloat16:
        assert torch.equal(got[:2], got[2:3].expand(2, 16)) and torch.equal(got[253:255], got[252:253].expand(2, 16))
