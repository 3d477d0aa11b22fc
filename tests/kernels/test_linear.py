"""The skinny linear: both paths of the Triton kernel (interpreted on CPU; CUDA cores for a few
rows, tensor cores in 16-row tiles) against the exact product rounded to the output dtype, for
row counts around their row blocks, N and K that their blocks do not divide, bf16/fp16/fp32,
with and without bias; bit-identical results run to run; the dispatcher's routing; the Linear
module's state dict and hooks.

Tolerance. The kernel sums K products (and the bias) in fp32, so its fp32 value a is within
gamma * S of the exact value e, S = |x| @ |w|.T + |b|, gamma = n u / (1 - n u), n = K + 1,
u = 2^-24, whatever the order of the sums. Tensor cores are not documented to round their
internal fp32 additions to nearest (truncation doubles the error of each), so the tests allow
2 gamma S. It returns got = round(a); the reference is ref = round(e), e in float64 (exact
enough: no error of its own to allow for, and no TF32 on the GPU). So
    |got - ref| <= ulp(got) / 2 + 2 gamma S + ulp(ref) / 2,
one ulp of the output dtype when the sum does not cancel, a few fp32 ulps of S when it does.
For fp32 output that is 2 gamma S plus an fp32 ulp: the accumulation error bound, nothing more.
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

from moeferry.kernels import linear as ops
from moeferry.kernels.linear import reference
from moeferry.kernels.linear import triton as triton_linear
from moeferry.kernels.linear.triton import LinearConfig, select_config
from moeferry.layers.linear import Linear

SHAPES = [(16, 64), (40, 200), (130, 200)]  # (N, K): N a multiple of BLOCK_N or not, K of none
# Small tiles on each path, so that N = 40 and 130 and K = 200 end in partial blocks, with row
# counts that give partial row blocks: 16-row tiles (1, 3), a full one (16), a second one of a
# single row (17); 4-row blocks (1, 3) and a second, partial one (5); the one-row kernel.
SMALL_TILES = [(LinearConfig(16, 32, 32, num_warps=4, num_stages=2, tensor_cores=True), [1, 3, 16, 17]),
               (LinearConfig(4, 8, 64, num_warps=4, num_stages=1), [1, 3, 5]),
               (LinearConfig(1, 4, 64, num_warps=4, num_stages=1), [1, 2])]


def inputs(m, n, k, dtype, bias, seed, device="cpu"):
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=g, device=device).to(dtype) if bias else None
    return x, w, b


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of dtype's values at |v| (float64 v, values of dtype or exact ones)."""
    fi = torch.finfo(dtype)
    binade = torch.ldexp(torch.ones_like(v), torch.frexp(v).exponent - 1)  # 2^floor(log2|v|)
    binade = torch.where(v == 0, fi.tiny, binade).clamp_min(fi.tiny)
    return binade * fi.eps


def assert_close_to_exact(got, x, w, b):
    dtype, k = x.dtype, x.shape[1]
    assert got.dtype == dtype and got.shape == (x.shape[0], w.shape[0]) and got.is_contiguous()
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    ref = exact.to(dtype).double()
    s = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    nu = (k + 1) * 2.0 ** -24
    tol = (ulp(got.double(), dtype) + ulp(ref, dtype)) / 2 + 2 * nu / (1 - nu) * s
    err = (got.double() - ref).abs()
    assert not got.isnan().any()
    assert (err <= tol).all(), f"worst {(err - tol).max().item():.3g} over tolerance"


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("n,k,dtype", [(n, k, torch.bfloat16) for n, k in SHAPES] + [(40, 200, torch.float32)],
                         ids=[f"{n}x{k}-bf16" for n, k in SHAPES] + ["40x200-fp32"])
