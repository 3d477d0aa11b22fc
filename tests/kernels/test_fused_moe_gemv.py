"""The decode route GEMV (kernels/fused_moe/gemv.py): one token's fused MoE on CUDA cores, every
weight format against the reference (the tolerances of the tensor-core kernel's tests), its
decoded fields exact for every code, masked and unmasked (EVEN) tiles, gpt-oss's biases and
clamped SwiGLU, and bit-identical over a layer's bank and over a slot pool."""
import pytest
import torch
import triton
import triton.language as tl

from moeferry.kernels.fused_moe import E2M1_VALUES, clamped_swiglu, fused_moe
from moeferry.kernels.fused_moe import gemv
from moeferry.kernels.fused_moe import triton as fm
from tests.kernels.test_fused_moe import make_layer, make_routes, rel_err, scatter_into_pool
from tests.kernels.test_fused_moe_fp8 import fp8_layer
from tests.kernels.test_fused_moe_gpt_oss import make_biases
from tests.kernels.test_fused_moe_int4 import int4_layer
from tests.kernels.test_fused_moe_mxfp4 import BLOCK, mxfp4_layer


@pytest.fixture
def gemv_calls(monkeypatch) -> list[bool]:
    """Per route-GEMV launch fused_moe makes, whether it was the gated GEMM."""
    calls, launch = [], fm.launch_route_gemv

    def recording(*args, gated, **kwargs):
        calls.append(gated)
        return launch(*args, gated=gated, **kwargs)
    monkeypatch.setattr(fm, "launch_route_gemv", recording)
    return calls


def banks(fmt: str, hidden_size: int, intermediate_size: int, dtype: torch.dtype, seed: int = 0):
    """(w13, w2, fused_moe's scale keywords) of 32 experts in `fmt`."""
    if fmt == "plain":
        w13, w2 = make_layer(32, hidden_size, intermediate_size, dtype, seed=seed)
        return w13, w2, {}
    if fmt == "fp8":
        (q13, s13, q2, s2), _ = fp8_layer(32, hidden_size, intermediate_size, (32, 32), seed=seed)
        return q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=(32, 32))
    if fmt.startswith("int4"):
        group = int(fmt.split("/")[1])
        (q13, s13, q2, s2), _ = int4_layer(32, hidden_size, intermediate_size, group, seed=seed)
        return q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=(1, group))
    (q13, s13, q2, s2), _ = mxfp4_layer(32, hidden_size, intermediate_size, seed=seed)
    return q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=BLOCK)


def assert_close_to_reference(got, ref, dtype):
    assert got.dtype == dtype and got.abs().max() > 0.1
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:  # the activations are rounded to bf16 between the GEMMs
        torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=2e-2)
        assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["plain", "fp8", "int4/16", "int4/128", "mxfp4"])
@pytest.mark.parametrize("hidden_size,intermediate_size", [(80, 48), (288, 160)])  # ragged: masked tails
def test_one_token_takes_the_route_gemv_and_matches_reference(gemv_calls, fmt, dtype, hidden_size,
                                                              intermediate_size):
    w13, w2, scales = banks(fmt, hidden_size, intermediate_size, dtype, seed=hidden_size)
    hidden, weights, ids = make_routes(1, hidden_size, 32, 4, dtype, seed=7)
    got = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=32, impl="triton", **scales)
    ref = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=32, impl="reference", **scales)
    assert gemv_calls == [True, False]
    assert_close_to_reference(got, ref, dtype)


@pytest.mark.parametrize("fmt", ["plain", "fp8", "int4/128", "mxfp4"])
def test_whole_steps_take_the_unmasked_tiles_and_match_reference(monkeypatch, gemv_calls, fmt):
    """H = 256, I = 128 in steps of 16 stored elements and tiles of 4 rows: no mask (EVEN)."""
    monkeypatch.setattr(gemv, "select_gemv_config", lambda gated, stored, row: gemv.GemvConfig(4, 16, 4))
    launches = []
    kernel = gemv._route_gemv_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs["EVEN"])
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(gemv, "_route_gemv_kernel", Recording())
    w13, w2, scales = banks(fmt, 256, 128, torch.bfloat16, seed=3)
    hidden, weights, ids = make_routes(1, 256, 32, 4, torch.bfloat16, seed=8)
    got = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=32, impl="triton", **scales)
    ref = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=32, impl="reference", **scales)
    assert gemv_calls == [True, False] and launches == [True, True]
    assert_close_to_reference(got, ref, torch.bfloat16)


