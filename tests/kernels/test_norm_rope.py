"""RMSNorm, residual add + RMSNorm and rotary: the references equal the modules' arithmetic bit
for bit (the CPU path the HF parity tests run), and the Triton kernels (interpreted on CPU)
match the references on every element, for odd row sizes, strided inputs, output buffers
poisoned with NaN, and the allowed in-place aliasing."""
from types import SimpleNamespace

import pytest
import torch

from moeferry.engine.cuda_graph import capture
from moeferry.kernels import norm_rope as ops
from moeferry.kernels.norm_rope import reference
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
    got = reference.apply_rotary(q, k, positions, rotary.cos, rotary.sin)
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
        got = ops.rms_norm(x, module.weight, EPS, out=out, impl="triton")
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
                                               residual_out=residual_out, impl="triton")
        assert residual_out is None or total is residual_out
        assert torch.equal(total, expected_total)
        assert_close(normed, expected_normed, dtype)

    for n in SIZES:
        check(randn(n, d, dtype=dtype, generator=g), randn(n, d, dtype=dtype, generator=g), "buffer")
    for target in ("new", "x", "residual"):  # in place into either input
        check(randn(5, d, dtype=dtype, generator=g), randn(5, d, dtype=dtype, generator=g), target)
    wide = randn(5, 2, d + 2, dtype=dtype, generator=g)
    check(wide[:, 0, 1:d + 1], wide[:, 1, :d], "new")  # strided rows


def test_empty_batches_and_refused_arguments():
    w = torch.ones(48)
    assert ops.rms_norm(torch.empty(0, 48), w, EPS, impl="triton").shape == (0, 48)
    x = torch.randn(3, 48)
    for impl in ("triton", "reference"):
        with pytest.raises(ValueError):
            ops.fused_add_rms_norm(x, x.bfloat16(), w, EPS, impl=impl)
    with pytest.raises(ValueError):
        ops.rms_norm(x, w, EPS, out=torch.empty(3, 48, dtype=torch.bfloat16), impl="triton")
    with pytest.raises(ValueError):
        ops.rms_norm(x, torch.ones(47), EPS, impl="triton")


# q/k norm + rotary + KV-cache store in one launch (the attention prologue of a decode step).

def qkv_step(n, hq, hkv, d, dtype, generator, device="cpu", max_pos=64, cache_dtype=None):
    """q, k, v as per-head views of one fused qkv projection, positions, distinct shuffled out
    slots, and caches pre-filled with random values."""
    qkv = randn(n, (hq + 2 * hkv) * d, dtype=dtype, generator=generator, device=device)
    slots = 2 * n + 5
    return {"q": qkv[:, :hq * d].view(n, hq, d), "k": qkv[:, hq * d:(hq + hkv) * d].view(n, hkv, d),
            "v": qkv[:, (hq + hkv) * d:].view(n, hkv, d),
            "positions": torch.randint(0, max_pos, (n,), generator=generator).to(device),
            "out_slots": torch.randperm(slots, generator=generator)[:n].to(device),
            "k_cache": randn(slots, hkv, d, dtype=cache_dtype or dtype, generator=generator, device=device),
            "v_cache": randn(slots, hkv, d, dtype=dtype, generator=generator, device=device)}


def norm_weights(d, dtype, generator, device="cpu"):
    return {name: (1 + 0.5 * torch.randn(d, generator=generator)).to(device, dtype)
            for name in ("q_norm_weight", "k_norm_weight")}


def run_store(t, rotary, weights, q_out=None, impl=None):
    """The op on copies of t's caches, the written slots poisoned with NaN first:
    (q_rot, k_rot, k_cache, v_cache)."""
    k_cache, v_cache = t["k_cache"].clone(), t["v_cache"].clone()
    k_cache[t["out_slots"]] = float("nan")
    v_cache[t["out_slots"]] = float("nan")
    q_rot, k_rot = ops.qk_norm_rope_store(t["q"], t["k"], t["v"], t["positions"], rotary.cos, rotary.sin,
                                          k_cache, v_cache, t["out_slots"], **weights, eps=EPS, q_out=q_out,
                                          impl=impl)
    assert q_out is None or q_rot is q_out
    return q_rot, k_rot, k_cache, v_cache


