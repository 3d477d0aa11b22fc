"""RMSNorm, residual add + RMSNorm and rotary: the references equal the modules' arithmetic bit
for bit (the CPU path the HF parity tests run), and the Triton kernels (interpreted on CPU)
match the references on every element, for odd row sizes, strided inputs, output buffers
poisoned with NaN, and the allowed in-place aliasing."""
from types import SimpleNamespace

import pytest
import torch

from moeferry.kernels import norm_rope as ops
from moeferry.kernels.reference import norm_rope as reference
from moeferry.layers.norm import RMSNorm
from moeferry.layers.rotary import RotaryEmbedding

EPS = 1e-6
SIZES = [1, 3, 8, 17]  # token counts N
DTYPES = [torch.float32, torch.bfloat16]
# The norms differ from torch only by the fp32 row reduction's order and rsqrt (an ulp or two
# before the cast); residual sums and rotary are exact.
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def randn(*shape, dtype, generator, device="cpu"):
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def poisoned(shape, dtype, device="cpu"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not actual.isnan().any()
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def make_rotary(head_dim, max_positions, theta=10000.0, device="cpu"):
    return RotaryEmbedding(SimpleNamespace(rope_theta=theta), head_dim, max_positions).to(device)


def norm_module(d, dtype, weight_dtype, generator):
    module = RMSNorm(d, EPS)
    with torch.no_grad():
        module.weight.copy_(1 + 0.5 * torch.randn(d, generator=generator))
    return module.to(weight_dtype or dtype)


# The references are the modules' arithmetic: bit-identical. The modules will call the
# dispatchers, so their original code is kept here verbatim as the fixed point.

def original_rms_norm(module, x):
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + module.eps)
    return module.weight * x32.to(dtype)


def original_rotary(rotary, positions, q, k):
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos = rotary.cos[positions].unsqueeze(1).to(q.dtype)
    sin = rotary.sin[positions].unsqueeze(1).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
