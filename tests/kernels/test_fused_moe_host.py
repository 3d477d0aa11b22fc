"""The host expert kernel (kernels/fused_moe/host.py, host_experts.cpp) against a plain-torch
model of its arithmetic: bf16 weights and tokens, float32 dots, the biases added to them where
the experts have some (gpt-oss), the activation (silu or the clamped SwiGLU) and the weighted
route output rounded to bf16. Every vector path this CPU has is checked (the
AVX512-BF16 one where the CPU has it: the GPU machine's host); routes with a negative id are
left zero; the op's contract (`fused_moe` on the host) against the reference. Quantized banks
(fp8, int4, mxfp4): every weight the kernel dequantizes has the reference's bits, and the routes
are the same arithmetic over the dequantized weights, for any thread count."""
import pytest
import torch

from moeferry.kernels.fused_moe import SILU, clamped_swiglu, host, reference

pytestmark = pytest.mark.skipif(not host.available(), reason="no C++ compiler to build the host kernel")


def vector_isas():
    """The exact path's vector paths here: portable, AVX2 (fp8 weights decoded in registers) and
    AVX512-BF16 where the CPU has them."""
    return (["portable"] + (["avx2"] if host.int8_isa() != "portable" else [])
            + (["avx512_bf16"] if host.has_avx512_bf16() else []))


def rounded_model(hidden, w13, w2, weights, ids, w13_bias=None, w2_bias=None, activation=SILU):
    """[T, K, H] bf16: per route, the kernel's rounding points in float32 torch ops (the Triton
    kernel's: each bias joins its float32 dot before the activation and the route weight)."""
    num_tokens, top_k = ids.shape
    inter = w2.shape[2]
    out = torch.zeros(num_tokens, top_k, hidden.shape[1], dtype=torch.bfloat16)
    for t in range(num_tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            if e < 0:
                continue
            gate_up = w13[e].float() @ hidden[t].float()
            if w13_bias is not None:
                gate_up = gate_up + w13_bias[e].float()
            act = reference.activate(gate_up[:inter], gate_up[inter:], activation).bfloat16().float()
            down = w2[e].float() @ act
            if w2_bias is not None:
                down = down + w2_bias[e].float()
            out[t, k] = (float(weights[t, k]) * down).bfloat16()
    return out


def make_case(num_tokens, top_k, hidden_size, inter, num_experts, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).bfloat16()
    w13 = (torch.randn(num_experts, 2 * inter, hidden_size, generator=gen) / hidden_size ** 0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden_size, inter, generator=gen) / inter ** 0.5).bfloat16()
    weights = torch.rand(num_tokens, top_k, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).int()
    return hidden, w13, w2, weights, ids


def assert_close_in_bf16(got, want):
    """Equal up to the float32 summation order, which may round an output, or an activation
    element that feeds it, the other way: an output then moves by one bf16 step of its own
    value, or by an activation's step times a down weight, a small share of the outputs'
    scale. Most elements stay bit-equal."""
    got, want = got.float(), want.float()
    bound = want.abs() * 2.0 ** -7 + want.pow(2).mean().sqrt() * 2.0 ** -5
    assert bool(((got - want).abs() <= bound).all()), float((got - want).abs().max())
    assert float((got != want).float().mean()) < 0.05


@pytest.mark.parametrize("vector_isa", vector_isas())
@pytest.mark.parametrize("shape", [(1, 8, 256, 64, 32), (5, 4, 96, 40, 6), (16, 8, 512, 96, 64),
                                   (3, 2, 100, 20, 5), (33, 2, 64, 33, 4)],
                         ids=["decode-1", "odd-5", "decode-16", "tails", "prefill-33"])
def test_host_kernel_matches_its_arithmetic_on_every_route(vector_isa, shape):
    hidden, w13, w2, weights, ids = make_case(*shape, seed=sum(shape))
    got = host.expert_routes(hidden, w13, w2, weights, ids, threads=2, vector_isa=vector_isa)
    assert got.dtype == torch.bfloat16 and got.shape == (*ids.shape, hidden.shape[1])
    assert_close_in_bf16(got, rounded_model(hidden, w13, w2, weights, ids))


