"""fused_moe over int4 (W4A16, compressed-tensors pack-quantized) banks: the packer and unpacker
against compressed-tensors' own pack_to_int32 / unpack_from_int32, the group quantizer's
precision, the reference against a float64 oracle over dequantized weights, the Triton kernel
(TRITON_INTERPRET=1 on CPU) against the reference, slot-pool bit identity; GPU tests at the
Qwen3-30B-A3B expert shape."""
from dataclasses import replace

import pytest
import torch

from moeferry.kernels.fused_moe import fused_moe
from moeferry.kernels.fused_moe import triton as fm
from moeferry.kernels.fused_moe.reference import unpack_int4
from moeferry.moe.formats import pack_int4, quantize_int4_groups
from tests.kernels.test_fused_moe import make_layer, make_routes, oracle, rel_err
from tests.kernels.test_fused_moe_fp8 import assert_triton_matches_reference


def int4_layer(num_experts, hidden_size, intermediate_size, group, seed=0, device="cpu"):
    """((packed w13, scales, packed w2, scales), (float64 dequantized w13, w2))."""
    w13, w2 = make_layer(num_experts, hidden_size, intermediate_size, torch.float32, seed=seed)
    q13, s13 = quantize_int4_groups(w13, group)  # per row: gate and up rows never share a group
    q2, s2 = quantize_int4_groups(w2, group)

    def deq(q, s, cols):
        values = unpack_int4(q, cols).double()
        return values * s.double().repeat_interleave(group, dim=-1)[..., :cols]

    banks = tuple(t.to(device) for t in (q13, s13, q2, s2))
    return banks, (deq(q13, s13, hidden_size), deq(q2, s2, intermediate_size))


@pytest.mark.parametrize("rows,cols", [(5, 64), (3, 40), (2, 8)])
def test_packing_matches_compressed_tensors(rows, cols):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    values = torch.randint(-8, 8, (rows, cols), generator=torch.Generator().manual_seed(cols), dtype=torch.int32)
    ours = pack_int4(values)
    theirs = pack_to_int32(values.to(torch.int8), 4)
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_int4(theirs, cols), values)
    assert torch.equal(unpack_from_int32(ours, 4, torch.Size([rows, cols])).to(torch.int32), values)


