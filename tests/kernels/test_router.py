"""The MoE router: the reference equals MoEBlock's original arithmetic bit for bit (the CPU path
the HF parity tests run), and the Triton kernel (interpreted on CPU) picks the same experts in
the same order with weights within an ulp or so, for odd expert counts, strided logits, output
buffers poisoned with NaN/-1, ties (lowest index first) and -inf logits."""
import pytest
import torch

from moeferry.kernels import router as ops
from moeferry.kernels.router import reference
from moeferry.kernels.router.triton import MAX_EXPERTS

TOKENS = [1, 3, 16, 33]
DTYPES = [torch.float32, torch.bfloat16]
# Weight tolerance, in ulps of the logits' dtype. The kernel's fp32 probabilities differ from
# torch's by the order of the row sum and the last bits of exp (torch's CPU softmax is itself
# up to ~7 fp32 ulps from the exact value; the kernel up to ~4): so fp32 weights agree to a
# few fp32 ulps, not one. bf16 weights are both rounded from those fp32 values, so they are
# equal unless the two straddle a bf16 rounding boundary: then one bf16 ulp apart.
ULPS = {torch.float32: 8, torch.bfloat16: 1}


def original_softmax_topk(logits, top_k, renormalize):
    """MoEBlock's inline router before the kernel, verbatim: the fixed point."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype).float(), ids.to(torch.int32)


def distinct_logits(t, e, dtype, generator, device="cpu"):
    """[t, e] normal logits, all distinct within a row after the cast to dtype: torch.topk's
    order among ties is its own (not lowest index first), so only tie-free rows can be compared
    id for id. Distinct bf16 logits are far apart next to fp32 rounding, so their
    probabilities cannot collapse into a tie either."""
    rows = []
    for _ in range(t):
        pool = torch.randn(4 * e, generator=generator).to(dtype).unique()
        assert pool.numel() >= e
        rows.append(pool[torch.randperm(pool.numel(), generator=generator)[:e]])
    return torch.stack(rows).to(device)


def ulps(a, b, dtype):
    """Distance in ulps of dtype between fp32 tensors of non-negative values (whose bit patterns
    are ordered like the values); bf16 values are the top 16 bits of their fp32 pattern."""
    d = (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()
    return d >> 16 if dtype == torch.bfloat16 else d


def assert_weights_close(got, expected, dtype):
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert not got.isnan().any()
    assert torch.equal(got, got.to(dtype).float())  # rounded through the logits' dtype
    assert ulps(got, expected, dtype).max() <= ULPS[dtype]


def assert_tie_consistent(weights, ids, logits, top_k, renormalize):
    """ids are the logits' stable descending order (ties to the lowest index); the reference
    picks experts of the same logits (in its own order among ties), with the same weights."""
    order = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(ids.long(), order)
    ref_weights, ref_ids = reference.softmax_topk(logits, top_k, renormalize)
    assert torch.equal(logits.gather(1, ref_ids.long()), logits.gather(1, ids.long()))
    assert_weights_close(weights, ref_weights, logits.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_reference_is_the_original_bit_for_bit(dtype, renormalize):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(17, 60, generator=g).to(dtype)  # ties included: same torch.topk
    expected = original_softmax_topk(logits, 4, renormalize)
    for got in (reference.softmax_topk(logits, 4, renormalize),
                ops.softmax_topk(logits, 4, renormalize),  # CPU dispatch
                reference.softmax_topk(logits, 4, renormalize, weights_out=torch.empty(17, 4),
                                       ids_out=torch.empty(17, 4, dtype=torch.int32))):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize("experts", [8, 60, 128, 160])
def test_kernel_matches_reference(experts, top_k, renormalize, dtype):
    g = torch.Generator().manual_seed(experts * 10 + top_k)

    def check(logits, outputs):
        ref_weights, ref_ids = reference.softmax_topk(logits, top_k, renormalize)
        weights, ids = ops.softmax_topk(logits, top_k, renormalize, impl="triton", **outputs)
        if outputs:
            assert weights is outputs["weights_out"] and ids is outputs["ids_out"]
        assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
        assert_weights_close(weights, ref_weights, dtype)

    for t in TOKENS:
        logits = distinct_logits(t, experts, dtype, g)
        check(logits, {"weights_out": torch.full((t, top_k), float("nan")),
                       "ids_out": torch.full((t, top_k), -1, dtype=torch.int32)})
    wide = torch.full((5, experts + 7), float("nan"), dtype=dtype)
    wide[:, 3:experts + 3] = distinct_logits(5, experts, dtype, g)
    check(wide[:, 3:experts + 3], {})  # strided rows; the NaNs around them are never read
    check(distinct_logits(5, experts, dtype, g).t().contiguous().t(), {})  # column-major: copied first


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_lowest_index(dtype):
    logits = torch.tensor([[1., 3, 3, 0, 3, 2, 3, 3]], dtype=dtype)
    weights, ids = ops.softmax_topk(logits, 5, False, impl="triton")
    assert ids.tolist() == [[1, 2, 4, 6, 7]]
    assert (weights[0, :] == weights[0, 0]).all()
    # A tie across the k-th place keeps the lowest indices.
    assert ops.softmax_topk(logits, 2, True, impl="triton")[1].tolist() == [[1, 2]]
    flat = torch.zeros(3, 160, dtype=dtype)
    weights, ids = ops.softmax_topk(flat, 8, True, impl="triton")
    assert ids.tolist() == [list(range(8))] * 3 and (weights == 0.125).all()
    # Natural ties of bf16 logits: the order the kernel promises, the reference's values.
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(16, 128, generator=g).to(dtype).mul(4).round()  # many exact ties
    for renormalize in (True, False):
        assert_tie_consistent(*ops.softmax_topk(logits, 8, renormalize, impl="triton"), logits, 8, renormalize)


def test_minus_infinity_logits_are_chosen_last_once_each():
    inf = float("inf")
    logits = torch.tensor([[-inf, 0.0, -inf, 1.0, -inf]])
    weights, ids = ops.softmax_topk(logits, 4, False, impl="triton")
    assert ids.tolist() == [[3, 1, 0, 2]]  # each -inf expert taken once, lowest index first
    expected = torch.softmax(logits, -1)[0, [3, 1]]
    assert ulps(weights[0, :2], expected, torch.float32).max() <= ULPS[torch.float32]
    assert weights[0, 2:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_output_element_is_written(dtype):
    g = torch.Generator().manual_seed(3)
    logits = distinct_logits(5, 60, dtype, g)
    weights_out = torch.full((5, 4), float("nan"))
    ids_out = torch.full((5, 4), -1, dtype=torch.int32)
    weights, ids = ops.softmax_topk(logits, 4, True, weights_out=weights_out, ids_out=ids_out, impl="triton")
    assert weights is weights_out and ids is ids_out
    assert not weights.isnan().any() and (ids >= 0).all() and (ids < 60).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(5), rtol=0, atol=2e-2)
    ref_weights, ref_ids = reference.softmax_topk(logits, 4, True)
    assert torch.equal(ids, ref_ids)
    assert_weights_close(weights, ref_weights, dtype)


@pytest.mark.parametrize("experts,dtype", [(512, torch.bfloat16), (MAX_EXPERTS, torch.float32)])
def test_wide_rows(experts, dtype):  # (bf16 has too few distinct normal values for 4096 experts)
    g = torch.Generator().manual_seed(experts)
    logits = distinct_logits(2, experts, dtype, g)
    weights, ids = ops.softmax_topk(logits, 8, True, impl="triton")
    ref_weights, ref_ids = reference.softmax_topk(logits, 8, True)
    assert torch.equal(ids, ref_ids)
    assert_weights_close(weights, ref_weights, dtype)


def test_empty_batch_and_refused_arguments():
    weights, ids = ops.softmax_topk(torch.empty(0, 8), 2, True, impl="triton")
    assert weights.shape == (0, 2) and ids.shape == (0, 2)
    x = torch.randn(3, 8)
    refused = [  # (logits, top_k, output buffers)
        (torch.randn(1, MAX_EXPERTS + 1), 2, {}),
        (x, 9, {}),
        (x, 0, {}),
        (torch.randn(2, 3, 8), 2, {}),
        (x.double(), 2, {}),
        (x, 2, {"weights_out": torch.empty(3, 2, dtype=torch.bfloat16)}),
        (x, 2, {"ids_out": torch.empty(3, 2, dtype=torch.int64)}),
        (x, 2, {"ids_out": torch.empty(2, 3, dtype=torch.int32).t()}),
    ]
    for logits, top_k, outputs in refused:
        with pytest.raises(ValueError):
            ops.softmax_topk(logits, top_k, True, impl="triton", **outputs)


# Real sizes on the GPU (Qwen3-30B-A3B: 128 experts, top 8, bf16 logits with natural ties).

@pytest.mark.gpu
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("t", [1, 2, 7, 16, 64, 256])
def test_real_sizes_on_gpu(t, renormalize):
    g = torch.Generator().manual_seed(t)
    logits = torch.randn(t, 128, generator=g).to("cuda", torch.bfloat16)
    weights, ids = ops.softmax_topk(logits, 8, renormalize)  # Triton: the tensor is on CUDA
    assert_tie_consistent(weights, ids, logits, 8, renormalize)
    tie_free = distinct_logits(t, 128, torch.bfloat16, g, device="cuda")
    weights, ids = ops.softmax_topk(tie_free, 8, renormalize)
    ref_weights, ref_ids = reference.softmax_topk(tie_free, 8, renormalize)
    assert torch.equal(ids, ref_ids)
    assert_weights_close(weights, ref_weights, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16])
def test_cuda_graph_replays_with_new_logits(t):
    logits = torch.zeros(t, 128, dtype=torch.bfloat16, device="cuda")
    weights = torch.empty(t, 8, device="cuda")
    ids = torch.empty(t, 8, dtype=torch.int32, device="cuda")
    ops.softmax_topk(logits, 8, True, weights_out=weights, ids_out=ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.softmax_topk(logits, 8, True, weights_out=weights, ids_out=ids)
    for seed in (1, 2):
        logits.copy_(torch.randn(t, 128, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert_tie_consistent(weights, ids, logits, 8, True)