def assert_negative_ids_skip_only_their_routes(hidden, w13, w2, weights, ids, seed, **kwargs):
    """Half the routes (drawn with `seed`) given id -1: they come back zero, and every other
    route has the bits of the call with no route skipped (a route's bits do not depend on its
    neighbours). kwargs go to expert_routes (scales, biases, activation, vector_isa)."""
    full = host.expert_routes(hidden, w13, w2, weights, ids, threads=2, **kwargs)
    skip = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    part = host.expert_routes(hidden, w13, w2, weights, torch.where(skip, -1, ids), threads=2, **kwargs)
    assert bool(skip.any()) and bool((~skip).any())
    assert bool((part[skip] == 0).all())
    assert torch.equal(part[~skip], full[~skip])


@pytest.mark.parametrize("vector_isa", vector_isas())
def test_routes_with_a_negative_id_are_zero_and_the_others_unchanged(vector_isa):
    hidden, w13, w2, weights, ids = make_case(6, 4, 128, 48, 16, seed=3)
    assert_negative_ids_skip_only_their_routes(hidden, w13, w2, weights, ids, seed=4, vector_isa=vector_isa)


def test_thread_count_does_not_change_the_bits():
    hidden, w13, w2, weights, ids = make_case(7, 4, 128, 48, 16, seed=5)
    one = host.expert_routes(hidden, w13, w2, weights, ids, threads=1)
    assert torch.equal(one, host.expert_routes(hidden, w13, w2, weights, ids, threads=3))


@pytest.mark.parametrize("sum_routes", [True, False])
def test_the_host_op_follows_the_fused_moe_contract(sum_routes):
    hidden, w13, w2, weights, ids = make_case(9, 4, 128, 64, 16, seed=6)
    got = host.fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=16, sum_routes=sum_routes)
    want = reference.fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=16, sum_routes=sum_routes)
    assert got.shape == want.shape
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert float(err) < 1e-2  # bf16 rounding of the activation and of each route output


def test_a_float32_call_takes_the_reference():
    hidden, w13, w2, weights, ids = make_case(4, 2, 64, 32, 8, seed=7)
    args = (hidden.float(), w13.float(), w2.float(), weights, ids)
    assert torch.equal(host.fused_moe(*args, num_routed_experts=8), reference.fused_moe(*args, num_routed_experts=8))


def test_bad_calls_are_refused_in_one_line():
    hidden, w13, w2, weights, ids = make_case(2, 2, 64, 32, 8, seed=8)
    out = torch.empty(2, 2, 64, dtype=torch.bfloat16)
    act = torch.empty(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="hidden must be a contiguous CPU torch.bfloat16"):
        host.make_call(hidden.float(), ids, weights, out, w13, w2, act, 1)
    with pytest.raises(ValueError, match="act scratch"):
        host.make_call(hidden, ids, weights, out, w13, w2, act[:1], 1)
    with pytest.raises(ValueError, match="vector_isa"):
        host.make_call(hidden, ids, weights, out, w13, w2, act, 1, vector_isa="sse")
    with pytest.raises(ValueError, match="schedule 'guided' is not one of static, dynamic"):
        host.make_call(hidden, ids, weights, out, w13, w2, act, 1, schedule="guided")


# Quantized banks: (format, block_shape, the rows' random stored elements). fp8 blocks of 16x16
# leave partial blocks at the shapes below; int4 and mxfp4 rows of odd or non-multiple-of-8
# widths end in a partly used word or byte.
QUANT_FORMATS = {"fp8": (torch.float8_e4m3fn, (16, 16)), "int4": (torch.int32, (1, 16)),
                 "mxfp4": (torch.uint8, (1, 32))}


def quantized_banks(name, w13, w2):
    """(w13, w2, w13_scale, w2_scale, block_shape) of float banks in format `name`, as the loader
    quantizes them (w13's gate and up halves blocked each on its own)."""
    from moeferry.moe.formats import quantize_fp8_blocks, quantize_int4_groups, quantize_mxfp4

    block = QUANT_FORMATS[name][1]
    quantize = {"fp8": lambda w: quantize_fp8_blocks(w, block), "int4": lambda w: quantize_int4_groups(w, block[1]),
                "mxfp4": quantize_mxfp4}[name]
    halves = [quantize(half) for half in w13.float().chunk(2, dim=1)]
    down, down_scale = quantize(w2.float())
    return (torch.cat([h[0] for h in halves], dim=1), down, torch.cat([h[1] for h in halves], dim=1), down_scale,
            block)


