"""SlotCache against an independent plain-Python model of LRU, LRFU and LAYER_LRU, the
cyclic-layer thrash that LAYER_LRU avoids, the wide-step
scenario of background/pr-wide-decode-admission.txt, statistics, and (GPU) graph capture.

The model below uses dicts, lists and numpy float32 scalars only; it follows the documented
semantics (kernels/admission/reference.py), not the torch code.
"""
import numpy as np
import pytest
import torch

from moeferry.moe.slot_cache import SlotCache


class PyCache:
    """The cache as the spec states it: LRU by (last_used, slot), LRFU by (decayed score,
    slot) with free slots first; LAYER_LRU free slots, then the admitting layer's by
    (last_used, slot), then other layers' by (-last_used, slot); misses in ascending id
    take the candidates in order."""

    def __init__(self, num_layers, num_experts, num_slots, policy, decay):
        self.num_experts, self.policy, self.decay = num_experts, policy, np.float32(decay)
        self.slot_of = {}  # (layer, expert) -> slot
        self.owner = [None] * num_slots
        self.last = [-1] * num_slots
        self.score = [np.float32(0.0)] * num_slots
        self.clock = 0
        self.evicted = {"own": 0, "other": 0}  # evictions by the victim's layer

    def decay_pow(self, dt):
        result, square = np.float32(1.0), self.decay
        while dt:
            if dt & 1:
                result = np.float32(result * square)
            square, dt = np.float32(square * square), dt >> 1
        return result

    def fill(self, num_layers):
        """The warm start: layers' experts in order into consecutive slots, never used."""
        slot = 0
        for layer in range(num_layers):
            for e in range(self.num_experts):
                if slot == len(self.owner):
                    return
                self.owner[slot], self.slot_of[(layer, e)] = (layer, e), slot
                slot += 1

    def sort_key(self, slot, layer):
        if self.owner[slot] is None or self.last[slot] == -1:  # free, or filled and unused
            return (0, 0.0, slot)
        if self.policy == "lru":
            return (1, self.last[slot], slot)
        if self.policy == "layer_lru":
            if self.owner[slot][0] == layer:
                return (1, self.last[slot], slot)
            return (2, -self.last[slot], slot)
        decayed = np.float32(self.score[slot] * self.decay_pow(self.clock - self.last[slot]))
        return (1, float(decayed), slot)

    def admit(self, layer, routes):
        self.clock += 1
        distinct = sorted({e for e in routes if 0 <= e < self.num_experts})
        misses = [e for e in distinct if (layer, e) not in self.slot_of]
        used = set()
        for e in distinct:
            if (layer, e) in self.slot_of:
                slot = self.slot_of[(layer, e)]
                used.add(slot)
                if self.policy == "lrfu":
                    decayed = np.float32(self.score[slot] * self.decay_pow(self.clock - self.last[slot]))
                    self.score[slot] = np.float32(decayed + np.float32(1.0))
                self.last[slot] = self.clock
        candidates = sorted((s for s in range(len(self.owner)) if s not in used), key=lambda s: self.sort_key(s, layer))
        victims = candidates[:len(misses)]
        for e, slot in zip(misses, victims):
            if self.owner[slot] is not None:
                self.evicted["own" if self.owner[slot][0] == layer else "other"] += 1
                del self.slot_of[self.owner[slot]]
            self.owner[slot] = (layer, e)
            self.slot_of[(layer, e)] = slot
            self.last[slot], self.score[slot] = self.clock, np.float32(1.0)
        slot_ids = [self.slot_of.get((layer, e), -1) for e in routes]
        return slot_ids, misses, victims, len(distinct)


def encoded_banks(num_layers, num_experts, device="cpu"):
    """Host banks per layer whose rows say which (layer, expert) they belong to (exactly
    in int32; modulo 256 in bf16 and 251 in uint8), pinned when ``device`` is CUDA."""
    banks = []
    for layer in range(num_layers):
        tag = torch.arange(num_experts) + layer * num_experts + 1
        banks.append([
            (tag[:, None] * 3 + torch.arange(5)).to(torch.int32),
            (tag % 256)[:, None, None].expand(num_experts, 2, 3).to(torch.bfloat16).contiguous(),
            (tag % 251).to(torch.uint8)[:, None].repeat(1, 7),
        ])
    pin = torch.device(device).type == "cuda"
    return [[b.pin_memory() if pin else b for b in layer_banks] for layer_banks in banks]


def slot_banks(host_banks, num_slots, device="cpu"):
    return [torch.full((num_slots, *b.shape[1:]), -7, dtype=torch.int32).to(b.dtype).to(device)
            for b in host_banks[0]]


