"""Batched sampling: the reference against an independent sort-based oracle (chi-square over
seeded draws, penalties by hand, greedy rows against argmax), and the Triton kernel
(interpreted on CPU at small sizes; on the GPU at real sizes) against the reference token for
token, with the same uniforms bit for bit."""
import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

from moeferry.kernels import sampling
from moeferry.kernels.sampling import SamplingState
from moeferry.kernels.sampling import reference
from moeferry.kernels.sampling import triton as sampling_triton
from moeferry.kernels.sampling.reference import COLUMNS

NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def single_threaded_torch():
    """These tensors are small: intra-op threads would only add their wake-up latency (about
    16 ms an op on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def copy_state(state: SamplingState) -> SamplingState:
    return SamplingState(**{f.name: getattr(state, f.name).clone() for f in dataclasses.fields(state)})


def run_both(logits, row_slot, positions, state, block=sampling_triton._BLOCK):
    """(reference outputs, Triton outputs, reference state, Triton state) from copies of state."""
    ref_state, tri_state = copy_state(state), copy_state(state)
    expected = reference.sample(logits, row_slot, positions, ref_state)
    got = sampling_triton.sample(logits, row_slot, positions, tri_state, block=block)
    return expected, got, ref_state, tri_state


def assert_same_sampling(expected, got, ref_state, tri_state, row_slot):
    live = row_slot >= 0
    full = live.clone()
    full[live] = ref_state.full_logprobs[row_slot[live].long()] != 0
    assert torch.equal(got[0], expected[0]), (got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[2][full], expected[2][full], atol=1e-5, rtol=0)
    assert torch.equal(tri_state.output_counts, ref_state.output_counts)


def random_state(generator, num_slots, vocab, max_bias=8, **fixed):
    """Slots with random parameters, each feature on about half the time, unless fixed."""
    state = SamplingState.allocate(num_slots, vocab, max_bias, "cpu")

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=generator))]

    def ids(n):
        return torch.randint(vocab, (n,), generator=generator).tolist()

    for slot in range(num_slots):
        params = dict(
            temperature=pick([0.0, 0.6, 1.0, 1.4]), top_k=pick([-1, -1, 1, 7, 40, vocab - 1, vocab]),
            top_p=pick([1.0, 1.0, 0.3, 0.9]), min_p=pick([0.0, 0.0, 0.05, 0.3]),
            repetition_penalty=pick([1.0, 1.0, 0.8, 1.3]), frequency_penalty=pick([0.0, 0.0, 0.4, -0.3]),
            presence_penalty=pick([0.0, 0.0, 0.5]),
            seed=int(torch.randint(-2 ** 62, 2 ** 62, (1,), generator=generator)),
            logit_bias=pick([None, None, {i: 3.0 - i % 7 for i in ids(max_bias)}]),
            prompt_ids=ids(pick([0, 30])), output_ids=ids(pick([0, 20])),
            full_logprobs=pick([True, True, False]))
        params.update(fixed)
        state.assign(slot, **params)
    return state


def random_batch(generator, state, batch, padding=True):
    vocab = state.vocab
    slots = torch.randperm(state.num_slots, generator=generator)[:batch].to(torch.int32)
    if padding and batch > 1:
        slots[torch.rand(batch, generator=generator) < 0.2] = -1
    scale = float(torch.empty(()).uniform_(1, 6, generator=generator))
    logits = torch.randn(batch, vocab, generator=generator) * scale
    positions = torch.randint(0, 2 ** 40, (batch,), generator=generator)
    return logits, slots, positions


# --- the random stream --------------------------------------------------------------------


@triton.jit
def _noise(seed_ptr, position_ptr, bits_ptr, u_ptr, g_ptr, ROUND: tl.constexpr, LEVEL: tl.constexpr,
           N: tl.constexpr):
    """Triton's Philox words, and the kernel's uniforms and Gumbel noise, of indices [0, N)."""
    index = tl.arange(0, N)
    seed, position = tl.load(seed_ptr), tl.load(position_ptr)
    zero = index.to(tl.uint32) * 0
    bits, _, _, _ = tl.philox(seed, index.to(tl.uint32), zero + (position & 0xFFFFFFFF).to(tl.uint32),
                              zero + (position >> 32).to(tl.uint32), zero + (2 * ROUND + LEVEL))
    tl.store(bits_ptr + index, bits.to(tl.int32, bitcast=True))
    tl.store(u_ptr + index, sampling_triton._uniform(seed, position, ROUND, LEVEL, index))
    tl.store(g_ptr + index, sampling_triton._gumbel(seed, position, ROUND, LEVEL, index))


@pytest.mark.parametrize("seed", [0, 12345, -1, 2 ** 62 + 3, -(2 ** 40) - 7])
@pytest.mark.parametrize("position, round_, level", [(0, 0, 0), (17, 3, 1), (2 ** 33 + 5, 31, 1)])
def test_the_reference_draws_the_kernels_uniforms_bit_for_bit(seed, position, round_, level):
    n = 2048
    bits, u, g = torch.empty(n, dtype=torch.int32), torch.empty(n), torch.empty(n)
    _noise[(1,)](torch.tensor([seed]), torch.tensor([position]), bits, u, g, ROUND=round_, LEVEL=level, N=n)
    index = torch.arange(n)
    expected_bits, _, _, _ = reference.philox(seed, index, position & 0xFFFFFFFF, position >> 32,
                                              2 * round_ + level)
    assert torch.equal(expected_bits.to(torch.int32), bits)
    assert torch.equal(reference.uniforms(seed, position, round_, level, index), u)
    assert bool((u < 1).all())
    torch.testing.assert_close(reference.gumbel(seed, position, round_, level, index), g, rtol=1e-6, atol=1e-6)


def test_gumbel_noise_stays_finite_at_both_ends_of_the_uniforms():
    extremes = torch.tensor([0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1])  # 0 and 2**32 - 1 give u = 0
    u = reference.uniform(extremes)
    assert bool(((u >= reference.U_MIN) & (u < 1)).all())
    g = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(g).all())


def test_different_positions_rounds_and_levels_draw_different_noise():
    index = torch.arange(256)
    draws = [reference.gumbel(7, position, round_, level, index)
             for position, round_, level in [(0, 0, 0), (1, 0, 0), (2 ** 32, 0, 0), (0, 1, 0), (0, 0, 1)]]
    for i in range(len(draws)):
        for j in range(i):
            assert not torch.equal(draws[i], draws[j])
    assert not torch.equal(reference.gumbel(8, 0, 0, 0, index), draws[0])


# --- Triton against the reference ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_triton_matches_the_reference_on_mixed_batches(seed):
    """Greedy rows beside sampled ones with different parameters, padding rows, every feature
    on or off at random; vocabularies spanning one to five rows of columns."""
    generator = torch.Generator().manual_seed(seed)
    vocab = [700, 2500, 3000, 1024, 5000][seed]
    state = random_state(generator, 10, vocab)
    logits, slots, positions = random_batch(generator, state, [1, 4, 8, 3, 6][seed])
    assert_same_sampling(*run_both(logits, slots, positions, state), slots)


FEATURES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=5),
    "top_k_1": dict(top_k=1, temperature=2.0),
    "top_p": dict(top_p=0.6),
    "min_p": dict(min_p=0.2),
    "top_k_top_p_min_p": dict(top_k=30, top_p=0.9, min_p=0.02, temperature=1.3),
    "repetition": dict(repetition_penalty=1.5),
    "frequency_presence": dict(frequency_penalty=0.7, presence_penalty=-0.4, top_p=0.8),
    "logit_bias": dict(logit_bias={5: 8.0, 1999: 6.5, 0: -100.0}),
    "greedy_penalized": dict(temperature=0.0, repetition_penalty=2.0, logit_bias={17: 3.0}),
    "no_full_logprobs": dict(full_logprobs=False, top_p=0.9),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_triton_matches_the_reference_for_each_feature(feature):
    generator = torch.Generator().manual_seed(len(feature))
    params = dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                  frequency_penalty=0.0, presence_penalty=0.0, logit_bias=None, full_logprobs=True)
    params.update(FEATURES[feature])
    state = random_state(generator, 3, 2100, **params)
    logits, slots, positions = random_batch(generator, state, 3, padding=False)
    assert_same_sampling(*run_both(logits, slots, positions, state, block=1024), slots)


@pytest.mark.parametrize("crowded", [1, 3, 6])
def test_top_k_is_exact_when_one_lane_holds_many_of_the_largest(crowded):
    """Lane l of a 1,024-lane pass sees tokens l, l + 1024, ...: put `crowded` of the largest
    logits in one lane, so the lane lists settle the threshold at once (1), after the union of
    the lists (3), or only by bisection over the row (6)."""
    generator = torch.Generator().manual_seed(crowded)
    vocab = 7 * 1024
    logits = torch.randn(2, vocab, generator=generator)
    logits[:, 5:vocab:1024][:, :crowded] += 10.0
    state = random_state(generator, 2, vocab, top_k=crowded + 2, top_p=0.9, min_p=0.0,
                         temperature=1.0, repetition_penalty=1.0, frequency_penalty=0.0,
                         presence_penalty=0.0, logit_bias=None, full_logprobs=True)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    positions = torch.tensor([3, 4])
    assert_same_sampling(*run_both(logits, slots, positions, state, block=1024), slots)


@triton.jit
def _threshold_of(z_ptr, out_ptr, V, k, BLOCK: tl.constexpr):
    m, _, lane_max, _, _, second, third, fourth = sampling_triton._stats(z_ptr, 1.0, V, BLOCK, False, True)
    tl.store(out_ptr, sampling_triton._top_k_threshold(z_ptr, 1.0, V, k, m, lane_max, second, third,
                                                       fourth, BLOCK))


@pytest.mark.parametrize("k", [9, 1025, 5000])
@pytest.mark.parametrize("crowded", [0, 5])
def test_the_top_k_threshold_is_the_kth_largest_logit(k, crowded):
    """Every path of the threshold: lane maxima, lane lists, bisection over the row; ties and
    -inf logits included."""
    generator = torch.Generator().manual_seed(k)
    vocab = 5 * 1024 + 77
    z = torch.randn(vocab, generator=generator).round(decimals=1)  # many ties
    z[torch.rand(vocab, generator=generator) < 0.1] = NEG_INF
    z[7:vocab:1024][:crowded] = 9.0 + torch.arange(crowded)
    out = torch.empty(1)
    _threshold_of[(1,)](z, out, vocab, k, BLOCK=1024)
    assert out.item() == torch.topk(z, k).values[-1].item()


def test_the_argmax_follows_the_last_rejected_round(monkeypatch):
    """A nucleus of about 1% of a flat vocabulary: with one round allowed, most rows reject
    their draw and fall back to the argmax, the same rows in the kernel and the reference."""
    monkeypatch.setattr(reference, "MAX_ROUNDS", 1)
    monkeypatch.setattr(sampling_triton, "MAX_ROUNDS", 1)
    generator = torch.Generator().manual_seed(9)
    vocab = 2100
    state = random_state(generator, 6, vocab, temperature=1.0, top_p=0.01, top_k=-1, min_p=0.0,
                         repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                         logit_bias=None, full_logprobs=True)
    logits = torch.randn(6, vocab, generator=generator) * 0.1
    slots = torch.arange(6, dtype=torch.int32)
    expected, got, ref_state, tri_state = run_both(logits, slots, torch.arange(6), state)
    assert_same_sampling(expected, got, ref_state, tri_state, slots)
    assert int((got[0] == logits.argmax(-1)).sum()) >= 3


# --- greedy rows --------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_greedy_rows_without_penalties_are_argmax_bit_for_bit(impl):
    generator = torch.Generator().manual_seed(0)
    vocab = 3000
    logits = torch.randn(5, vocab, generator=generator).round(decimals=0)  # ties: lowest index wins
    logits[1] = NEG_INF
    logits[1, [4, 2500, 2999]] = 3.0
    logits[2, :] = 0.0
    logits[3, 1024] = 1e30
    state = SamplingState.allocate(5, vocab, 4, "cpu")
    for slot in range(5):
        state.assign(slot, temperature=0.0)
    slots = torch.arange(5, dtype=torch.int32)
    tokens, token_lp, lp = sampling.sample(logits, slots, torch.zeros(5, dtype=torch.int64), state, impl=impl)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(token_lp, lp.gather(1, tokens[:, None])[:, 0], atol=0, rtol=0)


# --- the reference against independent oracles -------------------------------------------


def exact_probabilities(z, top_k=-1, top_p=1.0, min_p=0.0):
    """softmax(z) restricted to the nucleus of K, by sorting (z distinct), in float64."""
    values, order = torch.sort(z.double(), descending=True)
    keep = torch.ones_like(values, dtype=torch.bool)
    if 0 < top_k < len(values):
        keep &= values >= values[top_k - 1]
    if min_p > 0:
        keep &= values >= values[0] + math.log(min_p)
    p = torch.where(keep, torch.exp(values - values[0]), 0.0)
    q = p / p.sum()
    nucleus = keep & (torch.cumsum(q, 0) - q < top_p)
    probabilities = torch.zeros_like(values)
    probabilities[order] = torch.where(nucleus, p, 0.0) / torch.where(nucleus, p, 0.0).sum()
    return probabilities, (torch.cumsum(q, 0) - q)[keep]


def chi_square_quantile(df, z=3.719):
    """Wilson-Hilferty: the chi-square quantile of a standard normal quantile z (3.719: 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_distributed_as(tokens, probabilities):
    counts = torch.bincount(tokens, minlength=probabilities.numel()).double()
    n = counts.sum()
    assert counts[probabilities == 0].sum() == 0, "drew a token outside the nucleus"
    support = probabilities > 0
    expected = n * probabilities[support]
    assert expected.min() >= 5, "too few draws for chi-square"
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    assert statistic < chi_square_quantile(df), (statistic, df, counts[support], expected)


def spread_logits(vocab, values):
    """Distinct logits on tokens sharing columns (c, c + 1024, ...) and alone; the rest -60."""
    ids = [3, 3 + COLUMNS, 3 + 2 * COLUMNS, 500, 1500, 77, 77 + COLUMNS, 900, 2000, 1023][:len(values)]
    logits = torch.full((vocab,), -60.0)
    logits[ids] = torch.tensor(values)
    return logits


DISTRIBUTIONS = {
    "temperature": (dict(temperature=1.3), [2.0, 1.5, 1.2, 1.0, 0.6, 0.3, 0.1, -0.4]),
    "top_p": (dict(top_p=0.8), [2.0, 1.5, 1.2, 1.0, 0.6, 0.3, 0.1, -0.4, -1.0, -1.5]),
    "top_k_top_p": (dict(top_k=5, top_p=0.9, temperature=0.8), [2.0, 1.5, 1.2, 1.0, 0.6, 0.3, 0.1]),
    "min_p_top_p": (dict(min_p=0.15, top_p=0.9, temperature=0.7), [1.0, 0.9, 0.5, 0.2, -0.3, -0.8, -2.0]),
}


def draws(impl, logits, params, n, first_seed=0):
    vocab = logits.numel()
    state = SamplingState.allocate(n, vocab, 1, "cpu")
    for slot in range(n):
        state.assign(slot, seed=first_seed + 7919 * slot, **params)
    tokens, _, _ = sampling.sample(logits.expand(n, vocab).contiguous(), torch.arange(n, dtype=torch.int32),
                                   torch.full((n,), 11, dtype=torch.int64), state, impl=impl)
    return tokens


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_reference_draws_follow_the_exact_truncated_distribution(name):
    params, values = DISTRIBUTIONS[name]
    logits = spread_logits(2100, values)
    z = logits * (1 / params.get("temperature", 1.0))
    probabilities, above = exact_probabilities(z, params.get("top_k", -1), params.get("top_p", 1.0),
                                               params.get("min_p", 0.0))
    if params.get("top_p", 1.0) < 1:  # no token of K near the nucleus edge
        assert (above - params["top_p"]).abs().min() > 0.01
    assert_distributed_as(draws("reference", logits, params, 700), probabilities)


def test_triton_draws_follow_the_exact_truncated_distribution():
    """A nucleus of three tokens, two of them in one column (3 and 3 + 1024), out of a top-4."""
    params, values = dict(top_k=4, top_p=0.75), [1.0, 0.6, 0.2, 0.0, -0.5]
    logits = spread_logits(2100, values)
    probabilities, above = exact_probabilities(logits, 4, 0.75)
    assert (above - 0.75).abs().min() > 0.01 and int((probabilities > 0).sum()) == 3
    assert_distributed_as(draws("triton", logits, params, 64, first_seed=5), probabilities)


def test_penalties_change_exactly_the_logits_they_should():
    """Processed log-probs against a hand computation: repetition on prompt and generated
    tokens (dividing positive logits, multiplying negative ones), frequency and presence on
    generated tokens only, then bias, then temperature."""
    vocab = 1500
    logits = torch.zeros(1, vocab)
    logits[0, :6] = torch.tensor([2.0, -2.0, 3.0, -1.0, 0.5, 4.0])
    state = SamplingState.allocate(1, vocab, 4, "cpu")
    state.assign(0, temperature=2.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                 prompt_ids=[0, 1], output_ids=[2, 2, 3], logit_bias={4: 1.5, 1400: -3.0}, seed=1)
    z = [2.0 / 2, -2.0 * 2, 3.0 / 2 - 0.5 * 2 - 0.25, -1.0 * 2 - 0.5 - 0.25, 0.5 + 1.5, 4.0]
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[:6] = torch.tensor(z, dtype=torch.float64)
    expected[1400] = -3.0
    expected = torch.log_softmax(expected / 2.0, 0).float()
    for impl in ("reference", "triton"):
        _, _, lp = sampling.sample(logits, torch.zeros(1, dtype=torch.int32),
                                   torch.zeros(1, dtype=torch.int64), copy_state(state), impl=impl)
        torch.testing.assert_close(lp[0], expected, atol=1e-6, rtol=0)


# --- seeds, counts, state -----------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_seeded_row_gives_the_same_token_alone_and_in_a_batch(impl):
    generator = torch.Generator().manual_seed(3)
    vocab = 2100
    state = random_state(generator, 8, vocab, temperature=1.2, top_p=0.95, top_k=-1, min_p=0.0,
                         repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                         logit_bias=None)
    logits = torch.randn(8, vocab, generator=generator)
    logits[:, :40] += 4.0  # a flat top: another draw is likely another token
    slots = torch.tensor([5, 0, 1, 2, 3, 4, 6, 7], dtype=torch.int32)
    positions = torch.arange(8, dtype=torch.int64) + 100

    def alone(position):
        return sampling.sample(logits[3:4], slots[3:4], torch.tensor([position]), copy_state(state),
                               impl=impl)[0].item()

    batch_tokens, _, _ = sampling.sample(logits, slots, positions, copy_state(state), impl=impl)
    assert alone(103) == batch_tokens[3].item()
    assert len({alone(103 + step) for step in range(4)}) > 1  # another position, another draw


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_counts_follow_the_sampled_tokens_of_live_rows_only(impl):
    generator = torch.Generator().manual_seed(4)
    state = random_state(generator, 6, 1200)
    before = state.output_counts.clone()
    logits, _, positions = random_batch(generator, state, 4)
    slots = torch.tensor([4, -1, 1, -1], dtype=torch.int32)
    tokens, token_lp, _ = sampling.sample(logits, slots, positions, state, impl=impl)
    expected = before.clone()
    expected[4, tokens[0]] += 1
    expected[1, tokens[2]] += 1
    assert torch.equal(state.output_counts, expected)
    assert tokens[1].item() == 0 and tokens[3].item() == 0
    assert token_lp[1].item() == 0.0 and token_lp[3].item() == 0.0


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy's NaN arithmetic
def test_a_row_of_nan_gets_a_token_in_range_and_touches_only_its_slot():
    vocab = 1100
    state = SamplingState.allocate(3, vocab, 1, "cpu")
    state.assign(0, temperature=0.0)
    state.assign(1, top_p=0.5, seed=1)
    state.assign(2, top_k=3, seed=2)
    logits = torch.full((3, vocab), float("nan"))
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    tokens, _, _ = sampling_triton.sample(logits, slots, torch.zeros(3, dtype=torch.int64), state)
    assert bool(((tokens >= 0) & (tokens < vocab)).all())
    assert state.output_counts.sum(1).tolist() == [1, 1, 1]


def test_assign_resets_a_slot_from_the_requests_ids():
    state = SamplingState.allocate(3, 50, 4, "cpu")
    state.output_counts[1] = 9
    state.assign(1, temperature=0.5, top_k=3, seed=-5, prompt_ids=[1, 1, 7], output_ids=[2, 2, 49],
                 logit_bias={8: -1.0, 3: 2.5})
    counts = torch.zeros(50, dtype=torch.int32)
    counts[2], counts[49] = 2, 1
    assert torch.equal(state.output_counts[1], counts)
    assert state.prompt_mask[1].nonzero().flatten().tolist() == [1, 7]
    assert state.bias_ids[1].tolist() == [8, 3, -1, -1]
    assert state.bias_values[1].tolist() == [-1.0, 2.5, 0.0, 0.0]
    assert state.temperature[1].item() == 0.5 and state.top_k[1].item() == 3 and state.seed[1].item() == -5
    state.assign(1)
    assert state.output_counts[1].sum() == 0 and state.bias_ids[1, 0] == -1
    for bad in (dict(top_p=0.0), dict(temperature=-1.0), dict(min_p=1.5), dict(repetition_penalty=0.0),
                dict(prompt_ids=[50]), dict(logit_bias={i: 1.0 for i in range(5)})):
        with pytest.raises(ValueError):
            state.assign(0, **bad)


def test_the_contract_is_checked_on_the_host():
    state = SamplingState.allocate(2, 100, 1, "cpu")
    slots, positions = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    logits = torch.zeros(1, 100)
    for args in ((torch.zeros(1, 99), slots, positions), (logits.double(), slots, positions),
                 (logits, slots.long(), positions), (logits, slots, positions.int()),
                 (torch.zeros(1, 200)[:, ::2], slots, positions)):
        with pytest.raises(ValueError):
            sampling_triton.sample(*args, state)
    with pytest.raises(ValueError):
        sampling_triton.sample(logits, slots, positions, state, tokens_out=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError):
        sampling_triton.sample(logits, slots, positions, state, logprobs_out=logits)
    with pytest.raises(ValueError):
        sampling.sample(torch.zeros(1, 100), slots, positions, state, impl="cuda")


# --- token masks (structured output) -------------------------------------------------------


def random_masks(generator, batch, vocab, constrained_share=0.6):
    """(token_mask [B, W] int32, mask_rows [B] int32): each row constrained with probability
    constrained_share, its mask allowing one token, ~3% or ~50% of the vocabulary (never none);
    unconstrained rows carry random words that must not matter."""
    words = -(-vocab // 32)
    density = torch.tensor([0.0, 0.03, 0.5])[torch.randint(3, (batch,), generator=generator)]
    allowed = torch.rand(batch, vocab, generator=generator) < density[:, None]
    allowed[torch.arange(batch), torch.randint(vocab, (batch,), generator=generator)] = True
    padded = torch.nn.functional.pad(allowed, (0, words * 32 - vocab)).view(batch, words, 32).long()
    packed = (padded << torch.arange(32)).sum(-1)
    token_mask = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    rows = (torch.rand(batch, generator=generator) < constrained_share).to(torch.int32)
    noise = torch.randint(-2 ** 31, 2 ** 31 - 1, (batch, words), generator=generator, dtype=torch.int64)
    token_mask = torch.where(rows[:, None] != 0, token_mask, noise.to(torch.int32))
    return token_mask, rows, allowed


def test_the_reference_unpacks_masks_as_xgrammar_applies_them():
    """allowed_tokens against xgrammar's own (CPU) apply_token_bitmask_inplace: the layout of
    the words the grammar library fills."""
    import xgrammar as xgr
    generator = torch.Generator().manual_seed(3)
    for vocab in (31, 32, 33, 1000, 4096):
        token_mask, _, allowed = random_masks(generator, 4, vocab, constrained_share=1.0)
        logits = torch.zeros(4, vocab)
        xgr.apply_token_bitmask_inplace(logits, token_mask, vocab_size=vocab, backend="cpu")
        assert torch.equal(reference.allowed_tokens(token_mask, vocab), logits == 0)
        assert torch.equal(reference.allowed_tokens(token_mask, vocab), allowed)


@pytest.mark.parametrize("seed", range(4))
def test_triton_matches_the_reference_with_token_masks(seed):
    """Masked and unmasked rows, greedy and sampled, every feature at random: the same tokens,
    log-probs and counts; every masked row's token is one its mask allows, and its log-probs are
    -inf exactly outside the mask."""
    generator = torch.Generator().manual_seed(100 + seed)
    vocab = [700, 2500, 3000, 1024][seed]
    state = random_state(generator, 10, vocab)
    logits, slots, positions = random_batch(generator, state, [3, 6, 8, 5][seed])
    token_mask, rows, allowed = random_masks(generator, len(slots), vocab)
    ref_state, tri_state = copy_state(state), copy_state(state)
    expected = reference.sample(logits, slots, positions, ref_state, token_mask=token_mask, mask_rows=rows)
    got = sampling_triton.sample(logits, slots, positions, tri_state, token_mask=token_mask, mask_rows=rows,
                                 block=1024)
    assert_same_sampling(expected, got, ref_state, tri_state, slots)
    for b in range(len(slots)):
        if slots[b] < 0 or not rows[b]:
            continue
        assert allowed[b, got[0][b]], f"row {b} took token {int(got[0][b])} its mask leaves out"
        if state.full_logprobs[slots[b]]:
            assert torch.equal(torch.isinf(got[2][b]), ~allowed[b])


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_only_the_masked_rows_of_a_batch_change(impl):
    """A batch of greedy and sampled rows sampled with and without masks: the rows without a
    flag get the same tokens and log-probs either way; greedy masked rows get the argmax over
    their allowed tokens."""
    generator = torch.Generator().manual_seed(7)
    vocab, batch = 1500, 6
    state = random_state(generator, batch, vocab, temperature=1.0, repetition_penalty=1.0,
                         frequency_penalty=0.0, presence_penalty=0.0, logit_bias=None, full_logprobs=True)
    for slot in (0, 3):
        state.temperature[slot] = 0.0
    logits, _, positions = random_batch(generator, state, batch, padding=False)
    slots = torch.arange(batch, dtype=torch.int32)
    token_mask, _, allowed = random_masks(generator, batch, vocab, constrained_share=1.0)
    rows = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.int32)
    free = sampling.sample(logits, slots, positions, copy_state(state), impl=impl)
    masked = sampling.sample(logits, slots, positions, copy_state(state), token_mask=token_mask,
                             mask_rows=rows, impl=impl)
    for b in range(batch):
        if rows[b]:
            assert allowed[b, masked[0][b]]
        else:
            assert masked[0][b] == free[0][b]
            assert torch.equal(masked[2][b], free[2][b])
    assert masked[0][0] == torch.where(allowed[0], logits[0], NEG_INF).argmax()
    assert masked[0][3] == torch.where(allowed[3], logits[3], NEG_INF).argmax()


def test_the_mask_contract_is_checked_on_the_host():
    state = SamplingState.allocate(2, 100, 4, "cpu")
    logits, slots, positions = torch.zeros(1, 100), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    rows = torch.ones(1, dtype=torch.int32)
    for token_mask, mask_rows in ((torch.zeros(1, 3, dtype=torch.int32), rows),  # 100 tokens need 4 words
                                  (torch.zeros(1, 4, dtype=torch.int64), rows),
                                  (torch.zeros(1, 4, dtype=torch.int32), None),
                                  (torch.zeros(1, 4, dtype=torch.int32), rows.bool())):
        with pytest.raises(ValueError):
            sampling_triton.sample(logits, slots, positions, state, token_mask=token_mask, mask_rows=mask_rows)


# --- GPU ----------------------------------------------------------------------------------


def _gpu_case(batch, generator):
    vocab = 151_936
    state = random_state(generator, 2 * batch, vocab, max_bias=300)
    logits, slots, positions = random_batch(generator, state, batch)
    return state, logits, slots, positions


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_triton_matches_the_reference_at_real_size_on_gpu_and_replays_in_a_graph(batch):
    from moeferry.engine.cuda_graph import capture

    generator = torch.Generator().manual_seed(batch)
    state, logits, slots, positions = _gpu_case(batch, generator)
    state = SamplingState(**{f.name: getattr(state, f.name).cuda() for f in dataclasses.fields(state)})
    logits, slots, positions = logits.cuda(), slots.cuda(), positions.cuda()
    expected, got, ref_state, tri_state = run_both(logits, slots, positions, state)
    assert_same_sampling(expected, got, ref_state, tri_state, slots)

    counts = state.output_counts.clone()
    outputs = (torch.empty(batch, dtype=torch.int64, device="cuda"), torch.empty(batch, device="cuda"),
               torch.empty(batch, 151_936, device="cuda"))

    def step():
        return sampling.sample(logits, slots, positions, state, tokens_out=outputs[0],
                               token_logprobs_out=outputs[1], logprobs_out=outputs[2])

    graph, _ = capture(step)
    for step_index in range(3):  # new logits and positions in the captured buffers
        logits.copy_(torch.randn(logits.shape, generator=generator).cuda() * 4)
        positions.add_(1)
        state.output_counts.copy_(counts)
        eager = [t.clone() for t in step()]
        eager_counts = state.output_counts.clone()
        state.output_counts.copy_(counts)
        for out in outputs:
            out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outputs[0], eager[0]) and torch.equal(outputs[1], eager[1])
        assert torch.equal(state.output_counts, eager_counts)
        live = slots >= 0
        full = live.clone()
        full[live] = state.full_logprobs[slots[live].long()] != 0
        assert torch.equal(outputs[2][full], eager[2][full])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16])
