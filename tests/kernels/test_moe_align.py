"""moe_align_block_size: every route lands once in a block of its expert, at any expert count.

The Triton kernel runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py) and must equal the
reference exactly; both are checked against the contract directly, not only each other."""
import pytest
import torch

from moeferry.kernels.moe_align import moe_align_block_size
from moeferry.kernels.moe_align import padded_route_capacity

IMPLS = ("reference", "triton")


def _random_ids(num_tokens, top_k, num_experts, dtype=torch.int64, seed=0):
    """Router-like ids: distinct experts per token, drawn from a hot subset so groups share."""
    gen = torch.Generator().manual_seed(seed)
    hot = torch.randperm(num_experts, generator=gen)[: max(top_k, min(num_experts, 3 * top_k))]
    scores = torch.rand(num_tokens, hot.numel(), generator=gen)
    return hot[scores.topk(top_k, dim=1).indices].to(dtype)


def check_alignment(topk_ids, block_size, num_experts, result):
    """Assert the full contract of moe_align_block_size on one result."""
    sorted_route_ids, block_expert, num_post_padded = result
    flat = topk_ids.reshape(-1).long()
    num_routes = flat.numel()
    capacity = padded_route_capacity(num_routes, num_experts, block_size)
    assert sorted_route_ids.dtype == block_expert.dtype == num_post_padded.dtype == torch.int32
    assert sorted_route_ids.shape == (capacity,)
    assert block_expert.shape == (capacity // block_size,)
    assert num_post_padded.shape == (1,)

    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    total = int(num_post_padded.item())
    assert total == int(padded.sum()) and total % block_size == 0 and total <= capacity
    assert (sorted_route_ids[total:] == num_routes).all()
    assert (block_expert[total // block_size:] == -1).all()

    # Group by group, ascending expert: the routes of e in ascending order, then sentinels.
    expected = []
    expected_blocks = []
    for expert in torch.nonzero(counts).flatten().tolist():
        routes = torch.nonzero(flat == expert).flatten().tolist()
        expected += routes + [num_routes] * (int(padded[expert]) - len(routes))
        expected_blocks += [expert] * (int(padded[expert]) // block_size)
    assert sorted_route_ids[:total].tolist() == expected
    assert block_expert[: total // block_size].tolist() == expected_blocks
    # Each route exactly once, each in a block of its own expert.
    real = sorted_route_ids[:total].long()
    in_block = torch.arange(total) // block_size
    is_route = real < num_routes
    assert torch.equal(real[is_route].sort().values, torch.arange(num_routes))
    assert torch.equal(flat[real[is_route]], block_expert[in_block[is_route]].long())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_experts", [8, 1023, 1024, 2100, 4096])
def test_every_route_lands_once_in_a_block_of_its_expert(impl, num_experts):
    topk_ids = _random_ids(37, 4, num_experts, seed=num_experts)
    for block_size in (16, 5):
        result = moe_align_block_size(topk_ids, block_size, num_experts,
                                          impl=impl)
        check_alignment(topk_ids, block_size, num_experts, result)


@pytest.mark.parametrize("num_experts", [8, 1023, 1024, 2100, 4096, 32768])
def test_triton_equals_reference_exactly(num_experts):
    for dtype in (torch.int32, torch.int64):
        # Uniform ids over all experts as well, so high expert ids are exercised.
        gen = torch.Generator().manual_seed(num_experts)
        uniform = torch.randint(0, num_experts, (23, 3), generator=gen, dtype=dtype)
        for topk_ids in (_random_ids(19, 6, num_experts, dtype, seed=1), uniform):
            ref = moe_align_block_size(topk_ids, 16, num_experts, impl="reference")
            tri = moe_align_block_size(topk_ids, 16, num_experts, impl="triton")
            for got, want in zip(tri, ref):
                assert torch.equal(got, want)


def test_slot_ids_of_a_32768_slot_cache_align_in_triton():
    topk_ids = _random_ids(9, 8, 32768, seed=7)
    topk_ids[0, 0] = 32767  # the last slot
    check_alignment(topk_ids, 16, 32768,
                    moe_align_block_size(topk_ids, 16, 32768, impl="triton"))


@pytest.mark.parametrize("num_experts", [8, 2100])
def test_groups_spanning_several_route_chunks_stay_ascending(num_experts):
    """More routes than one ROUTE_CHUNK (1024): ranks carry across chunks."""
    topk_ids = _random_ids(330, 8, num_experts, seed=3)
    result = moe_align_block_size(topk_ids, 16, num_experts, impl="triton")
    check_alignment(topk_ids, 16, num_experts, result)
    ref = moe_align_block_size(topk_ids, 16, num_experts, impl="reference")
    assert all(torch.equal(got, want) for got, want in zip(result, ref))


def test_capacity_follows_routes_not_expert_count():
    assert padded_route_capacity(8, 32768, 16) == 8 * 16
    assert padded_route_capacity(8, 2, 16) == 48  # 8 routes + 2 groups' padding -> 3 blocks
    assert padded_route_capacity(100, 4, 16) == 160  # 100 + 4 * 15, whole blocks


@pytest.mark.parametrize("impl", IMPLS)
def test_no_routes_gives_empty_blocks(impl):
    topk_ids = torch.empty(0, 8, dtype=torch.int64)
    sorted_route_ids, block_expert, total = moe_align_block_size(
        topk_ids, 16, 128, impl=impl)
    assert sorted_route_ids.numel() == 0 and block_expert.numel() == 0 and total.item() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts", [128, 1023, 1024, 2100, 32768])
@pytest.mark.parametrize("num_tokens", [1, 64, 8192])
def test_triton_align_on_gpu_equals_reference(num_experts, num_tokens):
    topk_ids = _random_ids(num_tokens, 8, num_experts, seed=num_tokens).cuda()
    tri = moe_align_block_size(topk_ids, 64, num_experts)
    ref = moe_align_block_size(topk_ids.cpu(), 64, num_experts)
    for got, want in zip(tri, ref):
        assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_triton_align_is_graph_capturable():
    topk_ids = _random_ids(64, 8, 2100, seed=5).cuda()
    moe_align_block_size(topk_ids, 16, 2100)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_align_block_size(topk_ids, 16, 2100)
    topk_ids.copy_(_random_ids(64, 8, 2100, seed=6).cuda())
    graph.replay()
    want = moe_align_block_size(topk_ids.cpu(), 16, 2100)
    for got, expected in zip(captured, want):
        assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_max_groups_bounds_the_blocks_over_a_wide_id_range(impl):
    """A layer's 16 experts mapped onto rows of a 2,100-row pool: blocks for 16 groups, not
    2,100, and the same alignment as without the bound (its prefix)."""
    rows = torch.randperm(2100, generator=torch.Generator().manual_seed(5))[:16]
    topk_ids = rows[_random_ids(40, 4, 16, seed=6)].to(torch.int32)
    bounded = moe_align_block_size(topk_ids, 8, 2100, 16, impl=impl)
    assert bounded[0].shape == (padded_route_capacity(160, 2100, 8, 16),) == (160 + 16 * 7,)
    wide = moe_align_block_size(topk_ids, 8, 2100, impl=impl)
    total = int(bounded[2])
    assert torch.equal(bounded[2], wide[2])
    assert torch.equal(bounded[0][:total], wide[0][:total]) and (bounded[0][total:] == 160).all()
    assert torch.equal(bounded[1], wide[1][:bounded[1].numel()]) and (wide[1][bounded[1].numel():] == -1).all()
    if impl == "reference":
        with pytest.raises(ValueError, match="max_groups"):
            moe_align_block_size(topk_ids, 8, 2100, len(torch.unique(topk_ids)) - 1, impl=impl)