@pytest.mark.parametrize("fmt", ["plain", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_biases_and_clamped_swiglu_match_reference(gemv_calls, fmt, dtype):
    w13, w2, scales = banks(fmt, 288, 160, dtype, seed=9)
    b13, b2 = make_biases(32, 288, 160, dtype)
    hidden, weights, ids = make_routes(1, 288, 32, 4, dtype, seed=10)
    kwargs = dict(num_routed_experts=32, w13_bias=b13, w2_bias=b2, activation=clamped_swiglu(1.702, 0.5), **scales)
    got = fused_moe(hidden, w13, w2, weights, ids, impl="triton", **kwargs)
    ref = fused_moe(hidden, w13, w2, weights, ids, impl="reference", **kwargs)
    assert gemv_calls == [True, False]
    assert_close_to_reference(got, ref, dtype)


def test_bit_identical_over_a_bank_and_over_a_slot_pool(gemv_calls):
    w13, w2 = make_layer(8, 96, 48, torch.bfloat16)
    pool13, pool2, slot_of = scatter_into_pool(w13, w2, 300)
    hidden, weights, ids = make_routes(1, 96, 8, 2, torch.bfloat16)
    over_bank = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=8, impl="triton")
    over_pool = fused_moe(hidden, pool13, pool2, weights, slot_of[ids], num_routed_experts=8, impl="triton")
    assert gemv_calls == [True, False, True, False]
    assert over_bank.abs().max() > 0.1 and torch.equal(over_bank, over_pool)


def test_several_tokens_keep_the_tensor_core_tiles(gemv_calls):
    w13, w2 = make_layer(32, 64, 32, torch.bfloat16)
    hidden, weights, ids = make_routes(3, 64, 32, 2, torch.bfloat16)
    fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=32, block_assignment="naive", impl="triton")
    assert gemv_calls == []


def test_unreadable_banks_fall_back_to_the_tensor_core_tiles(gemv_calls):
    """MXFP4 rows of 18 bytes (K = 36) are not whole int32 words: the route GEMV cannot read them."""
    (q13, s13, q2, s2), _ = mxfp4_layer(32, 64, 36)
    hidden, weights, ids = make_routes(1, 64, 32, 2, torch.bfloat16)
    assert not gemv.route_gemv_allowed(hidden, q2, BLOCK)
    got = fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=32, impl="triton", w13_scale=s13,
                    w2_scale=s2, block_shape=BLOCK)
    ref = fused_moe(hidden, q13, q2, weights, ids, num_routed_experts=32, impl="reference", w13_scale=s13,
                    w2_scale=s2, block_shape=BLOCK)
    assert gemv_calls == []
    assert_close_to_reference(got, ref, torch.bfloat16)


@triton.jit
def _fields_kernel(words_ptr, int4_ptr, e2m1_ptr):
    """Every field of 16 words, decoded as the route GEMV decodes them."""
    words = tl.load(words_ptr + tl.arange(0, 16))
    for i in tl.static_range(8):
        tl.store(int4_ptr + tl.arange(0, 16) * 8 + i, gemv._int4_field(words, i))
        tl.store(e2m1_ptr + tl.arange(0, 16) * 8 + i, gemv._e2m1_field(words, i))


def test_every_code_decodes_exactly_in_every_field():
    """Word w holds code (w + i) % 16 in field i, so each field position sees all 16 codes:
    int4 gives 1 + n / 16 (value n - 8), E2M1 its value times 2^-126, both exact."""
    codes = (torch.arange(16)[:, None] + torch.arange(8)[None, :]) % 16  # [word, field]
    words = (codes << (4 * torch.arange(8))[None, :]).sum(dim=1).to(torch.int64)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    int4, e2m1 = torch.empty(16, 8), torch.empty(16, 8)
    _fields_kernel[(1,)](words, int4, e2m1)
    torch.testing.assert_close(int4, 1 + codes.float() / 16, atol=0, rtol=0)
    want = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes] * 2.0 ** -126
    assert torch.equal(e2m1.double(), want.float().double())
    assert torch.equal(torch.signbit(e2m1), codes >= 8)  # -0.0 too