def test_kernel_matches_exact_product(n, k, dtype, bias):
    for config, rows in SMALL_TILES:
        for m in rows:
            x, w, b = inputs(m, n, k, dtype, bias, seed=m * 1000 + n + k)
            assert_close_to_exact(triton_linear.linear(x, w, b, config=config), x, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_chosen_tiles_match_exact_product(dtype):
    for m in (1, 3, 16, 17):  # select_config's tiles, on both paths
        x, w, b = inputs(m, 40, 200, dtype, True, seed=m)
        assert_close_to_exact(triton_linear.linear(x, w, b), x, w, b)


def test_fp16_and_strided_rows():
    x, w, b = inputs(5, 40, 200, torch.float16, True, seed=5)
    assert_close_to_exact(triton_linear.linear(x, w, b), x, w, b)
    wide = torch.full((5, 260), float("nan"), dtype=torch.bfloat16)  # rows of x 260 apart
    x, w, b = inputs(5, 40, 200, torch.bfloat16, False, seed=6)
    wide[:, 30:230] = x
    assert_close_to_exact(triton_linear.linear(wide[:, 30:230], w, b), x, w, b)
    tall = torch.full((80, 200), float("nan"), dtype=torch.bfloat16)  # weight rows 2 apart
    tall[::2] = w
    assert_close_to_exact(triton_linear.linear(x, tall[::2], b), x, w, b)


def test_bits_identical_run_to_run():
    for m in (2, 16):  # one call of each path
        x, w, b = inputs(m, 40, 200, torch.bfloat16, True, seed=9)
        assert torch.equal(triton_linear.linear(x, w, b), triton_linear.linear(x, w, b))


def test_select_config():
    shapes = [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048), (16, 64), (130, 200)]
    for (n, k), m in itertools.product(shapes, range(1, 18)):
        c = select_config(m, n, k)
        c.check()
        assert c.block_m >= min(m, 16) and c.block_k <= max(16, k)  # one row block up to 16 rows
        if not c.tensor_cores:  # fp32 partial sums held per thread
            assert c.block_m * c.block_n * c.block_k <= 64 * 32 * c.num_warps
        assert c.tensor_cores == (m > 1 and m * n * k > triton_linear.FMA_MAX_MACS)


def test_empty_and_refused_arguments():
    x, w, b = inputs(3, 40, 64, torch.bfloat16, True, seed=1)
    assert triton_linear.linear(x[:0], w, b).shape == (0, 40)
    assert torch.equal(triton_linear.linear(x[:, :0], w[:, :0], b), b.expand(3, 40))
    refused = [
        (x.float(), w, None),  # dtypes differ
        (x, w.float(), None),
        (x.double(), w.double(), None),  # dtype unsupported
        (x, w, b[:39]),  # bias shape
        (x, w, b.float()),  # bias dtype
        (x.view(3, 1, 64), w, None),  # not 2-D (the dispatcher flattens, the kernel does not)
        (x, w[:, :63], None),  # K differs
        (x, w.t().contiguous().t(), None),  # column-major weight
    ]
    for args in refused:
        with pytest.raises(ValueError):
            triton_linear.linear(*args)
    for config in (LinearConfig(16, 8, 64, 4, 2, tensor_cores=True), LinearConfig(8, 16, 64, 4, 2, tensor_cores=True),
                   LinearConfig(32, 1, 64, 4, 1), LinearConfig(1, 3, 64, 4, 1), LinearConfig(1, 1, 8, 4, 1)):
        with pytest.raises(ValueError):
            triton_linear.linear(x, w, b, config=config)


@pytest.fixture
def triton_calls(monkeypatch):
    """Records each call that reaches the Triton module's linear."""
    calls = []
    real = triton_linear.linear

    def recording(x, weight, bias=None, **kw):
        calls.append(tuple(x.shape))
        return real(x, weight, bias, **kw)

    monkeypatch.setattr(triton_linear, "linear", recording)
    return calls


