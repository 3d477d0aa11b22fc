"""Admission kernel (Triton, interpreted on CPU) against its plain-torch reference.

Both start from the same state and must leave bit-identical maps, plans, slot ids and
counters after every call. The behaviour itself is checked against an independent Python
model in tests/moe/test_slot_cache.py.
"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from moeferry.kernels.admission import (POLICIES, AdmissionCounters, AdmissionTuning, DecayPowers,
                                        SlotState, reference)
from moeferry.kernels.admission.triton import _threshold_key

STATE_FIELDS = ("slot_of", "owner_of", "last_used", "score", "clock",
                "plan_src", "plan_dst", "plan_count", "ahead_src", "ahead_dst", "ahead_count")


def triton_admit():
    from moeferry.kernels.admission import triton as admission
    return admission.admit


def new_counters(num_layers, num_experts, device="cpu", with_freq=True):
    zeros = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=device)  # noqa: E731
    return AdmissionCounters(zeros(num_layers), zeros(num_layers), zeros(num_layers),
                             zeros(num_layers, num_experts) if with_freq else None)


def twin_states(num_layers, num_experts, num_slots, max_routes, policy, decay=0.5,
                device="cpu"):
    return tuple(SlotState.allocate(num_layers, num_experts, num_slots, max_routes, device,
                                    policy, decay) for _ in range(2))


def assert_same_state(expected: SlotState, actual: SlotState, context=""):
    for name in STATE_FIELDS:
        a, b = getattr(expected, name), getattr(actual, name)
        assert torch.equal(a, b), f"{context}: {name} differs\n{a}\n{b}"


def assert_same_counters(expected, actual, context=""):
    for name, a, b in zip(AdmissionCounters._fields, expected, actual):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b), f"{context}: counter {name} differs"


def run_both(ref_state, tri_state, layer, ids, ref_counters=None, tri_counters=None,
             tuning=AdmissionTuning()):
    ref_out = reference.admit(ref_state, layer, ids, ref_counters).clone()
    tri_out = triton_admit()(tri_state, layer, ids, tri_counters, tuning).clone()
    assert tri_out.shape == ids.shape and tri_out.dtype == torch.int32
    assert torch.equal(ref_out, tri_out), f"slot ids differ\n{ref_out}\n{tri_out}"
    return ref_out


def random_routes(rng, num_experts, width, hot=None, dtype=torch.int64):
    """Routes with duplicates; ``hot`` restricts them to a subset to provoke hits."""
    pool = hot if hot is not None else np.arange(num_experts)
    return torch.from_numpy(rng.choice(pool, size=width)).to(dtype)


@pytest.mark.parametrize("policy", ["lru", "lrfu", "layer_lru"])
@pytest.mark.parametrize("seed, max_block, extract_max", [(0, 4096, 16), (1, 4096, 0),
                                                         (2, 16, 16)])
def test_kernel_matches_reference_on_random_sequences(policy, seed, max_block, extract_max,
                                                      device):
    """Every path of the kernel: max_block 4096, every pool is one block, keys in registers,
    victims by repeated minimum up to ``extract_max`` misses and by radix select past it;
    16: pools of up to 57 slots in several blocks, keys through the key buffer."""
    tuning = AdmissionTuning(max_block_s=max_block, extract_max=extract_max)
    rng = np.random.default_rng(seed)
    num_layers, num_experts, num_slots = 3, int(rng.integers(6, 20)), 0
    num_slots = num_experts + int(rng.integers(0, 2 * num_experts))
    ref_state, tri_state = twin_states(num_layers, num_experts, num_slots, 96, policy, 0.8, device)
    ref_counters, tri_counters = (new_counters(num_layers, num_experts, device) for _ in range(2))
    for step in range(14):
        layer = int(rng.integers(num_layers))
        hot = rng.choice(num_experts, size=int(rng.integers(1, num_experts + 1)), replace=False)
        ids = random_routes(rng, num_experts, int(rng.integers(1, 96)), hot,
                            dtype=torch.int32 if step % 2 else torch.int64).to(device)
        run_both(ref_state, tri_state, layer, ids, ref_counters, tri_counters, tuning)
        assert_same_state(ref_state, tri_state, f"step {step}")
        assert_same_counters(ref_counters, tri_counters, f"step {step}")
    assert int(ref_counters.misses.sum()) > 0 and int(ref_state.clock) == 14


def test_out_of_range_routes_are_ignored_and_get_no_slot(device):
    ref_state, tri_state = twin_states(1, 8, 8, 32, "lru", device=device)
    ref_counters, tri_counters = new_counters(1, 8, device), new_counters(1, 8, device)
    ids = torch.tensor([[3, -1], [8, 3], [5, 100]], device=device)
    out = run_both(ref_state, tri_state, 0, ids, ref_counters, tri_counters)
    assert out.tolist() == [[0, -1], [-1, 0], [1, -1]]
    assert_same_state(ref_state, tri_state)
    assert_same_counters(ref_counters, tri_counters)
    assert ref_counters.freq.sum().item() == 3 and ref_counters.distinct.item() == 2


def test_single_route_and_counters_without_histogram(device):
    ref_state, tri_state = twin_states(2, 4, 5, 8, "lru", device=device)
    ref_counters, tri_counters = (new_counters(2, 4, device, with_freq=False) for _ in range(2))
    for layer, expert in [(0, 1), (1, 1), (0, 1), (1, 3), (0, 0)]:
        run_both(ref_state, tri_state, layer, torch.tensor([expert], device=device), ref_counters, tri_counters)
        assert_same_state(ref_state, tri_state)
    assert_same_counters(ref_counters, tri_counters)
    assert ref_counters.calls.tolist() == [3, 2] and ref_counters.misses.tolist() == [2, 2]


def test_calls_without_counters_leave_maps_identical(device):
    ref_state, tri_state = twin_states(2, 10, 12, 64, "lrfu", 0.9, device)
    rng = np.random.default_rng(7)
    for step in range(6):
        ids = random_routes(rng, 10, 40).to(device)
        run_both(ref_state, tri_state, step % 2, ids)
        assert_same_state(ref_state, tri_state, f"step {step}")


@pytest.mark.parametrize("policy", ["lru", "layer_lru"])
@pytest.mark.parametrize("fast_path", [True, False])
def test_all_hit_calls_without_statistics(policy, fast_path, device):
    """LRU policies without statistics try a one-pass admission that commits only when
    every route hits. It must leave what the full path leaves; that it ran shows in the
    scratch mark array, which only the full path writes."""
    tuning = AdmissionTuning(all_hits_fast_path=fast_path)
    rng = np.random.default_rng(11)
    ref_state, tri_state = twin_states(3, 12, 20, 64, policy, device=device)
    hot = [rng.choice(12, size=5, replace=False) for _ in range(3)]  # 15 of the 20 slots
    short_path_calls = 0
    for step in range(24):
        layer = step % 3
        ids = random_routes(rng, 12, int(rng.integers(5, 40)), hot[layer]).to(device)
        if step % 4 == 3:
            ids[-1] = int(rng.integers(12))  # now and then another expert: a miss
        if step % 5 == 4:
            ids[0] = -1 if step % 2 else 12  # ignored routes take either path
        marks = tri_state.expert_mark.clone()
        all_hit = bool((ref_state.slot_of[layer, ids[(ids >= 0) & (ids < 12)]] >= 0).all())
        run_both(ref_state, tri_state, layer, ids, tuning=tuning)
        assert_same_state(ref_state, tri_state, f"step {step}")
        took_short_path = torch.equal(marks, tri_state.expert_mark)
        assert took_short_path == (fast_path and all_hit), f"step {step}"
        short_path_calls += took_short_path
    assert short_path_calls >= (8 if fast_path else 0)
    assert int((ref_state.owner_of >= 0).sum()) == 20  # full: later misses evicted


def full_cache(num_layers, num_experts, num_slots, policy, rng, device="cpu"):
    """Twin states whose every slot is taken, with random recency (ties included) and,
    for LRFU, random scores: admissions into it must evict."""
    states = twin_states(num_layers, num_experts, num_slots, 8192, policy, 0.97, device)
    owners = torch.from_numpy(rng.permutation(num_layers * num_experts)[:num_slots]).to(device)
    last_used = torch.from_numpy(rng.integers(1, 400, size=num_slots)).to(device)
    score = torch.from_numpy(rng.uniform(1.0, 30.0, size=num_slots).astype(np.float32)).to(device)
    for state in states:
        state.owner_of.copy_(owners.to(torch.int32))
        state.slot_of.view(-1)[owners] = torch.arange(num_slots, dtype=torch.int32, device=device)
        state.last_used.copy_(last_used)
        state.score.copy_(score if policy == "lrfu" else torch.zeros_like(score))
        state.clock.fill_(400)
    return states


@pytest.mark.parametrize("policy", ["lru", "lrfu", "layer_lru"])
def test_wide_calls_over_a_32768_slot_cache(policy, device):
    rng = np.random.default_rng(11)
    num_layers, num_experts, num_slots = 66, 512, 32768
    ref_state, tri_state = full_cache(num_layers, num_experts, num_slots, policy, rng, device)
    ref_counters, tri_counters = (new_counters(num_layers, num_experts, device) for _ in range(2))
    for layer, width in [(0, 4096), (5, 8192), (0, 8192)]:
        ids = random_routes(rng, num_experts, width).to(device)
        out = run_both(ref_state, tri_state, layer, ids, ref_counters, tri_counters)
        assert_same_state(ref_state, tri_state, f"layer {layer} width {width}")
        assert (out >= 0).all()
        assert torch.equal(ref_state.owner_of[out.long()], (layer * num_experts + ids).int())
    assert_same_counters(ref_counters, tri_counters)
    assert ref_counters.misses.sum() > 0 and ref_counters.calls.sum() == 3


def test_cold_cache_wide_call_fills_free_slots_in_order(device):
    ref_state, tri_state = twin_states(2, 64, 32768, 8192, "lru", device=device)
    ids = torch.arange(64, device=device).repeat(128)  # 8192 routes, 64 distinct
    out = run_both(ref_state, tri_state, 1, ids)
    assert_same_state(ref_state, tri_state)
    assert torch.equal(out, ids.int())
    assert ref_state.plan_count.item() == 64


def test_layers_wider_than_one_expert_block(device):
    """E = 1100 spans two expert chunks, S two slot chunks; a second layer must evict."""
    rng = np.random.default_rng(5)
    ref_state, tri_state = twin_states(2, 1100, 1150, 4096, "lru", device=device)
    ref_counters, tri_counters = (new_counters(2, 1100, device) for _ in range(2))
    for layer, width in [(0, 3000), (1, 2500), (0, 40)]:
        ids = random_routes(rng, 1100, width).to(device)
        run_both(ref_state, tri_state, layer, ids, ref_counters, tri_counters)
        assert_same_state(ref_state, tri_state, f"layer {layer}")
    assert_same_counters(ref_counters, tri_counters)
    assert int(ref_state.plan_count) > 0 and int((ref_state.owner_of >= 1100).sum()) > 0


def test_the_plan_is_one_buffer_of_count_sources_destinations(device):
    """The copy engine stages `plan` in one copy: the admission's count, sources and
    destinations are its words 0, 1..P and P+1..2P, in both implementations."""
    ref_state, tri_state = twin_states(2, 8, 12, 16, "lru", device=device)
    run_both(ref_state, tri_state, 1, torch.tensor([3, 5, 7], device=device))
    for state in (ref_state, tri_state):
        plan, size = state.plan, state.plan_src.numel()
        assert plan.numel() == 1 + 2 * size and int(plan[0]) == 3
        assert torch.equal(plan[1:4], torch.tensor([3, 5, 7], dtype=torch.int32, device=device))
        assert torch.equal(plan[1 + size:4 + size], state.plan_dst[:3])


def test_empty_call_only_advances_the_clock(device):
    ref_state, tri_state = twin_states(1, 4, 4, 8, "lrfu", device=device)
    run_both(ref_state, tri_state, 0, torch.tensor([2, 3], device=device))
    run_both(ref_state, tri_state, 0, torch.zeros(0, dtype=torch.int64, device=device))
    assert_same_state(ref_state, tri_state)
    assert int(ref_state.clock) == 2 and int(ref_state.plan_count) == 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_lookahead_admissions_match_the_reference(policy, seed, device):
    """Each call routes a layer, then a lookahead admits the next layer's predicted experts
    beside it, as a decode step with prefetch does; both kernels keep identical state."""
    rng = np.random.default_rng(seed)
    num_layers, num_experts = 4, int(rng.integers(8, 20))
    num_slots = 2 * num_experts + int(rng.integers(0, num_experts))
    ref_state, tri_state = twin_states(num_layers, num_experts, num_slots, 64, policy, 0.8, device)
    ref_counters, tri_counters = (new_counters(num_layers, num_experts, device) for _ in range(2))
    for step in range(12):
        layer = step % num_layers
        ids = random_routes(rng, num_experts, int(rng.integers(1, 24))).to(device)
        run_both(ref_state, tri_state, layer, ids, ref_counters, tri_counters)
        predicted = random_routes(rng, num_experts, int(rng.integers(1, 24))).to(device)
        for admit, state in ((reference.admit, ref_state), (triton_admit(), tri_state)):
            assert admit(state, (layer + 1) % num_layers, predicted, ahead=True) is None
        assert_same_state(ref_state, tri_state, f"step {step}")
        assert_same_counters(ref_counters, tri_counters, f"step {step}")
    assert int(ref_state.clock) == 12


@pytest.mark.parametrize("admit", ["reference", "triton"])
def test_lookahead_keeps_the_routed_layer_and_turns_the_next_layers_routes_into_hits(admit, device):
    """The clock stays, the last call's slot ids and experts stay put, the predicted experts
    land in free or evicted slots of other layers, and the next layer's own admission of
    them copies nothing."""
    admit = reference.admit if admit == "reference" else triton_admit()
    num_experts, num_slots = 8, 12
    state = SlotState.allocate(3, num_experts, num_slots, 16, device, "layer_lru")
    admit(state, 2, torch.arange(8, device=device))  # an older layer fills 8 slots
    routed = torch.tensor([0, 1, 2, 3], device=device)
    slot_ids = admit(state, 0, routed).clone()
    before = state.slot_of[0].clone()
    admit(state, 1, torch.tensor([4, 5, 6, 7], device=device), ahead=True)
    assert int(state.clock) == 2 and int(state.ahead_count) == 4
    assert torch.equal(state.slot_ids[:4], slot_ids) and torch.equal(state.slot_of[0], before)
    assert bool((state.slot_of[1, 4:] >= 0).all())
    assert set(state.ahead_dst[:4].tolist()).isdisjoint(slot_ids.tolist())
    admit(state, 1, torch.tensor([4, 5, 6, 7], device=device))
    assert int(state.plan_count) == 0 and int(state.clock) == 3


def test_too_many_routes_is_refused(device):
    state = SlotState.allocate(1, 4, 4, 16, device)
    for admit in (reference.admit, triton_admit()):
        with pytest.raises(ValueError, match="max_routes"):
            admit(state, 0, torch.zeros(17, dtype=torch.int64, device=device))
        with pytest.raises(ValueError, match="layer"):
            admit(state, 1, torch.zeros(2, dtype=torch.int64, device=device))


@triton.jit
def _threshold_probe(key_ptr, num_slots, args_ptr, out_ptr, RADIX: tl.constexpr,
                     RADIX_BITS: tl.constexpr, BLOCK_S: tl.constexpr,
                     KEYS_IN_REGISTERS: tl.constexpr):
    lo, hi = tl.load(args_ptr), tl.load(args_ptr + 1)  # int64, as in the kernel
    num_misses = tl.load(args_ptr + 2).to(tl.int32)
    s = tl.arange(0, BLOCK_S)
    keys = tl.load(key_ptr + s, mask=s < num_slots, other=2 ** 63 - 1)  # the first block
    threshold, below = _threshold_key(key_ptr, keys, num_slots, lo, hi, num_misses, RADIX,
                                      RADIX_BITS, BLOCK_S, KEYS_IN_REGISTERS)
    tl.store(out_ptr, threshold)
    tl.store(out_ptr + 1, below.to(tl.int64))


KEY_NONE = 2 ** 63 - 1


def search_keys(rng, kind, n):
    """int64 slot keys of one distribution; about a tenth are not candidates (KEY_NONE)."""
    if kind == "all_equal":
        keys = np.full(n, 7)
    elif kind == "heavy_ties":
        keys = rng.integers(0, 5, size=n)
    elif kind == "clock":  # LRU / LAYER_LRU-like: free slots at 0, recency up to 2 * now
        keys = np.where(rng.random(n) < 0.05, 0, rng.integers(1, 4200, size=n))
    elif kind == "float_bits":  # LRFU-like
        keys = rng.uniform(0.0, 30.0, size=n).astype(np.float32).view(np.int32) + 1
    elif kind == "clusters":  # most keys tiny, a few near 2**62
        keys = np.where(rng.random(n) < 0.8, rng.integers(0, 9, size=n),
                        2 ** 62 - rng.integers(0, 3, size=n))
    else:  # "huge": anywhere in [0, 2**62]
        keys = rng.integers(0, 2 ** 62, size=n, endpoint=True)
    keys = keys.astype(np.int64)
    keys[rng.random(n) < 0.1] = KEY_NONE
    keys[rng.integers(n)] = min(keys.min(), 2 ** 62)  # at least one candidate
    return keys


@pytest.mark.parametrize("num_slots, radix_bits, block", [
    (1, 8, 16), (37, 8, 64), (37, 8, 16), (37, 2, 64), (37, 3, 32), (2100, 8, 4096),
    (2100, 5, 1024)])
def test_threshold_search_finds_the_mth_smallest_key(num_slots, radix_bits, block, device):
    """_threshold_key alone against a sort: T = M-th smallest candidate key, and #{key < T},
    over spans from 0 to 2**62, ties at T, blocks not dividing the slot count; with the keys
    read from memory at every sweep, and (where one block holds them) from registers."""
    rng = np.random.default_rng(num_slots * 10 + radix_bits)
    out = torch.zeros(2, dtype=torch.int64, device=device)
    for kind in ("all_equal", "heavy_ties", "clock", "float_bits", "clusters", "huge"):
        keys = search_keys(rng, kind, num_slots)
        candidates = np.sort(keys[keys != KEY_NONE])
        num_candidates = len(candidates)
        picks = {1, num_candidates // 2, num_candidates - 1, num_candidates}
        picks |= set(rng.integers(1, num_candidates, size=1, endpoint=True).tolist())
        for num_misses in sorted(m for m in picks if 1 <= m <= num_candidates):
            args = torch.tensor([keys.min(), candidates[-1], num_misses], device=device)
            threshold = int(candidates[num_misses - 1])
            expected = [threshold, int((keys < threshold).sum())]
            for in_registers in {False, num_slots <= block}:
                out.fill_(-1)
                _threshold_probe[(1,)](torch.from_numpy(keys).to(device), num_slots, args, out,
                                       RADIX=1 << radix_bits, RADIX_BITS=radix_bits,
                                       BLOCK_S=block, KEYS_IN_REGISTERS=in_registers)
                assert out.tolist() == expected, f"{kind}, M={num_misses}, {in_registers}"


def spread_cache(num_layers, num_experts, num_slots, policy, rng, clock, device="cpu"):
    """Twin states, mostly full, a few free slots; recency spread over ``clock`` calls with
    ties; LRFU scores spread too. Every slot is a candidate of the next call."""
    states = twin_states(num_layers, num_experts, num_slots, 512, policy, 0.999, device)
    owners = rng.permutation(num_layers * num_experts)[:num_slots]
    owners[rng.random(num_slots) < 0.03] = -1
    stamps = rng.integers(0, clock, size=num_slots // 3 + 1)  # about 3 slots per stamp
    last_used = np.where(owners >= 0, rng.choice(stamps, size=num_slots), -1)
    score = np.where(owners >= 0, rng.uniform(1.0, 40.0, size=num_slots), 0.0)
    for state in states:
        state.owner_of.copy_(torch.from_numpy(owners).to(torch.int32))
        held = torch.from_numpy(owners[owners >= 0]).to(device)
        state.slot_of.view(-1)[held] = torch.from_numpy(
            np.flatnonzero(owners >= 0)).to(torch.int32).to(device)
        state.last_used.copy_(torch.from_numpy(last_used))
        state.score.copy_(torch.from_numpy(score.astype(np.float32)) if policy == "lrfu"
                          else torch.zeros(num_slots))
        state.clock.fill_(clock)
    return states


def candidate_key_span(state, layer):
    now = int(state.clock) + 1
    keys = reference._slot_keys(state, layer, now)[state.last_used != now]
    return int(keys.max() - keys.min())


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_layers, num_experts, num_slots", [(3, 30, 37), (100, 64, 2100)])
def test_victim_search_over_wide_key_ranges(policy, num_layers, num_experts, num_slots,
                                            device):
    """Misses into caches whose keys span thousands of calls (and, after clock jumps written
    into both states, beyond 2**34, and past 2**57, where packing a key with its slot in 63
    bits no longer fits and the radix path takes over from the repeated minimum): maps and
    plans bit-identical after every call."""
    rng = np.random.default_rng(num_slots)
    ref_state, tri_state = spread_cache(num_layers, num_experts, num_slots, policy, rng,
                                        clock=3000, device=device)
    spans, num_misses = [], 0
    for step, jump in enumerate([0, 1, 2500, 0, 7, 2 ** 34, 3, 0, 40000, 1, 2 ** 57, 2]):
        for state in (ref_state, tri_state):
            state.clock.add_(jump)
        layer = int(rng.integers(num_layers))
        spans.append(candidate_key_span(ref_state, layer))
        ids = random_routes(rng, num_experts, int(rng.integers(num_experts // 2, 3 * num_experts)))
        run_both(ref_state, tri_state, layer, ids.to(device))
        assert_same_state(ref_state, tri_state, f"step {step}")
        num_misses += int(ref_state.plan_count)
    assert num_misses >= 3 * num_experts
    assert max(spans) >= (2 ** 30 if policy == "lrfu" else 2 ** 34)  # 4+ sweeps


@pytest.mark.parametrize("decay", [0.5, 0.9, 0.999, 1.0])
def test_decay_powers_follow_float32_squaring(decay):
    powers = DecayPowers.build(decay, "cpu")
    dt = torch.tensor([0, 1, 2, 3, 7, 100, 1000, 10**6, 2**40])
    got = reference.decay_pow(dt, powers)
    for d, value in zip(dt.tolist(), got.tolist()):
        expected, square = np.float32(1.0), np.float32(decay)
        while d:
            if d & 1:
                expected = np.float32(expected * square)
            square, d = np.float32(square * square), d >> 1
        assert np.float32(value) == expected
    with pytest.raises(ValueError):
        DecayPowers.build(0.0, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lrfu", "layer_lru"])
@pytest.mark.parametrize("num_slots", [2100, 32768])
@pytest.mark.parametrize("wide_warps, stats", [(8, True), (16, True), (16, False), (32, True)])
def test_kernel_matches_reference_at_real_sizes_on_gpu(policy, num_slots, wide_warps, stats):
    """Widths 10 to 4,100 routes; calls over one block of routes with 8, 16 and 32 warps
    (AdmissionTuning.num_warps_wide); without statistics the LRU policies try the all-hits
    pass first."""
    tuning = AdmissionTuning(num_warps_wide=wide_warps)
    rng = np.random.default_rng(3)
    num_layers, num_experts = 48, 512
    ref_state, tri_state = twin_states(num_layers, num_experts, num_slots, 8192, policy,
                                       0.9, "cuda")
    ref_counters, tri_counters = ((new_counters(num_layers, num_experts, "cuda") if stats else None)
                                  for _ in range(2))
    for step, width in enumerate([10, 40, 120, 130, 320, 1280, 2560, 4100] * 8):
        layer = step % num_layers
        hot = rng.choice(num_experts, size=int(rng.integers(16, num_experts)), replace=False)
        ids = random_routes(rng, num_experts, width, hot).cuda()
        run_both(ref_state, tri_state, layer, ids, ref_counters, tri_counters, tuning)
        assert_same_state(ref_state, tri_state, f"step {step} width {width}")
    if stats:
        assert_same_counters(ref_counters, tri_counters)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_lookahead_matches_the_reference_at_real_sizes_on_gpu(policy):
    """A 48-layer cache of 128 experts at 25%: each decode call followed by the next layer's
    lookahead, batch 1 and 4 of top-8, as the engine issues them."""
    rng = np.random.default_rng(4)
    num_layers, num_experts, num_slots = 48, 128, 1536
    ref_state, tri_state = twin_states(num_layers, num_experts, num_slots, 8192, policy, 0.9, "cuda")
    for step in range(4 * num_layers):
        layer, width = step % num_layers, 8 * (1 if step < 2 * num_layers else 4)
        hot = rng.choice(num_experts, size=48, replace=False)
        run_both(ref_state, tri_state, layer, random_routes(rng, num_experts, width, hot).cuda())
        predicted = random_routes(rng, num_experts, width, hot).cuda()
        reference.admit(ref_state, (layer + 1) % num_layers, predicted, ahead=True)
        triton_admit()(tri_state, (layer + 1) % num_layers, predicted, ahead=True)
        assert_same_state(ref_state, tri_state, f"step {step}")
