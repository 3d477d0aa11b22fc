"""kernels/generated_routes: the Triton draw and forcing against the plain-torch reference,
bit for bit (the hash is integer arithmetic, the Gumbel the same float32 logs), at ragged sizes,
with and without the keep draw, over strided views as RouteGenerator passes them."""
import pytest
import torch

from moeferry.kernels.generated_routes import FORCED_OFF, draw_routes, force_logits, oracle_predict

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def inputs(layers, rows, experts, k, seed, max_rows=None):
    g = torch.Generator().manual_seed(seed)
    max_rows = max_rows or rows
    fixed = torch.randn(layers, rows, experts, generator=g) * 1.5
    gumbel_keys = torch.randint(0, 2**32, (layers, rows, experts), generator=g)
    keep_keys = torch.randint(0, 2**32, (layers, rows, k), generator=g)
    previous = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(layers * max_rows)])
    return fixed, gumbel_keys, keep_keys, previous.view(layers, max_rows, k)


@pytest.mark.parametrize("layers,rows,experts,k", [(3, 5, 128, 8), (2, 3, 60, 4), (1, 1, 8, 8), (4, 2, 33, 1)])
@pytest.mark.parametrize("keep", [0.0, 0.15, 0.9])
def test_the_draw_matches_the_reference(layers, rows, experts, k, keep):
    fixed, gumbel_keys, keep_keys, previous = inputs(layers, rows, experts, k, seed=experts + k)
    step = torch.tensor([123456789], dtype=torch.int64)
    want, got = previous.clone(), previous.clone()
    for _ in range(3):  # each draw keeps from the last
        draw_routes(fixed, gumbel_keys, keep_keys, step, want, keep, impl="reference")
        draw_routes(fixed, gumbel_keys, keep_keys, step, got, keep, impl="triton")
        assert torch.equal(got, want)
        step += 7919
    assert all(len(set(r)) == k for r in got.view(-1, k).tolist())


def test_a_view_of_the_first_rows_is_rewritten_in_place_and_nothing_else():
    """RouteGenerator's call: routes[a:b, :rows] of a [L, max_rows, K] buffer."""
    fixed, gumbel_keys, keep_keys, routes = inputs(4, 3, 64, 6, seed=1, max_rows=8)
    step = torch.tensor([42], dtype=torch.int64)
    want, got = routes.clone(), routes.clone()
    draw_routes(fixed[1:3], gumbel_keys[1:3], keep_keys[1:3], step, want[1:3, :3], 0.5, impl="reference")
    draw_routes(fixed[1:3], gumbel_keys[1:3], keep_keys[1:3], step, got[1:3, :3], 0.5, impl="triton")
    assert torch.equal(got, want)
    assert torch.equal(got[0], routes[0]) and torch.equal(got[1:3, 3:], routes[1:3, 3:])
    assert not torch.equal(got[1:3, :3], routes[1:3, :3])


def test_kept_experts_are_chosen_and_ordered_by_their_own_scores():
    fixed, gumbel_keys, keep_keys, routes = inputs(1, 1, 32, 4, seed=2)
    fixed[0, 0] = torch.arange(32, dtype=torch.float32) * 100  # expert 31 best, by far
    previous = routes.clone()
    draw_routes(fixed, gumbel_keys, keep_keys, torch.tensor([5]), routes, 1.0, impl="triton")
    assert set(routes[0, 0].tolist()) == set(previous[0, 0].tolist())  # keep 1: the previous routes, all kept
    order = routes[0, 0].tolist()
    assert order == sorted(order, reverse=True)  # ordered by the fixed scores, not the bonus


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forcing_keeps_the_logits_at_the_ids_only(dtype):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(40, generator=g)[:6] for _ in range(5)])
    want = force_logits(logits, ids, impl="reference")
    got = force_logits(logits, ids, impl="triton")
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(got.gather(1, ids), logits.gather(1, ids))
    assert (got == torch.tensor(FORCED_OFF, dtype=dtype)).sum() == 5 * (40 - 6)


@pytest.mark.gpu
def test_the_draw_on_the_gpu_matches_the_reference_there():
    """At a 48-layer Qwen3-30B-A3B shape, eight rows, twenty draws: Triton's logs are CUDA's
    (libdevice), so the routes are the torch reference's on the same GPU."""
    fixed, gumbel_keys, keep_keys, routes = (t.cuda() for t in inputs(48, 8, 128, 8, seed=4))
    step = torch.tensor([99], dtype=torch.int64, device="cuda")
    want, got = routes.clone(), routes.clone()
    for _ in range(20):
        draw_routes(fixed, gumbel_keys, keep_keys, step, want, 0.15, impl="reference")
        draw_routes(fixed, gumbel_keys, keep_keys, step, got, 0.15)
        assert torch.equal(got, want)
        step += 1


@pytest.mark.parametrize("layers,rows,experts,k,width", [(3, 4, 128, 8, 8), (2, 5, 40, 4, 9), (1, 2, 16, 2, 14)])
@pytest.mark.parametrize("recall", [0.0, 0.8, 1.0])
def test_the_oracle_matches_the_reference(layers, rows, experts, k, width, recall):
    _, wrong_keys, keep_keys, true_ids = inputs(layers, rows, experts, k, seed=width)
    step = torch.tensor([77], dtype=torch.int64)
    want = oracle_predict(wrong_keys, keep_keys, step, true_ids, recall, width, impl="reference")
    got = oracle_predict(wrong_keys, keep_keys, step, true_ids, recall, width, impl="triton")
    assert torch.equal(got, want)
    if recall == 1.0:  # every true id kept, first, in its order
        assert torch.equal(got[..., :k], true_ids)
    if recall == 0.0:  # none
        assert not (got[..., :, None] == true_ids[..., None, :]).any()