def test_dispatcher_routes_cpu_to_f_linear_and_forces_either(triton_calls):
    x, w, b = inputs(6, 40, 200, torch.bfloat16, True, seed=2)
    x3 = x.view(2, 3, 200)
    assert torch.equal(ops.linear(x3, w, b), F.linear(x3, w, b))  # CPU: the reference, bit for bit
    assert torch.equal(ops.linear(x3, w, b, impl="reference"), reference.linear(x3, w, b))
    assert triton_calls == []
    got = ops.linear(x3, w, b, impl="triton")  # leading dims flattened, then restored
    assert triton_calls == [(6, 200)] and got.shape == (2, 3, 40)
    assert torch.equal(got.view(6, 40), triton_linear.linear(x, w, b))
    assert ops.linear(x[0], w, b, impl="triton").shape == (40,)  # a 1-D x, as F.linear takes
    assert not ops.skinny(x, w)  # CPU tensors never take the kernel by default


def test_linear_module_is_nn_linear_with_hooks():
    torch.manual_seed(0)
    plain, ours = torch.nn.Linear(64, 40), Linear(64, 40)
    assert isinstance(ours, torch.nn.Linear) and plain.state_dict().keys() == ours.state_dict().keys()
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(3, 64)
    assert torch.equal(ours(x), plain(x))
    ours.register_forward_hook(lambda _m, _i, out: out + 1)  # bench_uva skews routing this way
    assert torch.equal(ours(x), plain(x) + 1)


# Real sizes on the GPU: Qwen3-30B-A3B's fused qkv, o_proj, router gate and lm_head, bf16.

REAL_SHAPES = [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", REAL_SHAPES, ids=["qkv", "o_proj", "router", "lm_head"])
def test_real_sizes_on_gpu(n, k):
    for m in (1, 4, 16):  # whichever path select_config picks
        x, w, b = inputs(m, n, k, torch.bfloat16, False, seed=m, device="cuda")
        y = triton_linear.linear(x, w)
        assert_close_to_exact(y, x, w, b)
        assert torch.equal(y, triton_linear.linear(x, w))
    x, w, b = inputs(2, n, k, torch.float16, True, seed=7, device="cuda")
    assert_close_to_exact(triton_linear.linear(x, w, b), x, w, b)
    x, w, b = inputs(16, n, k, torch.bfloat16, True, seed=8, device="cuda")
    assert_close_to_exact(triton_linear.linear(x, w, b, config=SMALL_TILES[1][0]), x, w, b)


@pytest.mark.gpu
def test_dispatch_rules_and_fp32_on_gpu(triton_calls):
    x, w, b = inputs(17, 128, 2048, torch.bfloat16, True, seed=3, device="cuda")
    ops.linear(x, w, b)  # 17 rows: cuBLAS
    ops.linear(x[:4].float(), w.float())  # fp32: cuBLAS
    ops.linear(x[:4], w.t().contiguous().t())  # column-major weight: cuBLAS
    ops.linear(x[:2], torch.randn(5120, 2048, device="cuda", dtype=torch.bfloat16))  # past SKINNY_MAX_MACS
    assert triton_calls == []
    ops.linear(x[:16].view(4, 4, 2048), w, b)
    ops.linear(x[:1], torch.randn(5120, 2048, device="cuda", dtype=torch.bfloat16))
    assert triton_calls == [(16, 2048), (1, 2048)]
    xf, wf, bf = x[:16].float(), w.float(), b.float()
    for config in (None, SMALL_TILES[0][0]):  # fp32 on both paths (IEEE products on tensor cores)
        assert_close_to_exact(triton_linear.linear(xf, wf, bf, config=config), xf, wf, bf)


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_inputs():
    x, w, b = inputs(4, 5120, 2048, torch.bfloat16, True, seed=4, device="cuda")
    ops.linear(x, w, b)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.linear(x, w, b)
    for seed in (1, 2):
        x.copy_(torch.randn(4, 2048, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_exact(y, x, w, b)