# The int8 path (launch_route_gemv(int8=True), int4 banks): the host kernel's int8 numerics,
# whose oracle is reference.int8_expert_routes. The integers are the same and the float32 steps
# the same operations in the same order, so the routes agree to the bit but where the
# activation's last bit differs (exp) and moves an act element, or its int8 value, by a step.
def int8_route_gemv(hidden, w13, w2, weights, ids, w13_scale, w2_scale, block_shape, config=None):
    """One token's weighted route outputs [K, H] from the two route GEMVs of the int8 path."""
    flat_ids = ids.reshape(-1).contiguous()
    route_weights = weights.reshape(-1).contiguous().float()
    act = torch.empty(flat_ids.numel(), w13.shape[1] // 2, dtype=hidden.dtype)
    out = torch.empty(flat_ids.numel(), hidden.shape[1], dtype=hidden.dtype)
    common = dict(block_shape=block_shape, int8=True, config=config)
    gemv.launch_route_gemv(hidden, w13, act, route_weights, flat_ids, gated=True, weighted=False,
                           a_div=ids.shape[1], scales=w13_scale, **common)
    gemv.launch_route_gemv(act, w2, out, route_weights, flat_ids, gated=False, weighted=True, a_div=1,
                           scales=w2_scale, **common)
    return out


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("hidden_size,intermediate_size,config", [
    (256, 128, None),  # whole steps of the chosen tiles
    (288, 160, None),  # ragged: masked tails of rows, words and groups
    (256, 128, gemv.GemvConfig(4, 16, 4)),  # steps of 128 values: four groups of 32, or one of 128 a step
])
def test_the_int8_path_matches_the_host_kernels_oracle(group, hidden_size, intermediate_size, config):
    from moeferry.kernels.fused_moe import reference

    if config is not None and config.step * 8 < group:
        pytest.skip("a step holds whole groups")
    w13, w2, scales = banks(f"int4/{group}", hidden_size, intermediate_size, torch.bfloat16, seed=group)
    hidden, weights, ids = make_routes(1, hidden_size, 32, 4, torch.bfloat16, seed=11)
    got = int8_route_gemv(hidden, w13, w2, weights, ids, config=config, **scales)
    want = reference.int8_expert_routes(hidden, w13, w2, weights, ids, **scales).view(-1, hidden_size)
    assert got.abs().max() > 0.1
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert float((got != want).float().mean()) < 0.01  # most elements are the oracle's bits
    exact = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=32, impl="reference", sum_routes=False,
                      **scales).view(-1, hidden_size)
    assert 0 < rel_err(got, exact) < 0.03  # int8 activations: about 1% off the exact path, never its bits


def test_the_int8_path_reads_only_int4_banks():
    w13, w2, scales = banks("mxfp4", 64, 32, torch.bfloat16)
    hidden, weights, ids = make_routes(1, 64, 32, 2, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="int8 path reads int4 banks"):
        int8_route_gemv(hidden, w13, w2, weights, ids, **scales)


def test_mxfp4_down_tiles_follow_the_row_length():
    """MXFP4's down GEMM: Qwen3-30B-A3B's short rows (768 values, 96 words) in 32-row tiles,
    gpt-oss-20b's long ones (2880, 360 words) as the gated GEMM's; a bank of bytes counts words."""
    short, long_ = gemv.select_gemv_config(False, torch.uint8, 96), gemv.select_gemv_config(False, torch.uint8, 360)
    assert short == gemv.GemvConfig(32, 32, 4)
    assert long_ == gemv.select_gemv_config(True, torch.uint8, 360) == gemv.GemvConfig(8, 128, 4)
    assert gemv.stored_row(torch.zeros(2, 3, 1440, dtype=torch.uint8)) == 360
    assert gemv.stored_row(torch.zeros(2, 3, 96, dtype=torch.int32)) == 96