def test_reference_norms_are_the_module_bit_for_bit(dtype, weight_dtype):
    g = torch.Generator().manual_seed(0)
    module = norm_module(96, dtype, weight_dtype, g)
    for shape in [(17, 96), (5, 3, 96)]:
        x, r = randn(*shape, dtype=dtype, generator=g), randn(*shape, dtype=dtype, generator=g)
        expected = original_rms_norm(module, x)
        assert torch.equal(reference.rms_norm(x, module.weight, EPS), expected)
        assert torch.equal(ops.rms_norm(x, module.weight, EPS), expected)  # CPU dispatch
        assert torch.equal(module(x), expected)
    normed, total = ops.fused_add_rms_norm(x[:, 0], r[:, 0], module.weight, EPS)
    assert torch.equal(total, x[:, 0] + r[:, 0])
    assert torch.equal(normed, original_rms_norm(module, x[:, 0] + r[:, 0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_rotary_is_the_module_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    rotary = make_rotary(48, 64)
    q, k = randn(9, 4, 48, dtype=dtype, generator=g), randn(9, 2, 48, dtype=dtype, generator=g)
    positions = torch.randint(0, 64, (9,), generator=g)
    expected = original_rotary(rotary, positions, q, k)
    for got in (reference.apply_rotary(q, k, positions, rotary.cos, rotary.sin),
                ops.apply_rotary(q, k, positions, rotary.cos, rotary.sin), rotary(positions, q, k)):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# Triton (interpreted) against the reference and the modules.

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
@pytest.mark.parametrize("d", [48, 96])
def test_rms_norm_matches(dtype, weight_dtype, d):
    g = torch.Generator().manual_seed(d)
    module = norm_module(d, dtype, weight_dtype, g)
    out_dtype = torch.promote_types(module.weight.dtype, dtype)

    def check(x, out):
        expected = reference.rms_norm(x, module.weight, EPS)
        assert torch.equal(expected, module(x))
        got = ops.rms_norm(x, module.weight, EPS, out=out, use_triton=True)
        assert out is None or got is out
        assert_close(got, expected, dtype)

    for n in SIZES:
        check(randn(n, d, dtype=dtype, generator=g), poisoned((n, d), out_dtype))
    n = SIZES[-1]
    wide = randn(n, 3, d + 5, dtype=dtype, generator=g)
    check(randn(n, 3, d, dtype=dtype, generator=g), poisoned((n, 3, d), out_dtype))  # per-head q/k norm
    check(wide[:, :, 2:d + 2], poisoned((n, 3, d), out_dtype))  # heads sliced from a wider projection
    check(wide[:, 1, 1:d + 1], None)  # strided rows, output allocated


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [48, 96])
def test_fused_add_rms_norm_matches(dtype, d):
    g = torch.Generator().manual_seed(d)
    module = norm_module(d, dtype, None, g)

    def check(x, residual, target):
        expected_total = x + residual
        expected_normed = module(expected_total)
        residual_out = {"new": None, "buffer": poisoned(x.shape, dtype), "x": x, "residual": residual}[target]
        normed, total = ops.fused_add_rms_norm(x, residual, module.weight, EPS, out=poisoned(x.shape, dtype),
                                               residual_out=residual_out, use_triton=True)
        assert residual_out is None or total is residual_out
        assert torch.equal(total, expected_total)
        assert_close(normed, expected_normed, dtype)

    for n in SIZES:
        check(randn(n, d, dtype=dtype, generator=g), randn(n, d, dtype=dtype, generator=g), "buffer")
    for target in ("new", "x", "residual"):  # in place into either input
        check(randn(5, d, dtype=dtype, generator=g), randn(5, d, dtype=dtype, generator=g), target)
    wide = randn(5, 2, d + 2, dtype=dtype, generator=g)
    check(wide[:, 0, 1:d + 1], wide[:, 1, :d], "new")  # strided rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,hq,hkv", [(48, 4, 2), (96, 3, 1)])
def test_rotary_matches_bit_for_bit(dtype, head_dim, hq, hkv):
    g = torch.Generator().manual_seed(head_dim + hq)
    rotary = make_rotary(head_dim, 40)

    def check(q, k, positions, tables=(rotary.cos, rotary.sin), target="buffer"):
        expected = reference.apply_rotary(q, k, positions, *tables)
        if tables[0] is rotary.cos:
            module_q, module_k = rotary(positions, q, k)
            assert torch.equal(module_q, expected[0]) and torch.equal(module_k, expected[1])
        q_out, k_out = {"new": (None, None), "inplace": (q.clone(), k.clone()),
                        "buffer": (poisoned(q.shape, dtype), poisoned(k.shape, dtype))}[target]
        src_q, src_k = (q_out, k_out) if target == "inplace" else (q, k)
        got = ops.apply_rotary(src_q, src_k, positions, *tables, q_out=q_out, k_out=k_out, use_triton=True)
        assert q_out is None or (got[0] is q_out and got[1] is k_out)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

    def inputs(n):
        return (randn(n, hq, head_dim, dtype=dtype, generator=g), randn(n, hkv, head_dim, dtype=dtype, generator=g),
                torch.randint(0, 40, (n,), generator=g))

    for n in SIZES:
        check(*inputs(n))
    check(*inputs(6), tables=(torch.randn(40, head_dim, generator=g), torch.randn(40, head_dim, generator=g)))
    check(*inputs(6), target="new")
    check(*inputs(6), target="inplace")
    qkv = randn(6, (hq + 2 * hkv) * head_dim, dtype=dtype, generator=g)  # slices of a fused projection
    q = qkv[:, :hq * head_dim].view(6, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(6, hkv, head_dim)
    check(q, k, torch.randint(0, 40, (6,), generator=g))


def test_empty_batches_and_refused_arguments():
    w = torch.ones(48)
    assert ops.rms_norm(torch.empty(0, 48), w, EPS, use_triton=True).shape == (0, 48)
    q, k = ops.apply_rotary(torch.empty(0, 2, 48), torch.empty(0, 1, 48), torch.empty(0, dtype=torch.int64),
                            torch.zeros(4, 48), torch.zeros(4, 48), use_triton=True)
    assert q.shape == (0, 2, 48) and k.shape == (0, 1, 48)
    x = torch.randn(3, 48)
    for use_triton in (True, False):
        with pytest.raises(ValueError):
            ops.fused_add_rms_norm(x, x.bfloat16(), w, EPS, use_triton=use_triton)
    with pytest.raises(ValueError):
        ops.rms_norm(x, w, EPS, out=torch.empty(3, 48, dtype=torch.bfloat16), use_triton=True)
    with pytest.raises(ValueError):
        ops.rms_norm(x, torch.ones(47), EPS, use_triton=True)
    with pytest.raises(ValueError):
        ops.apply_rotary(torch.randn(3, 2, 47), torch.randn(3, 1, 47), torch.zeros(3, dtype=torch.int64),
                         torch.zeros(4, 47), torch.zeros(4, 47), use_triton=True)


# Real sizes on the GPU (Qwen3-30B-A3B: hidden 2048, 32 q heads, 4 kv heads, head_dim 128).

HIDDEN, HQ, HKV, HEAD_DIM, MAX_POS = 2048, 32, 4, 128, 8192


def _qwen3_step(n, generator, device="cuda", dtype=torch.bfloat16):
    return dict(
        x=randn(n, HIDDEN, dtype=dtype, generator=generator, device=device),
        residual=randn(n, HIDDEN, dtype=dtype, generator=generator, device=device),
        q=randn(n, HQ, HEAD_DIM, dtype=dtype, generator=generator, device=device),
        k=randn(n, HKV, HEAD_DIM, dtype=dtype, generator=generator, device=device),
        positions=torch.randint(0, MAX_POS, (n,), generator=generator).to(device))


def _reference_step(t, weights, rotary):
    normed, total = reference.fused_add_rms_norm(t["x"], t["residual"], weights["hidden"], EPS)
    q = reference.rms_norm(t["q"], weights["q"], EPS)
    k = reference.rms_norm(t["k"], weights["k"], EPS)
    return (normed, total, q, k) + reference.apply_rotary(q, k, t["positions"], rotary.cos, rotary.sin)


def _qwen3_weights(generator, device="cuda"):
    return {name: (1 + 0.1 * torch.randn(size, generator=generator)).to(device, torch.bfloat16)
            for name, size in (("hidden", HIDDEN), ("q", HEAD_DIM), ("k", HEAD_DIM))}


def _assert_step(got, expected):
    normed, total, q, k, q_rot, k_rot = got
    e_normed, e_total, e_q, e_k, e_q_rot, e_k_rot = expected
    assert torch.equal(total, e_total)
    for a, b in ((normed, e_normed), (q, e_q), (k, e_k), (q_rot, e_q_rot), (k_rot, e_k_rot)):
        assert_close(a, b, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64, 512])
def test_real_sizes_on_gpu(n):
    g = torch.Generator().manual_seed(n)
    rotary = make_rotary(HEAD_DIM, MAX_POS, theta=1e6, device="cuda")
    weights = _qwen3_weights(g)
    t = _qwen3_step(n, g)
    normed, total = ops.fused_add_rms_norm(t["x"], t["residual"], weights["hidden"], EPS)
    q, k = ops.rms_norm(t["q"], weights["q"], EPS), ops.rms_norm(t["k"], weights["k"], EPS)
    q_rot, k_rot = ops.apply_rotary(q, k, t["positions"], rotary.cos, rotary.sin)
    _assert_step((normed, total, q, k, q_rot, k_rot), _reference_step(t, weights, rotary))
    exact = reference.apply_rotary(q, k, t["positions"], rotary.cos, rotary.sin)
    assert torch.equal(q_rot, exact[0]) and torch.equal(k_rot, exact[1])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 512])