def assert_matches_model(cache: SlotCache, model: PyCache, context):
    E = cache.num_experts
    slot_of = torch.full((cache.num_layers, E), -1, dtype=torch.int32)
    for (layer, e), slot in model.slot_of.items():
        slot_of[layer, e] = slot
    owner_of = torch.tensor([-1 if o is None else o[0] * E + o[1] for o in model.owner], dtype=torch.int32)
    assert torch.equal(cache.slot_of.cpu(), slot_of), context
    assert torch.equal(cache.owner_of.cpu(), owner_of), context
    assert cache.last_used.cpu().tolist() == model.last, context
    if model.policy == "lrfu":
        assert np.array_equal(cache.score.cpu().numpy(), np.array(model.score, dtype=np.float32)), context
    assert int(cache.clock) == model.clock


def assert_slots_hold_their_owners(cache, host_banks, banks):
    E = cache.num_experts
    for slot, owner in enumerate(cache.owner_of.tolist()):
        if owner >= 0:
            for pool, source in zip(banks, host_banks[owner // E]):
                assert torch.equal(pool[slot].cpu(), source[owner % E].cpu()), f"slot {slot} owner {owner}"


def run_against_model(impl, policy, seed, steps, device, layers=(1, 4), warm=False):
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(*layers))
    num_experts = int(rng.integers(4, 25))
    num_slots = int(rng.integers(max(8, num_experts), 41))
    cache = SlotCache(num_layers, num_experts, num_slots, eviction_policy=policy, lrfu_decay=0.75,
                      max_routes=64, impl=impl, device=device)
    model = PyCache(num_layers, num_experts, num_slots, policy, 0.75)
    host = encoded_banks(num_layers, num_experts, device)
    banks = slot_banks(host, num_slots, device)
    if warm:
        assert cache.fill(host, banks) == min(num_slots, num_layers * num_experts)
        model.fill(num_layers)
        assert_matches_model(cache, model, f"seed {seed} after fill")
        assert_slots_hold_their_owners(cache, host, banks)
    total_misses = 0
    for step in range(steps):
        layer = int(rng.integers(num_layers))
        hot = rng.choice(num_experts, size=int(rng.integers(1, num_experts + 1)), replace=False)
        routes = rng.choice(hot, size=int(rng.integers(1, 65))).tolist()
        out = cache.admit(layer, torch.tensor(routes, device=device))
        expected, misses, victims, num_distinct = model.admit(layer, routes)
        context = f"seed {seed} step {step}"
        count = int(cache.plan_count)
        assert out.tolist() == expected, context
        assert cache.plan_src[:count].tolist() == misses, context
        assert cache.plan_dst[:count].tolist() == victims, context
        assert_matches_model(cache, model, context)
        cache.copy_misses(host[layer], banks)
        assert_slots_hold_their_owners(cache, host, banks)
        total_misses += len(misses)
    snap = cache.stats.snapshot()["decode"]["total"]
    assert snap["misses"] == total_misses and snap["calls"] == steps
    return model


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
@pytest.mark.parametrize("seed", range(6))
def test_reference_path_follows_the_python_model(policy, seed):
    run_against_model(impl="reference", policy=policy, seed=seed, steps=40, device="cpu")


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
@pytest.mark.parametrize("seed", range(2))
def test_triton_path_follows_the_python_model(policy, seed, device):
    run_against_model(impl="triton", policy=policy, seed=100 + seed, steps=18, device=device)


def test_reference_layer_lru_follows_the_python_model():
    """Several layers, random routes: both kinds of eviction (a layer's own slots, other
    layers' slots) happen, and every step matches the model."""
    evicted = {"own": 0, "other": 0}
    for seed in range(8):
        model = run_against_model(impl="reference", policy="layer_lru", seed=200 + seed,
                                  steps=40, device="cpu", layers=(2, 5))
        for kind, count in model.evicted.items():
            evicted[kind] += count
    assert evicted["own"] > 0 and evicted["other"] > 0, evicted


@pytest.mark.parametrize("seed", range(2))
def test_triton_layer_lru_follows_the_python_model(seed, device):
    model = run_against_model(impl="triton", policy="layer_lru", seed=301 + seed,
                              steps=24, device=device, layers=(2, 5))
    assert model.evicted["own"] > 0 and model.evicted["other"] > 0, model.evicted


@pytest.mark.parametrize("policy", ["lru", "lrfu", "layer_lru"])
def test_from_a_warm_start_the_reference_follows_the_python_model(policy):
    """Filled slots rank like free ones until used: a warm start never keeps an expert it
    guessed over one in use (the model's sort key says so independently)."""
    for seed in range(4):
        run_against_model(impl="reference", policy=policy, seed=400 + seed, steps=30, device="cpu",
                          layers=(2, 5), warm=True)


@pytest.mark.parametrize("policy", ["lru", "layer_lru"])
def test_from_a_warm_start_the_triton_path_follows_the_python_model(policy, device):
    run_against_model(impl="triton", policy=policy, seed=500, steps=14, device=device, layers=(2, 5),
                      warm=True)


def test_a_warm_expert_never_used_is_evicted_before_one_in_use():
    cache = SlotCache(2, 4, 6, eviction_policy="layer_lru", impl="reference")
    host = encoded_banks(2, 4)
    banks = slot_banks(host, 6)
    cache.fill(host, banks)  # slots 0-3: layer 0's experts, 4-5: layer 1's experts 0 and 1
    cache.admit(1, torch.tensor([0]))  # layer 1's expert 0 (slot 4) is now in use
    assert cache.admit(0, torch.tensor([0])).tolist() == [0]  # a hit on a warm slot
    # layer 1 misses expert 3: the first never-used slot goes (slot 1: layer 0's expert 1),
    # not slot 4 nor slot 0, both in use
    assert cache.admit(1, torch.tensor([3])).tolist() == [1]
    assert cache.slot_of[0, 1] == -1 and cache.slot_of[1, 0] == 4 and cache.slot_of[0, 0] == 0


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_layer_lru_takes_own_lru_slots_then_other_layers_mru_slots(impl, device):
    device = device if impl == "triton" else "cpu"
    cache = SlotCache(3, 4, 6, eviction_policy="layer_lru", max_routes=8, impl=impl,
                      device=device)
    admit = lambda layer, ids: cache.admit(layer, torch.tensor(ids, device=device)).tolist()  # noqa: E731
    assert admit(0, [0, 1]) == [0, 1]  # free slots first, in index order
    assert admit(1, [0, 1]) == [2, 3]
    assert admit(2, [0, 1]) == [4, 5]
    # layer 0's own slots are hits: its misses take other layers' most recent slots
    # (layer 2's, clock 3), not the least recent (layer 1's, clock 2) that LRU would take
    assert admit(0, [0, 1, 2, 3]) == [0, 1, 4, 5]
    # layer 1 hits expert 1 (slot 3); its miss takes its own idle slot 2 (expert 0)
    assert admit(1, [3, 1]) == [2, 3]
    # layer 2 owns nothing: the most recent other slots are layer 1's (clock 5), by index
    assert admit(2, [2]) == [2]
    # layer 1, three misses: its own slot 3 (clock 5) first, then other layers' by
    # descending clock: slot 2 (layer 2, clock 6), then slot 0 (layer 0, clock 4, lowest index)
    assert admit(1, [0, 2, 3]) == [3, 2, 0]
    assert cache.owner_of.tolist() == [4 + 3, 1, 4 + 2, 4 + 0, 2, 3]
    assert cache.plan_dst[:3].tolist() == [3, 2, 0]


THRASH_LAYERS, THRASH_EXPERTS, THRASH_SLOTS = 4, 8, 16


def thrash_routes(layer):
    """Layer ``layer``'s fixed working set, 6 of its 8 experts, each routed twice."""
    return [(layer + j) % THRASH_EXPERTS for j in range(6)] * 2


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_layer_lru_stops_the_cyclic_thrash_of_lru(impl, device):
    """Every step admits the 4 layers in order, each with the same 6 experts: a working set
    of 24 over 16 slots. LRU always evicts the layer admitted next and never hits after the
    first step; LAYER_LRU settles, from the second step on, into a 3-step cycle of 16, 14
    and 10 hits out of 24 (40 of 72: 5/9) that the model predicts exactly."""
    device = device if impl == "triton" else "cpu"
    for policy, expected_hits in (("lru", 0), ("layer_lru", 80)):
        cache = SlotCache(THRASH_LAYERS, THRASH_EXPERTS, THRASH_SLOTS, eviction_policy=policy,
                          max_routes=16, impl=impl, device=device)
        model = PyCache(THRASH_LAYERS, THRASH_EXPERTS, THRASH_SLOTS, policy, 0.5)
        model_hits = []
        for step in range(7):  # one warm-up step, then two periods of LAYER_LRU's cycle
            if step == 1:
                cache.stats.reset()
            hits = 0
            for layer in range(THRASH_LAYERS):
                routes = thrash_routes(layer)
                out = cache.admit(layer, torch.tensor(routes, device=device))
                expected, misses, _, num_distinct = model.admit(layer, routes)
                assert out.tolist() == expected, (policy, step, layer)
                hits += num_distinct - len(misses)
            model_hits.append(hits)
        assert_matches_model(cache, model, policy)
        total = cache.stats.snapshot()["decode"]["total"]
        assert total["distinct"] == 6 * 24 and total["calls"] == 6 * THRASH_LAYERS
        assert total["distinct"] - total["misses"] == sum(model_hits[1:]) == expected_hits
        if policy == "lru":
            assert model_hits == [0] * 7 and total["hit_rate"] == 0.0
        else:
            assert model_hits == [0, 16, 14, 10, 16, 14, 10]
            assert total["hit_rate"] == pytest.approx(5 / 9) and total["hit_rate"] >= 0.4


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_wide_decode_step_admits_all_its_experts_in_one_call(impl, device):
    """background PR: 150 rows route 300 times to all 160 experts, 7 already resident."""
    device = device if impl == "triton" else "cpu"
    cache = SlotCache(2, 160, 200, max_routes=512, impl=impl, device=device)
    host = encoded_banks(2, 160, device)
    banks = slot_banks(host, 200, device)
    resident = torch.tensor([3, 17, 40, 41, 99, 120, 159], device=device)
    cache.load_experts(0, resident, host[0], banks, phase="prefill")  # kept out of decode stats
    routes = torch.cat([torch.arange(160), torch.randperm(160, generator=torch.Generator().manual_seed(1))[:140]])
    topk = routes[torch.randperm(300, generator=torch.Generator().manual_seed(2))].view(150, 2).to(device)
    slot_ids = cache.load_experts(0, topk, host[0], banks)
    assert slot_ids.shape == (150, 2)
    assert torch.equal(cache.owner_of[slot_ids.long()], topk.int())  # layer 0: flat id == e
    assert torch.equal(cache.slot_of[0][topk], slot_ids)
    assert (cache.slot_of[0] >= 0).all()
    decode = cache.stats.snapshot()["decode"]
    assert decode["per_layer"]["distinct"] == [160, 0]
    assert decode["per_layer"]["misses"] == [153, 0]
    assert decode["per_layer"]["calls"] == [1, 0]
    freq = cache.stats.decode_freq[0]
    assert freq.sum() == 300 and torch.equal(freq, torch.bincount(topk.flatten(), minlength=160))
    assert cache.stats.snapshot()["prefill"]["per_layer"]["misses"] == [7, 0]
    assert_slots_hold_their_owners(cache, host, banks)

    narrow = torch.tensor([5, 150, 3, 77, 5, 12, 150, 0], device=device)  # an 8-route step: one admission
    slot_ids = cache.load_experts(1, narrow, host[1], banks)
    assert torch.equal(cache.owner_of[slot_ids.long()], (160 + narrow).int())
    assert cache.stats.snapshot()["decode"]["per_layer"]["calls"] == [1, 1]
    assert slot_ids[0] == slot_ids[4] and slot_ids[1] == slot_ids[6]
    assert_slot_maps_are_inverse(cache)
    assert_slots_hold_their_owners(cache, host, banks)


def assert_slot_maps_are_inverse(cache):
    owner_of = cache.owner_of.long()
    flat = cache.slot_of.view(-1)
    occupied = torch.nonzero(owner_of >= 0).flatten()
    assert torch.equal(flat[owner_of[occupied]].long(), occupied)
    resident = torch.nonzero(flat >= 0).flatten()
    assert torch.equal(owner_of[flat[resident].long()], resident)


def test_cache_smaller_than_a_layer_is_refused():
    with pytest.raises(ValueError, match=r"63 slots.*64 experts"):
        SlotCache(2, 64, 63)


def test_bad_arguments_are_refused():
    cache = SlotCache(1, 8, 8, max_routes=16)
    with pytest.raises(ValueError, match="phase"):
        cache.admit(0, torch.tensor([1]), phase="warmup")
    with pytest.raises(ValueError, match="max_routes"):
        cache.admit(0, torch.zeros(17, dtype=torch.long))
    with pytest.raises(ValueError, match="policy"):
        SlotCache(1, 8, 8, eviction_policy="fifo")
    with pytest.raises(ValueError, match="lrfu_decay"):
        SlotCache(1, 8, 8, eviction_policy="lrfu", lrfu_decay=1.5)


def test_snapshot_is_plain_python_and_counts_bytes():
    cache = SlotCache(2, 8, 10)
    host = encoded_banks(2, 8)
    banks = slot_banks(host, 10)
    cache.load_experts(1, torch.tensor([1, 2, 2]), host[1], banks)
    cache.load_experts(1, torch.tensor([2, 3]), host[1], banks)
    snap = cache.stats.snapshot()
    expert_bytes = 5 * 4 + 6 * 2 + 7
    assert snap["expert_bytes"] == expert_bytes
    assert snap["decode"]["per_layer"]["bytes_copied"] == [0, 3 * expert_bytes]
    assert snap["decode"]["total"] == {"calls": 2, "distinct": 4, "misses": 3,
                                       "bytes_copied": 3 * expert_bytes, "hit_rate": 0.25}
    assert "freq" in snap["decode"] and "freq" not in snap["prefill"]
    import json
    json.dumps(snap)
    cache.reset()
    assert cache.stats.snapshot()["decode"]["total"]["calls"] == 0
    assert (cache.slot_of == -1).all() and int(cache.clock) == 0


def test_state_is_updated_in_place():
    cache = SlotCache(2, 8, 9, eviction_policy="lrfu")
    pointers = [t.data_ptr() for t in (cache.slot_of, cache.owner_of, cache.last_used,
                                       cache.score, cache.clock, cache.plan_src)]
    for step in range(5):
        cache.admit(step % 2, torch.randint(0, 8, (12,)))
    cache.reset()
    assert pointers == [t.data_ptr() for t in (cache.slot_of, cache.owner_of, cache.last_used,
                                               cache.score, cache.clock, cache.plan_src)]


# -- GPU: real sizes, graph capture, pinned memory ----------------------------------------

def _gpu_layer_routes(rng, num_layers, num_experts, requests, hot_size):
    hot = [rng.choice(num_experts, size=hot_size, replace=False) for _ in range(num_layers)]
    return [torch.from_numpy(rng.choice(h, size=(requests, 10))).cuda() for h in hot]


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lrfu"])
def test_48_admissions_and_copies_replay_as_one_cuda_graph(policy):
    rng = np.random.default_rng(0)
    num_layers, num_experts, num_slots = 48, 64, 700
    host = [[b.pin_memory() for b in layer] for layer in encoded_banks(num_layers, num_experts)]
    eager, graphed = (SlotCache(num_layers, num_experts, num_slots, device="cuda", eviction_policy=policy)
                      for _ in range(2))
    eager_banks, graph_banks = slot_banks(host, num_slots, "cuda"), slot_banks(host, num_slots, "cuda")
    static_routes = [torch.zeros(13, 10, dtype=torch.long, device="cuda") for _ in range(num_layers)]
    graph_out = [None] * num_layers
    for layer in range(num_layers):  # warm-up compiles every kernel before capture
        graphed.load_experts(layer, static_routes[layer], host[layer], graph_banks)
    torch.cuda.synchronize()
    graphed.reset()
    for graph_bank, pristine in zip(graph_banks, eager_banks):
        graph_bank.copy_(pristine)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(num_layers):
            graph_out[layer] = graphed.load_experts(layer, static_routes[layer], host[layer], graph_banks)
    for step in range(4):
        routes = _gpu_layer_routes(rng, num_layers, num_experts, 13, 20)
        expected = []
        for layer in range(num_layers):
            expected.append(eager.load_experts(layer, routes[layer], host[layer], eager_banks).clone())
            static_routes[layer].copy_(routes[layer])
        graph.replay()
        torch.cuda.synchronize()
        for name in ("slot_of", "owner_of", "last_used", "score", "clock"):
            assert torch.equal(getattr(eager, name), getattr(graphed, name)), (step, name)
        for a, b in zip(eager_banks, graph_banks):
            assert torch.equal(a, b)
    assert_slots_hold_their_owners(graphed, [[b.cuda() for b in layer] for layer in host], graph_banks)
    # slot ids of the last layer (its buffer is shared, so only the last call survives)
    assert torch.equal(graph_out[-1], expected[-1])


def test_statistics_switch_on_and_off_with_fresh_counters():
    from moeferry.moe.slot_cache import SlotCache

    cache = SlotCache(2, 4, 8, collect_stats=False, expert_bytes=100)
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    cache.admit(0, ids)
    assert cache.stats is None
    cache.set_statistics(True)
    cache.admit(1, ids)
    snap = cache.stats.snapshot()
    assert snap["decode"]["total"]["misses"] == 2 and snap["expert_bytes"] == 100
    cache.set_statistics(False)
    assert cache.stats is None
