"""Staged copies: the Triton kernel (interpreted on CPU) against `copy_`, element for element,
with integer narrowing and pairs of different lengths in one launch; on a GPU, both directions
between device and pinned host memory, eagerly and replayed in a CUDA graph."""
import pytest
import torch

from moeferry.kernels.host_staging import MAX_PAIRS, reference, staged_copy


def _random(shape, dtype, gen, device="cpu"):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype).to(device)
    return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(dtype).to(device)


PAIRS = [  # (shape, source dtype, destination dtype): the host channel's x, ids, weights; a long one
    ((3, 2048), torch.bfloat16, torch.bfloat16),
    ((3, 8), torch.int64, torch.int32),
    ((3, 8), torch.float32, torch.float32),
    ((5, 700), torch.float32, torch.float32),
]


@pytest.mark.parametrize("chosen", [[0, 1, 2], [3], [1, 3]])
def test_triton_matches_copy(chosen):
    from moeferry.kernels.host_staging import triton as triton_staging

    gen = torch.Generator().manual_seed(len(chosen))
    sources = [_random(PAIRS[i][0], PAIRS[i][1], gen) for i in chosen]
    got = [torch.full(PAIRS[i][0], 7, dtype=PAIRS[i][2]) for i in chosen]
    want = [torch.full(PAIRS[i][0], 7, dtype=PAIRS[i][2]) for i in chosen]
    triton_staging.staged_copy(list(zip(sources, got)))
    reference.staged_copy(list(zip(sources, want)))
    for g, w, s in zip(got, want, sources):
        assert torch.equal(g, w) and torch.equal(g, s.to(g.dtype))


def test_bad_pairs_are_refused():
    a, b = torch.zeros(4), torch.zeros(5)
    with pytest.raises(ValueError, match="4 source elements for 5"):
        staged_copy([(a, b)])
    with pytest.raises(ValueError, match=f"1 to {MAX_PAIRS} pairs"):
        staged_copy([(a, a.clone())] * (MAX_PAIRS + 1))
    with pytest.raises(ValueError, match="not converted"):
        staged_copy([(a, a.to(torch.bfloat16))])
    with pytest.raises(ValueError, match="contiguous"):
        staged_copy([(torch.zeros(4, 4).t(), torch.zeros(4, 4))])


@pytest.mark.gpu
def test_device_and_pinned_host_both_ways_and_in_a_graph():
    gen = torch.Generator().manual_seed(0)
    sources = [_random(shape, src, gen, "cuda") for shape, src, _ in PAIRS[:3]]
    staged = [torch.empty(shape, dtype=dst, pin_memory=True) for shape, _, dst in PAIRS[:3]]
    back = [torch.empty(shape, dtype=dst, device="cuda") for shape, _, dst in PAIRS[:3]]
    staged_copy(list(zip(sources, staged)))  # device -> pinned host
    staged_copy(list(zip(staged, back)))  # pinned host -> device
    torch.cuda.synchronize()
    for s, h, b in zip(sources, staged, back):
        assert torch.equal(h, s.cpu().to(h.dtype)) and torch.equal(b, h.cuda())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        staged_copy(list(zip(sources, staged)))
        staged_copy(list(zip(staged, back)))
    for s in sources:
        s.copy_(_random(s.shape, s.dtype, gen, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    for s, h, b in zip(sources, staged, back):
        assert torch.equal(h, s.cpu().to(h.dtype)) and torch.equal(b, s.to(b.dtype))