def assert_stored(t, k_rot, k_cache, v_cache):
    """Written slots hold k_rot and v exactly; every other slot is untouched."""
    slots = t["out_slots"]
    assert torch.equal(k_cache[slots], k_rot) and torch.equal(v_cache[slots], t["v"])
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device=k_cache.device)
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], t["k_cache"][untouched])
    assert torch.equal(v_cache[untouched], t["v_cache"][untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True])
def test_reference_qk_norm_rope_store_is_the_module_steps(dtype, norm):
    g = torch.Generator().manual_seed(7)
    rotary, d = make_rotary(64, 64), 64
    t = qkv_step(5, 4, 2, d, dtype, g)
    weights = norm_weights(d, dtype, g) if norm else {}
    q, k = t["q"], t["k"]
    if norm:  # the attention layer's own steps: q_norm, k_norm, rotary, index_copy_
        q = original_rms_norm(SimpleNamespace(weight=weights["q_norm_weight"], eps=EPS), q)
        k = original_rms_norm(SimpleNamespace(weight=weights["k_norm_weight"], eps=EPS), k)
    e_q, e_k = original_rotary(rotary, t["positions"], q, k)
    e_k_cache, e_v_cache = t["k_cache"].clone(), t["v_cache"].clone()
    e_k_cache.index_copy_(0, t["out_slots"], e_k)
    e_v_cache.index_copy_(0, t["out_slots"], t["v"])
    for impl in ("reference", None):  # the reference, and the CPU dispatch
        q_rot, k_rot, k_cache, v_cache = run_store(t, rotary, weights, impl=impl)
        for got, expected in ((q_rot, e_q), (k_rot, e_k), (k_cache, e_k_cache), (v_cache, e_v_cache)):
            assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1)])
@pytest.mark.parametrize("d", [48, 64, 128])  # 48: a half of 24, masked lanes
def test_qk_norm_rope_store_matches(dtype, norm, hq, hkv, d):
    g = torch.Generator().manual_seed(d + hq)
    rotary = make_rotary(d, 64)
    weights = norm_weights(d, dtype, g) if norm else {}
    for n in (1, 3, 17):
        t = qkv_step(n, hq, hkv, d, dtype, g)
        e_q, e_k, _, _ = run_store(t, rotary, weights, impl="reference")
        q_rot, k_rot, k_cache, v_cache = run_store(t, rotary, weights, q_out=poisoned((n, hq, d), dtype),
                                                   impl="triton")
        if norm:  # the norms' reduction order and rsqrt; rotary and stores exact given them
            assert_close(q_rot, e_q, dtype)
            assert_close(k_rot, e_k, dtype)
        else:  # rotary alone is exact
            assert torch.equal(q_rot, e_q) and torch.equal(k_rot, e_k)
        assert_stored(t, k_rot, k_cache, v_cache)


def test_qk_norm_rope_store_in_place_and_promoted_weights():
    g = torch.Generator().manual_seed(11)
    rotary, d = make_rotary(64, 64), 64
    # q_out = q in place (q contiguous), int32 positions and slots.
    t = qkv_step(6, 4, 2, d, torch.bfloat16, g)
    weights = norm_weights(d, torch.bfloat16, g)
    e_q, e_k, _, _ = run_store(t, rotary, weights, impl="reference")
    t.update(q=t["q"].contiguous(), positions=t["positions"].int(), out_slots=t["out_slots"].int())
    q_rot, k_rot, k_cache, v_cache = run_store(t, rotary, weights, q_out=t["q"], impl="triton")
    assert_close(q_rot, e_q, torch.bfloat16)
    assert_close(k_rot, e_k, torch.bfloat16)
    t["out_slots"] = t["out_slots"].long()
    assert_stored(t, k_rot, k_cache, v_cache)
    # fp32 weights on bf16 heads: normed heads, rotary and k_cache in fp32, v stays bf16.
    t = qkv_step(5, 4, 2, d, torch.bfloat16, g, cache_dtype=torch.float32)
    weights = norm_weights(d, torch.float32, g)
    e_q, e_k, _, _ = run_store(t, rotary, weights, impl="reference")
    q_rot, k_rot, k_cache, v_cache = run_store(t, rotary, weights, impl="triton")
    assert q_rot.dtype == k_rot.dtype == torch.float32
    assert_close(q_rot, e_q, torch.bfloat16)
    assert_close(k_rot, e_k, torch.bfloat16)
    assert_stored(t, k_rot, k_cache, v_cache)