def random_stored_banks(name, num_experts, hidden_size, inter, seed):
    """Banks of uniformly random stored elements and scales: every code of the format appears
    (fp8 but its two NaN codes), scales over a wide range of magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    dtype, block = QUANT_FORMATS[name]
    pack = {"fp8": 1, "int4": 8, "mxfp4": 2}[name]

    def stored(rows, cols):
        if dtype == torch.int32:
            return torch.randint(-2**31, 2**31 - 1, (num_experts, rows, -(-cols // pack)), generator=gen,
                                 dtype=torch.int32)
        raw = torch.randint(0, 256, (num_experts, rows, -(-cols // pack)), generator=gen, dtype=torch.uint8)
        return raw if dtype == torch.uint8 else torch.where((raw & 0x7F) == 0x7F, 0, raw).view(torch.float8_e4m3fn)

    def scales(rows, cols):
        shape = (num_experts, -(-rows // block[0]), -(-cols // block[1]))
        if dtype == torch.uint8:
            return torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8)  # 0 (2^-127) .. 254
        return torch.exp2(torch.randint(-60, 60, shape, generator=gen).float()) * (1 + torch.rand(shape, generator=gen))

    gate_scale, up_scale = scales(inter, hidden_size), scales(inter, hidden_size)
    return (stored(2 * inter, hidden_size), stored(hidden_size, inter), torch.cat([gate_scale, up_scale], dim=1),
            scales(hidden_size, inter), block)


@pytest.mark.parametrize("name", QUANT_FORMATS)
@pytest.mark.parametrize("sizes", [(100, 40), (64, 33), (96, 64)], ids=["ragged-h", "odd-i", "whole"])
def test_the_kernel_dequantizes_every_weight_to_the_references_bits(name, sizes):
    from moeferry.kernels.fused_moe.reference import dequantize_blocks, dequantize_w13

    hidden_size, inter = sizes
    w13, w2, s13, s2, block = random_stored_banks(name, 3, hidden_size, inter, seed=hidden_size + inter)
    hidden = torch.zeros(1, hidden_size, dtype=torch.bfloat16)
    out = torch.empty(1, 1, hidden_size, dtype=torch.bfloat16)
    call = host.make_call(hidden, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1), out, w13, w2,
                          torch.empty(1, inter, dtype=torch.bfloat16), 1, w13_scale=s13, w2_scale=s2, block_shape=block)
    for e in range(3):
        want13 = dequantize_w13(w13[e], s13[e], block, hidden_size)
        want2 = dequantize_blocks(w2[e], s2[e], block, inter)
        for got, want in ((host.dequantized(call, 0, e), want13), (host.dequantized(call, 1, e), want2)):
            same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
            assert bool(same.all()), f"{int((~same).sum())} weights differ"


@pytest.mark.parametrize("name", QUANT_FORMATS)
@pytest.mark.parametrize("vector_isa", vector_isas())
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 8, 16])
def test_quantized_banks_match_the_arithmetic_on_their_dequantized_weights(name, vector_isa, num_tokens):
    from moeferry.kernels.fused_moe.reference import dequantize_blocks, dequantize_w13

    hidden_size, inter, experts, top_k = (100, 40, 8, 4) if num_tokens % 2 else (96, 33, 6, 3)
    hidden, w13, w2, weights, ids = make_case(num_tokens, top_k, hidden_size, inter, experts, seed=num_tokens)
    q13, q2, s13, s2, block = quantized_banks(name, w13, w2)
    deq13 = torch.stack([dequantize_w13(q13[e], s13[e], block, hidden_size) for e in range(experts)])
    deq2 = dequantize_blocks(q2, s2, block, inter)
    want = rounded_model(hidden, deq13, deq2, weights, ids)
    runs = [host.expert_routes(hidden, q13, q2, weights, ids, threads=threads, vector_isa=vector_isa,
                               w13_scale=s13, w2_scale=s2, block_shape=block) for threads in (1, 2, 3)]
    assert_close_in_bf16(runs[0], want)
    assert all(torch.equal(run, runs[0]) for run in runs[1:])  # the thread count does not change the bits


@pytest.mark.parametrize("name", QUANT_FORMATS)
def test_quantized_routes_with_a_negative_id_are_zero_and_the_others_unchanged(name):
    hidden, w13, w2, weights, ids = make_case(6, 4, 128, 48, 16, seed=9)
    q13, q2, s13, s2, block = quantized_banks(name, w13, w2)
    assert_negative_ids_skip_only_their_routes(hidden, q13, q2, weights, ids, seed=10, w13_scale=s13, w2_scale=s2,
                                               block_shape=block)


@pytest.mark.parametrize("name", QUANT_FORMATS)
def test_the_host_op_computes_quantized_banks_in_the_kernel(name, monkeypatch):
    hidden, w13, w2, weights, ids = make_case(9, 4, 128, 64, 16, seed=11)
    q13, q2, s13, s2, block = quantized_banks(name, w13, w2)
    args = (hidden, q13, q2, weights, ids)
    scales = dict(w13_scale=s13, w2_scale=s2, block_shape=block, num_routed_experts=16)
    want = reference.fused_moe(*args, **scales)
    monkeypatch.setattr(reference, "fused_moe", lambda *a, **k: pytest.fail("took the reference"))
    got = host.fused_moe(*args, **scales)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert float(err) < 1e-2  # bf16 rounding of the activation and of each route output


def test_bad_quantized_calls_are_refused_in_one_line():
    hidden, w13, w2, weights, ids = make_case(2, 2, 64, 32, 8, seed=12)
    q13, q2, s13, s2, block = quantized_banks("int4", w13, w2)
    out, act = torch.empty(2, 2, 64, dtype=torch.bfloat16), torch.empty(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="take w13_scale, w2_scale and block_shape"):
        host.make_call(hidden, ids, weights, out, q13, q2, act, 1)
    with pytest.raises(ValueError, match="w2_scale must be a contiguous CPU torch.float32"):
        host.make_call(hidden, ids, weights, out, q13, q2, act, 1, w13_scale=s13, w2_scale=s2[:, :1],
                       block_shape=block)
    with pytest.raises(ValueError, match="not a format the kernel reads"):
        host.make_call(hidden, ids, weights, out, w13.float(), w2.float(), act, 1)


# gpt-oss's experts: biases on both GEMMs and the clamped SwiGLU. The dots are about N(0, 1), so a
# limit of 0.6 clamps many gate and up values (and up from below too), and the biases move the
# dots by about as much as the weights do.
CLAMPED = clamped_swiglu(1.702, 0.6)
WEIGHT_FORMATS = ["bf16", *QUANT_FORMATS]


def make_biases(num_experts, hidden_size, inter, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_experts, 2 * inter, generator=gen).to(dtype),
            (torch.randn(num_experts, hidden_size, generator=gen) * 0.5).to(dtype))


def banks_in(name, w13, w2):
    """(stored w13, stored w2, their scale arguments, float32 w13, float32 w2 as the kernel
    computes with them) of bf16 banks in weight format `name`."""
    from moeferry.kernels.fused_moe.reference import dequantize_blocks, dequantize_w13

    if name == "bf16":
        return w13, w2, {}, w13.float(), w2.float()
    hidden_size, inter = w13.shape[2], w2.shape[2]
    q13, q2, s13, s2, block = quantized_banks(name, w13, w2)
    deq13 = torch.stack([dequantize_w13(q13[e], s13[e], block, hidden_size) for e in range(w13.shape[0])])
    return q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=block), deq13, dequantize_blocks(q2, s2, block, inter)


@pytest.mark.parametrize("name", WEIGHT_FORMATS)
@pytest.mark.parametrize("vector_isa", vector_isas())
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 8, 16])
def test_biased_clamped_experts_match_the_arithmetic_in_every_weight_format(name, vector_isa, num_tokens):
    hidden_size, inter, experts, top_k = (100, 40, 8, 4) if num_tokens % 2 else (96, 33, 6, 3)
    hidden, w13, w2, weights, ids = make_case(num_tokens, top_k, hidden_size, inter, experts, seed=20 + num_tokens)
    b13, b2 = make_biases(experts, hidden_size, inter, seed=40 + num_tokens)
    stored13, stored2, scales, float13, float2 = banks_in(name, w13, w2)
    gpt_oss = dict(w13_bias=b13, w2_bias=b2, activation=CLAMPED)
    want = rounded_model(hidden, float13, float2, weights, ids, **gpt_oss)
    assert not torch.equal(want, rounded_model(hidden, float13, float2, weights, ids, b13, b2, SILU))
    runs = [host.expert_routes(hidden, stored13, stored2, weights, ids, threads=threads, vector_isa=vector_isa,
                               **scales, **gpt_oss) for threads in (1, 2, 3)]
    assert_close_in_bf16(runs[0], want)
    assert all(torch.equal(run, runs[0]) for run in runs[1:])  # the thread count does not change the bits


@pytest.mark.parametrize("activation", [SILU, CLAMPED], ids=["silu", "clamped"])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_bias_banks_are_read_in_their_dtype_with_either_activation(activation, bias_dtype):
    hidden, w13, w2, weights, ids = make_case(7, 4, 128, 48, 16, seed=13)
    b13, b2 = make_biases(16, 128, 48, seed=14, dtype=bias_dtype)
    b13, b2 = b13 + 2.0 ** -12, b2 - 2.0 ** -12  # float32: bits that bf16 would round away
    got = host.expert_routes(hidden, w13, w2, weights, ids, threads=2, w13_bias=b13, w2_bias=b2, activation=activation)
    assert_close_in_bf16(got, rounded_model(hidden, w13, w2, weights, ids, b13, b2, activation))


@pytest.mark.parametrize("vector_isa", vector_isas())
def test_biased_routes_with_a_negative_id_are_zero_and_the_others_unchanged(vector_isa):
    hidden, w13, w2, weights, ids = make_case(6, 4, 128, 48, 16, seed=15)
    gpt_oss = dict(zip(("w13_bias", "w2_bias"), make_biases(16, 128, 48, seed=16)), activation=CLAMPED)
    assert_negative_ids_skip_only_their_routes(hidden, w13, w2, weights, ids, seed=17, vector_isa=vector_isa,
                                               **gpt_oss)


@pytest.mark.parametrize("name", WEIGHT_FORMATS)
def test_the_host_op_computes_gpt_oss_experts_in_the_kernel(name, monkeypatch):
    hidden, w13, w2, weights, ids = make_case(9, 4, 128, 64, 16, seed=18)
    stored13, stored2, scales, _, _ = banks_in(name, w13, w2)
    b13, b2 = make_biases(16, 128, 64, seed=19)
    args = (hidden, stored13, stored2, weights, ids)
    options = dict(**scales, w13_bias=b13, w2_bias=b2, activation=CLAMPED, num_routed_experts=16)
    assert host.compiles(hidden.dtype, stored13.dtype, b13.dtype, CLAMPED)
    want = reference.fused_moe(*args, **options)
    before = host.timing()
    monkeypatch.setattr(reference, "fused_moe", lambda *a, **k: pytest.fail("took the reference"))
    got = host.fused_moe(*args, **options)
    after = host.timing()
    assert after["calls"] == before["calls"] + 1
    assert after["experts"] == before["experts"] + len(set(ids.view(-1).tolist()))  # distinct experts computed
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert float(err) < 1e-2  # bf16 rounding of the activation and of each route output


def test_bad_bias_calls_are_refused_in_one_line():
    hidden, w13, w2, weights, ids = make_case(2, 2, 64, 32, 8, seed=21)
    b13, b2 = make_biases(8, 64, 32, seed=22)
    out, act = torch.empty(2, 2, 64, dtype=torch.bfloat16), torch.empty(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="w13_bias and w2_bias come together"):
        host.make_call(hidden, ids, weights, out, w13, w2, act, 1, w13_bias=b13)
    with pytest.raises(ValueError, match="biases of torch.float16 are not a dtype the kernel reads"):
        host.make_call(hidden, ids, weights, out, w13, w2, act, 1, w13_bias=b13.half(), w2_bias=b2.half())
    with pytest.raises(ValueError, match="w2_bias must be a contiguous CPU torch.bfloat16"):
        host.make_call(hidden, ids, weights, out, w13, w2, act, 1, w13_bias=b13, w2_bias=b2.float())
    with pytest.raises(ValueError, match=r"w13_bias must be a contiguous CPU torch.bfloat16 \[8, 64\]"):
        host.make_call(hidden, ids, weights, out, w13, w2, act, 1, w13_bias=b13[:, :32], w2_bias=b2)
    assert not host.compiles(torch.bfloat16, torch.bfloat16, torch.float16, CLAMPED)


@pytest.mark.parametrize("name", WEIGHT_FORMATS)
def test_the_schedule_does_not_change_the_bits(name):
    """Units dealt in fixed blocks or one at a time to a free thread: each is computed whole
    by one thread, so the outputs are the same bits, quantized banks too."""
    hidden, w13, w2, weights, ids = make_case(9, 4, 128, 64, 16, seed=21)
    stored13, stored2, scales, _, _ = banks_in(name, w13, w2)
    runs = [host.expert_routes(hidden, stored13, stored2, weights, ids, threads=3, schedule=schedule, **scales)
            for schedule in ("static", "dynamic", "static")]
    assert runs[0].abs().max() > 0 and torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


# The int8 path (activations="int8"): int4 and mxfp4 banks against activations quantized to int8
# per group. Its oracle, reference.int8_expert_routes, quantizes the same way and sums the same
# integers; the float32 steps after them are the same operations in the same order, so the
# routes agree to the bit but where the activation function's last bit differs (exp) and moves
# one act element, or its int8 value, by a step: assert_close_in_bf16's allowance. Groups of a
# multiple of 32 values take the vector paths, int4 groups of 16 the portable loop on every ISA.
INT8_FORMATS = {"int4-g32": (torch.int32, 32), "int4-g128": (torch.int32, 128), "int4-g16": (torch.int32, 16),
                "mxfp4": (torch.uint8, 32)}


def int8_isas():
    return ["portable", *[isa for isa in ("avx2", "avx512_vnni")
                          if host.INT8_ISAS[isa] <= host.INT8_ISAS[host.int8_isa()]]]


def int8_banks(name, w13, w2):
    """(w13, w2, scale arguments) in the int8 test format `name` of the shapes of float banks w13,
    w2: uniformly random stored codes (every code appears), scales that keep the dots about N(0, 1)."""
    dtype, group = INT8_FORMATS[name]
    gen = torch.Generator().manual_seed(w13.shape[2] * 7 + w2.shape[2])

    def bank(shape):
        experts, rows, cols = shape
        if dtype == torch.int32:
            codes = torch.randint(-2**31, 2**31 - 1, (experts, rows, -(-cols // 8)), generator=gen, dtype=torch.int32)
            scales = (0.5 + torch.rand(experts, rows, -(-cols // group), generator=gen)) / (4.6 * cols ** 0.5)
            return codes, scales
        codes = torch.randint(0, 256, (experts, rows, -(-cols // 2)), generator=gen, dtype=torch.uint8)
        exponent = round(127 - 1.5 - 0.5 * torch.log2(torch.tensor(float(cols))).item())  # E2M1 values' rms ~ 2.9
        return codes, torch.randint(exponent - 1, exponent + 2, (experts, rows, -(-cols // group)), generator=gen,
                                    dtype=torch.uint8)

    (q13, s13), (q2, s2) = bank(w13.shape), bank(w2.shape)
    return q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=(1, group))


def test_activations_are_quantized_per_group_symmetrically_half_to_even():
    x = torch.tensor([[1.0, -0.5, 0.25, 3.0, 0.0, 0.0, 0.0, 0.0, 127.0, 63.5, -62.5, 0.0]]).bfloat16()
    q, scale = reference.quantize_int8_groups(x, 4)
    assert torch.equal(scale, torch.tensor([[3.0, 0.0, 127.0]]) / 127)  # max |x| / 127; all zeros: 0
    assert q[0, 4:].tolist() == [0, 0, 0, 0, 127, 64, -62, 0]  # 63.5 -> 64, -62.5 -> -62: half to even
    assert q[0, :4].tolist() == [42, -21, 11, 127]


@pytest.mark.parametrize("name, isa", [(name, isa) for name in INT8_FORMATS for isa in int8_isas()
                                       if isa == "portable" or INT8_FORMATS[name][1] % 32 == 0])
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16])
def test_the_int8_path_matches_its_reference_on_every_route(name, isa, num_tokens):
    hidden_size, inter, experts, top_k = (300, 72, 8, 4) if num_tokens % 2 else (256, 130, 6, 3)
    hidden, w13, w2, weights, ids = make_case(num_tokens, top_k, hidden_size, inter, experts, seed=60 + num_tokens)
    q13, q2, scales = int8_banks(name, w13, w2)
    want = reference.int8_expert_routes(hidden, q13, q2, weights, ids, **scales)
    runs = [host.expert_routes(hidden, q13, q2, weights, ids, threads=threads, vector_isa=isa, activations="int8",
                               **scales) for threads in (1, 3)]
    assert_close_in_bf16(runs[0], want)
    assert float((runs[0] != want).float().mean()) < 0.01  # most routes' elements are the reference's bits
    assert torch.equal(runs[0], runs[1])  # the thread count does not change the bits


@pytest.mark.parametrize("name", ["int4-g32", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_every_int8_vector_path_gives_the_portable_bits(name, num_tokens):
    hidden, w13, w2, weights, ids = make_case(num_tokens, 4, 200, 96, 8, seed=70 + num_tokens)
    q13, q2, scales = int8_banks(name, w13, w2)
    runs = [host.expert_routes(hidden, q13, q2, weights, ids, threads=2, vector_isa=isa, activations="int8",
                               **scales) for isa in int8_isas()]
    assert all(torch.equal(run, runs[0]) for run in runs[1:])


@pytest.mark.parametrize("name", ["int4-g128", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_biased_clamped_experts_on_the_int8_path_match_its_reference(name, num_tokens):
    hidden, w13, w2, weights, ids = make_case(num_tokens, 4, 200, 90, 8, seed=80 + num_tokens)
    b13, b2 = make_biases(8, 200, 90, seed=90 + num_tokens)
    q13, q2, scales = int8_banks(name, w13, w2)
    gpt_oss = dict(w13_bias=b13, w2_bias=b2, activation=CLAMPED)
    want = reference.int8_expert_routes(hidden, q13, q2, weights, ids, **scales, **gpt_oss)
    assert not torch.equal(want, reference.int8_expert_routes(hidden, q13, q2, weights, ids, **scales))
    got = host.expert_routes(hidden, q13, q2, weights, ids, threads=2, activations="int8", **scales, **gpt_oss)
    assert_close_in_bf16(got, want)


# The int8 path against the exact one: activations rounded to 8 bits per group, at most 1/254 of
# a group's largest magnitude per element, move an expert's output by about 1% (relative L2) for
# these Gaussian tokens and weights; 3% is the stated bound.
INT8_TOLERANCE = 0.03


@pytest.mark.parametrize("name", ["int4-g32", "int4-g128", "mxfp4"])
@pytest.mark.parametrize("biased", [False, True], ids=["silu", "gpt-oss"])
def test_the_int8_path_stays_within_its_tolerance_of_the_exact_path(name, biased):
    hidden, w13, w2, weights, ids = make_case(8, 4, 512, 128, 16, seed=100)
    q13, q2, scales = int8_banks(name, w13, w2)
    extra = dict(zip(("w13_bias", "w2_bias"), make_biases(16, 512, 128, seed=101)), activation=CLAMPED) if biased else {}
    exact = host.expert_routes(hidden, q13, q2, weights, ids, threads=2, **scales, **extra).float()
    int8 = host.expert_routes(hidden, q13, q2, weights, ids, threads=2, activations="int8", **scales, **extra).float()
    assert not torch.equal(int8, exact)
    assert float((int8 - exact).norm() / exact.norm()) < INT8_TOLERANCE


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_banks_without_integer_weights_take_the_exact_path_under_int8(name):
    hidden, w13, w2, weights, ids = make_case(5, 4, 128, 64, 8, seed=110)
    stored13, stored2, scales, _, _ = banks_in(name, w13, w2)
    runs = [host.expert_routes(hidden, stored13, stored2, weights, ids, threads=2, activations=a, **scales)
            for a in ("bf16", "int8")]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("name", ["int4-g32", "mxfp4"])
def test_int8_routes_with_a_negative_id_are_zero_and_the_others_unchanged(name):
    hidden, w13, w2, weights, ids = make_case(6, 4, 128, 48, 16, seed=111)
    q13, q2, scales = int8_banks(name, w13, w2)
    assert_negative_ids_skip_only_their_routes(hidden, q13, q2, weights, ids, seed=112, activations="int8", **scales)


def test_bad_int8_calls_are_refused_in_one_line():
    hidden, w13, w2, weights, ids = make_case(2, 2, 64, 32, 8, seed=113)
    q13, q2, scales = int8_banks("int4-g32", w13, w2)
    out, act = torch.empty(2, 2, 64, dtype=torch.bfloat16), torch.empty(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="activations 'fp8' is not one of bf16, int8"):
        host.make_call(hidden, ids, weights, out, q13, q2, act, 1, activations="fp8", **scales)
    if host.int8_isa() != "avx512_vnni":
        with pytest.raises(host.HostKernelUnavailable, match="no AVX512-VNNI"):
            host.make_call(hidden, ids, weights, out, q13, q2, act, 1, vector_isa="avx512_vnni", **scales)
