"""The host channel's route split (kernels/route_split): every route goes to exactly one
channel, resident experts to the device, the host's share of the misses in rotating order;
the Triton kernel (interpreted on CPU, compiled on a GPU) equals the reference element for
element on fresh random routes, rotation and tally included."""
import pytest
import torch

from moeferry.kernels.route_split import split_routes, split_values

IMPLS = ["reference", "triton"]


@pytest.mark.parametrize("impl", IMPLS)
def test_the_host_computes_its_share_of_the_misses_and_nothing_resident(impl):
    gen = torch.Generator().manual_seed(0)
    num_experts, rotation = 32, torch.zeros(1, dtype=torch.int64)
    for step in range(20):
        slot_of = torch.where(torch.rand(num_experts, generator=gen) < 0.4, 3, -1).int()
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:4] for _ in range(5)])
        share = [0.0, 0.3, 0.5, 1.0][step % 4]
        host_ids, device_ids, host_count, _ = split_routes(ids, slot_of, split_values(share), rotation, impl=impl)
        assert torch.equal(torch.where(host_ids >= 0, host_ids, device_ids), ids)  # every route, one channel
        assert bool(((host_ids < 0) | (device_ids < 0)).all())
        host_experts = set(host_ids[host_ids >= 0].tolist())
        missed = {e for e in ids.view(-1).tolist() if slot_of[e] < 0}
        assert host_experts <= missed  # a resident expert always runs on the device
        assert len(host_experts) == int(host_count) == int(len(missed) * share + 0.5)
        assert int(rotation) == (step + 1) % num_experts


@pytest.mark.parametrize("impl", IMPLS)
def test_rotation_spreads_the_host_share_over_the_missed_experts(impl):
    num_experts = 16
    ids, slot_of = torch.arange(8).view(2, 4), torch.full((num_experts,), -1, dtype=torch.int32)
    rotation, seen = torch.zeros(1, dtype=torch.int64), set()
    for _ in range(num_experts):
        host_ids, _, _, _ = split_routes(ids, slot_of, split_values(0.25), rotation, impl=impl)
        seen |= set(host_ids[host_ids >= 0].tolist())
    assert seen == set(range(8))


@pytest.mark.parametrize("impl", IMPLS)
def test_the_fixed_cost_keeps_small_miss_counts_on_pcie(impl):
    ids, slot_of = torch.tensor([[0, 1]]), torch.full((8,), -1, dtype=torch.int32)
    host_ids, device_ids, count, _ = split_routes(ids, slot_of, split_values(0.5, 1.5),
                                                  torch.zeros(1, dtype=torch.int64), impl=impl)
    assert int(count) == 0 and bool((host_ids < 0).all()) and torch.equal(device_ids, ids)


def random_case(gen, num_tokens, num_experts, top_k, id_dtype, device="cpu"):
    slot_of = torch.where(torch.rand(num_experts, generator=gen) < 0.5, torch.randint(0, 64, (num_experts,),
                          generator=gen), -1).to(torch.int32)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).to(id_dtype)
    rotation = torch.randint(0, num_experts, (1,), generator=gen, dtype=torch.int64)
    return ids.to(device), slot_of.to(device), rotation.to(device)


def assert_same_split(ids, slot_of, rotation, share, offset):
    """The kernel against the reference: outputs (the device's weights too), the rotation and a
    tally, element for element; the device's weights are the routes' with zeros at the host's."""
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(ids.numel())).to(ids.device)
    outs, rotations, tallies = [], [], []
    for impl in IMPLS:
        r, tally = rotation.clone(), torch.full((1,), 7, dtype=torch.int64, device=ids.device)
        outs.append(split_routes(ids, slot_of, split_values(share, offset, ids.device), r, tally, weights, impl=impl))
        rotations.append(r)
        tallies.append(tally)
    for want, got in zip(outs[0], outs[1]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(rotations[0], rotations[1]) and torch.equal(tallies[0], tallies[1])
    assert int(tallies[1]) == 7 + int(outs[1][2])
    host_ids, _, _, device_weights = outs[1]
    assert torch.equal(device_weights, torch.where(host_ids >= 0, 0.0, weights))


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 128, 8), (3, 60, 4), (40, 32, 4), (70, 256, 8)])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_triton_matches_reference(num_tokens, num_experts, top_k, id_dtype):
    """(70 tokens x 8 = 560 routes: three of the kernel's route blocks, the last one partial.)"""
    gen = torch.Generator().manual_seed(num_tokens * 1000 + num_experts)
    for share, offset in [(0.55, 0.0), (0.3, 0.7), (1.0, 0.0), (0.0, 0.0)]:
        ids, slot_of, rotation = random_case(gen, num_tokens, num_experts, top_k, id_dtype)
        assert_same_split(ids, slot_of, rotation, share, offset)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 1024])
def test_triton_matches_reference_on_gpu(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    for share, offset in [(0.53, 0.4), (0.58, 0.0), (1.0, 0.0)]:
        ids, slot_of, rotation = random_case(gen, num_tokens, 128, 8, torch.int64, "cuda")
        assert_same_split(ids, slot_of, rotation, share, offset)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_new_split_written_in_place_is_the_one_read(impl):
    """The split is read from its tensor at each call (a graph's replay reads what was written
    since), and a malformed split is refused."""
    ids, slot_of = torch.arange(8).view(2, 4), torch.full((16,), -1, dtype=torch.int32)
    split = split_values(0.0)
    counts = []
    for share in (0.0, 0.5, 1.0):
        split[0] = share
        counts.append(int(split_routes(ids, slot_of, split, torch.zeros(1, dtype=torch.int64), impl=impl)[2]))
    assert counts == [0, 4, 8]
    with pytest.raises(ValueError, match="float32"):
        split_routes(ids, slot_of, split.double(), torch.zeros(1, dtype=torch.int64), impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_routes_outside_the_layer_go_to_neither_channel(impl):
    """Another rank's routes (-1) are counted nowhere and stay -1 in both outputs; the others
    split as they would alone (the same experts, so the same share)."""
    slot_of = torch.full((8,), -1, dtype=torch.int32)
    ids = torch.tensor([[0, -1, 2, -1], [-1, 3, 5, -1]])
    alone = torch.tensor([[0, 2], [3, 5]])
    split = split_values(0.5)
    host, device, count, _ = split_routes(ids, slot_of, split, torch.zeros(1, dtype=torch.int64), impl=impl)
    want_host, want_device, want_count, _ = split_routes(alone, slot_of, split, torch.zeros(1, dtype=torch.int64),
                                                      impl=impl)
    outside = ids < 0
    assert bool((host[outside] == -1).all()) and bool((device[outside] == -1).all())
    assert torch.equal(host[~outside], want_host.reshape(-1)) and torch.equal(device[~outside], want_device.reshape(-1))
    assert int(count) == int(want_count) == 2