def test_qk_norm_rope_store_empty_batch_and_refused_arguments():
    g = torch.Generator().manual_seed(12)
    rotary = make_rotary(64, 64)
    t = qkv_step(0, 4, 2, 64, torch.float32, g)
    q_rot, k_rot, k_cache, v_cache = run_store(t, rotary, {}, impl="triton")
    assert q_rot.shape == (0, 4, 64) and k_rot.shape == (0, 2, 64)
    assert torch.equal(k_cache, t["k_cache"]) and torch.equal(v_cache, t["v_cache"])

    def refused(impl="triton", **change):
        t = qkv_step(3, 4, 2, 64, torch.float32, torch.Generator().manual_seed(13))
        weights = change.pop("weights", {})
        t.update(change)
        with pytest.raises(ValueError):
            run_store(t, rotary, weights, impl=impl)

    for impl in ("triton", "reference"):  # one weight without the other
        refused(impl, weights={"q_norm_weight": torch.ones(64)})
    refused(k_cache=torch.zeros(11, 2, 64, dtype=torch.bfloat16))  # cache dtype is not k_rot's
    refused(v_cache=torch.zeros(11, 64, 2).transpose(1, 2))  # cache without a unit last stride
    refused(k_cache=torch.zeros(11, 1, 64))  # cache heads
    refused(v=torch.zeros(3, 2, 64, dtype=torch.bfloat16))  # v in another dtype
    refused(weights={"q_norm_weight": torch.ones(32), "k_norm_weight": torch.ones(32)})
    refused(out_slots=torch.zeros(2, dtype=torch.int64))


# Real sizes on the GPU (Qwen3-30B-A3B: hidden 2048, 32 q heads, 4 kv heads, head_dim 128).

HIDDEN, HQ, HKV, HEAD_DIM, MAX_POS = 2048, 32, 4, 128, 8192


def _qwen3_step(n, generator, device="cuda", dtype=torch.bfloat16):
    return dict(
        x=randn(n, HIDDEN, dtype=dtype, generator=generator, device=device),
        residual=randn(n, HIDDEN, dtype=dtype, generator=generator, device=device),
        q=randn(n, HQ, HEAD_DIM, dtype=dtype, generator=generator, device=device),
        k=randn(n, HKV, HEAD_DIM, dtype=dtype, generator=generator, device=device))


def _reference_step(t, weights):
    normed, total = reference.fused_add_rms_norm(t["x"], t["residual"], weights["hidden"], EPS)
    return (normed, total, reference.rms_norm(t["q"], weights["q"], EPS),
            reference.rms_norm(t["k"], weights["k"], EPS))


def _qwen3_weights(generator, device="cuda"):
    return {name: (1 + 0.1 * torch.randn(size, generator=generator)).to(device, torch.bfloat16)
            for name, size in (("hidden", HIDDEN), ("q", HEAD_DIM), ("k", HEAD_DIM))}


def _assert_step(got, expected):
    normed, total, q, k = got
    e_normed, e_total, e_q, e_k = expected
    assert torch.equal(total, e_total)
    for a, b in ((normed, e_normed), (q, e_q), (k, e_k)):
        assert_close(a, b, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64, 512])