def test_cuda_graph_replays_with_new_inputs(n):
    g = torch.Generator().manual_seed(100 + n)
    rotary = make_rotary(HEAD_DIM, MAX_POS, theta=1e6, device="cuda")
    weights = _qwen3_weights(g)
    static = _qwen3_step(n, g)
    residual_stream = static["residual"].clone()  # updated in place by the captured step

    def step():
        normed, total = ops.fused_add_rms_norm(static["x"], residual_stream, weights["hidden"], EPS,
                                               residual_out=residual_stream)
        q, k = ops.rms_norm(static["q"], weights["q"], EPS), ops.rms_norm(static["k"], weights["k"], EPS)
        return (normed, total, q, k) + ops.apply_rotary(q, k, static["positions"], rotary.cos, rotary.sin,
                                                        q_out=q, k_out=k)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for seed in (1, 2):
        fresh = _qwen3_step(n, torch.Generator().manual_seed(1000 * seed + n))
        for name, tensor in fresh.items():
            static[name].copy_(tensor)
        residual_stream.copy_(fresh["residual"])
        graph.replay()
        torch.cuda.synchronize()
        expected = _reference_step(fresh, weights, rotary)
        normed, total, _, _, q_rot, k_rot = outputs
        assert total.data_ptr() == residual_stream.data_ptr()
        assert torch.equal(total, expected[1])
        assert_close(normed, expected[0], torch.bfloat16)
        assert_close(q_rot, expected[4], torch.bfloat16)
        assert_close(k_rot, expected[5], torch.bfloat16)