def test_masked_sampling_matches_the_reference_at_real_size_on_gpu(batch):
    """Qwen3's 151,936 tokens, masks on about half the rows (one token, 3% or half the
    vocabulary): Triton against the reference, each masked row's token allowed by its mask."""
    generator = torch.Generator().manual_seed(1000 + batch)
    state, logits, slots, positions = _gpu_case(batch, generator)
    token_mask, rows, allowed = random_masks(generator, batch, 151_936, constrained_share=0.5)
    state = SamplingState(**{f.name: getattr(state, f.name).cuda() for f in dataclasses.fields(state)})
    logits, slots, positions = logits.cuda(), slots.cuda(), positions.cuda()
    token_mask, rows = token_mask.cuda(), rows.cuda()
    ref_state, tri_state = copy_state(state), copy_state(state)
    expected = reference.sample(logits, slots, positions, ref_state, token_mask=token_mask, mask_rows=rows)
    got = sampling_triton.sample(logits, slots, positions, tri_state, token_mask=token_mask, mask_rows=rows)
    assert_same_sampling(expected, got, ref_state, tri_state, slots)
    live = (slots >= 0) & (rows != 0)
    tokens = got[0].cpu()
    for b in torch.nonzero(live.cpu())[:, 0].tolist():
        assert allowed[b, tokens[b]]