def test_real_sizes_on_gpu(n):
    g = torch.Generator().manual_seed(n)
    weights = _qwen3_weights(g)
    t = _qwen3_step(n, g)
    normed, total = ops.fused_add_rms_norm(t["x"], t["residual"], weights["hidden"], EPS)
    q, k = ops.rms_norm(t["q"], weights["q"], EPS), ops.rms_norm(t["k"], weights["k"], EPS)
    _assert_step((normed, total, q, k), _reference_step(t, weights))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 512])
def test_cuda_graph_replays_with_new_inputs(n):
    g = torch.Generator().manual_seed(100 + n)
    weights = _qwen3_weights(g)
    static = _qwen3_step(n, g)
    residual_stream = static["residual"].clone()  # updated in place by the captured step

    def step():
        normed, total = ops.fused_add_rms_norm(static["x"], residual_stream, weights["hidden"], EPS,
                                               residual_out=residual_stream)
        return (normed, total, ops.rms_norm(static["q"], weights["q"], EPS),
                ops.rms_norm(static["k"], weights["k"], EPS))

    graph, outputs = capture(step)
    for seed in (1, 2):
        fresh = _qwen3_step(n, torch.Generator().manual_seed(1000 * seed + n))
        for name, tensor in fresh.items():
            static[name].copy_(tensor)
        residual_stream.copy_(fresh["residual"])
        graph.replay()
        torch.cuda.synchronize()
        assert outputs[1].data_ptr() == residual_stream.data_ptr()
        _assert_step(outputs, _reference_step(fresh, weights))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64])
def test_qk_norm_rope_store_real_sizes_on_gpu(n):
    g = torch.Generator().manual_seed(200 + n)
    rotary = make_rotary(HEAD_DIM, MAX_POS, theta=1e6, device="cuda")
    weights = norm_weights(HEAD_DIM, torch.bfloat16, g, device="cuda")

    def step(generator):
        return qkv_step(n, HQ, HKV, HEAD_DIM, torch.bfloat16, generator, device="cuda", max_pos=MAX_POS)

    t = step(g)
    e_q, e_k, _, _ = run_store(t, rotary, weights, impl="reference")
    q_rot, k_rot, k_cache, v_cache = run_store(t, rotary, weights, q_out=poisoned((n, HQ, HEAD_DIM), torch.bfloat16,
                                                                                  "cuda"))
    assert_close(q_rot, e_q, torch.bfloat16)
    assert_close(k_rot, e_k, torch.bfloat16)
    assert_stored(t, k_rot, k_cache, v_cache)

    # Captured in a CUDA graph, replayed with new values in the same buffers (one qkv output).
    static = step(g)
    qkv = torch.cat([static[name].reshape(n, -1) for name in ("q", "k", "v")], dim=1)
    static.update(q=qkv[:, :HQ * HEAD_DIM].view(n, HQ, HEAD_DIM),
                  k=qkv[:, HQ * HEAD_DIM:(HQ + HKV) * HEAD_DIM].view(n, HKV, HEAD_DIM),
                  v=qkv[:, (HQ + HKV) * HEAD_DIM:].view(n, HKV, HEAD_DIM))
    k_cache, v_cache = static["k_cache"], static["v_cache"]
    q_out = torch.empty(n, HQ, HEAD_DIM, dtype=torch.bfloat16, device="cuda")

    def op():
        return ops.qk_norm_rope_store(static["q"], static["k"], static["v"], static["positions"], rotary.cos,
                                      rotary.sin, k_cache, v_cache, static["out_slots"], **weights, eps=EPS,
                                      q_out=q_out)

    graph, (_, k_rot) = capture(op)
    for seed in (1, 2):
        fresh = step(torch.Generator().manual_seed(1000 * seed + n))
        for name in ("q", "k", "v", "positions", "out_slots"):
            static[name].copy_(fresh[name])
        k_cache.copy_(fresh["k_cache"])
        v_cache.copy_(fresh["v_cache"])
        graph.replay()
        torch.cuda.synchronize()
        e_q, e_k, _, _ = run_store(fresh, rotary, weights, impl="reference")
        assert_close(q_out, e_q, torch.bfloat16)
        assert_close(k_rot, e_k, torch.bfloat16)
        assert_stored(fresh, k_rot, k_cache, v_cache)