@pytest.mark.parametrize("cols,group", [(256, 128), (80, 32), (100, 128)])
def test_group_quantizer_uses_each_groups_range(cols, group):
    gen = torch.Generator().manual_seed(cols)
    weight = torch.randn(6, cols, generator=gen) * torch.rand(6, 1, generator=gen) * 4
    weight[0, :group] = 0
    packed, scales = quantize_int4_groups(weight, group)
    assert packed.shape == (6, -(-cols // 8)) and scales.shape == (6, -(-cols // group))
    values = unpack_int4(packed, cols)
    assert scales[0, 0] == 1 and not values[0, :group].any()
    deq = values.double() * scales.double().repeat_interleave(group, dim=-1)[:, :cols]
    for r in range(6):
        for g in range(scales.shape[1]):
            part = slice(g * group, (g + 1) * group)
            w = weight[r, part].double()
            if w.abs().max() == 0:
                continue
            assert values[r, part].abs().max() == 7 and values[r, part].abs().max() <= 7
            assert ((deq[r, part] - w).abs() <= float(scales[r, g]) / 2 + 1e-6).all()  # round to nearest


def test_reference_matches_per_token_oracle_over_dequantized_weights():
    (q13, s13, q2, s2), (deq13, deq2) = int4_layer(16, 80, 48, 16)
    hidden, weights, ids = make_routes(21, 80, 16, 4, torch.float32)
    got = fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=16, impl="reference",
                    w13_scale=s13, w2_scale=s2, block_shape=(1, 16))
    assert got.abs().max() > 0.1
    torch.testing.assert_close(got.double(), oracle(hidden, deq13, deq2, weights, ids), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,assignment,group", [(3, "naive", 16), (21, "sorted", 16), (5, "sorted", 128)])
def test_triton_matches_reference_on_int4_banks(dtype, num_tokens, assignment, group):
    num_experts, top_k, hidden_size, intermediate_size = 32, 2, 80, 48  # ragged groups, masked tails
    (q13, s13, q2, s2), _ = int4_layer(num_experts, hidden_size, intermediate_size, group)
    assert_triton_matches_reference(q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=(1, group)), num_tokens,
                                    top_k, assignment, dtype)


def force_split_fields(monkeypatch, block_k: int | None = None, **fields) -> list[bool]:
    """Every fused_moe tile config asks for split-field dots on the tensor-core kernel, naive
    calls too (no route GEMV), and K tiles of `block_k` when given, and any other FusedMoEConfig
    `fields`; the returned list collects, per GEMM launch, whether the kernel really took them
    (K tiles deep enough)."""
    taken = []
    select, splits = fm.select_config, fm._splits_fields

    def forced(*args, **kwargs):
        config = replace(select(*args, **kwargs), split_fields=True, route_gemv=False, **fields)
        return config if block_k is None else replace(config, block_k=block_k)
    monkeypatch.setattr(fm, "select_config", forced)

    def recording(config, pack):
        taken.append(splits(config, pack))
        return taken[-1]
    monkeypatch.setattr(fm, "_splits_fields", recording)
    return taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,assignment", [(3, "naive"), (21, "sorted")])
def test_split_field_tiles_match_reference_on_int4_banks(monkeypatch, dtype, num_tokens, assignment):
    num_experts, top_k, hidden_size, intermediate_size = 32, 2, 200, 136  # K tiles of 128, masked tails
    taken = force_split_fields(monkeypatch, block_k=128)  # float32's own K tile (32) is too shallow
    (q13, s13, q2, s2), _ = int4_layer(num_experts, hidden_size, intermediate_size, 128)
    assert_triton_matches_reference(q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=(1, 128)), num_tokens,
                                    top_k, assignment, dtype)
    assert taken == [True, True]


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_int4_slot_pool_gives_bit_identical_output(impl):
    num_experts, top_k, hidden_size, intermediate_size, num_slots = 16, 2, 64, 32, 300
    banks, _ = int4_layer(num_experts, hidden_size, intermediate_size, 32)
    gen = torch.Generator().manual_seed(2)
    slot_of = torch.randperm(num_slots, generator=gen)[:num_experts]
    pools = []
    for bank in banks:
        pool = torch.randint(-2**31, 2**31 - 1, (num_slots, *bank.shape[1:]), generator=gen, dtype=torch.int32)
        pool = pool if bank.dtype == torch.int32 else torch.rand(pool.shape, generator=gen)
        pool[slot_of] = bank
        pools.append(pool)
    hidden, weights, ids = make_routes(9, hidden_size, num_experts, top_k, torch.bfloat16)
    kwargs = dict(num_routed_experts=num_experts, impl=impl, block_shape=(1, 32))
    over_bank = fused_moe(hidden, banks[0], banks[2], weights, ids, w13_scale=banks[1], w2_scale=banks[3], **kwargs)
    over_pool = fused_moe(hidden, pools[0], pools[2], weights, slot_of[ids], w13_scale=pools[1], w2_scale=pools[3],
                          **kwargs)
    assert over_bank.abs().max() > 0.1 and torch.equal(over_bank, over_pool)


def assert_quantized_banks_match_reference_on_gpu(banks, block_shape, num_tokens, assignments=("auto",)):
    """fused_moe over the Qwen3-30B-A3B-shaped quantized banks (w13, w13 scales, w2, w2 scales)
    on CUDA against the reference, for each block assignment: within bf16 rounding."""
    q13, s13, q2, s2 = banks
    hidden, weights, ids = make_routes(num_tokens, 2048, 128, 8, torch.bfloat16, "cuda", 1)
    scales = dict(w13_scale=s13, w2_scale=s2, block_shape=block_shape)
    ref = fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=128, impl="reference", **scales)
    for assignment in assignments:
        got = fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=128, block_assignment=assignment, **scales)
        assert rel_err(got, ref) < 1e-2
        torch.testing.assert_close(got.float(), ref.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 600])
def test_triton_int4_matches_reference_on_gpu(num_tokens):
    banks, _ = int4_layer(128, 2048, 768, 128, device="cuda")
    assert_quantized_banks_match_reference_on_gpu(banks, (1, 128), num_tokens,
                                                  ("sorted", "naive") if num_tokens <= 4 else ("sorted",))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64])
def test_split_field_int4_tiles_match_reference_on_gpu(monkeypatch, num_tokens):
    taken = force_split_fields(monkeypatch)
    banks, _ = int4_layer(128, 2048, 768, 128, device="cuda")
    assert_quantized_banks_match_reference_on_gpu(banks, (1, 128), num_tokens)
    assert taken and all(taken)
