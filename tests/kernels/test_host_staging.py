"""Staged copies: the Triton kernel (interpreted on CPU) against `copy_`, element for element,
with integer narrowing and pairs of different lengths in one launch; on a GPU, both directions
between device and pinned host memory, eagerly and replayed in a CUDA graph."""
import pytest
import torch

from moeferry.kernels.host_staging import MAX_PAIRS, reference, staged_copy, staged_routes


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


@pytest.mark.parametrize("rows, hidden", [(8, 2048), (6, 700), (1, 5)])
@pytest.mark.parametrize("keep", [False, True])
def test_routes_triton_matches_reference_and_reads_only_the_routed_rows(rows, hidden, keep):
    """The routed rows copied; the others zeros, or with `keep` the destination's own."""
    from moeferry.kernels.host_staging import triton as triton_staging

    gen = torch.Generator().manual_seed(rows)
    src = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.randint(-1, 3, (rows,), generator=gen)
    ids[0] = -1
    got, want = torch.full_like(src, 7), torch.full_like(src, 7)
    triton_staging.staged_routes(src, got, ids, keep)
    reference.staged_routes(src, want, ids, keep)
    routed = (ids >= 0).unsqueeze(-1)
    assert torch.equal(got, want) and torch.equal(got, torch.where(routed, src, 7 if keep else 0))
    assert bool((got[0] == 7).all()) if keep else not got[0].any()


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
    with pytest.raises(ValueError, match="src, dst"):
        staged_routes(torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="one floating dtype"):
        staged_routes(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int64))


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
    ids = torch.tensor([2, -1, 0], device="cuda")
    routes = torch.full_like(sources[0], 7)
    staged_routes(staged[0], routes, ids)
    torch.cuda.synchronize()
    assert torch.equal(routes, torch.where(ids.unsqueeze(-1) >= 0, sources[0], 0))
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
