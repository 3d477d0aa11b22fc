"""The host expert kernel (kernels/fused_moe/host.py, host_experts.cpp) against a plain-torch
model of its arithmetic: bf16 weights and tokens, float32 dots, the activation and the
weighted route output rounded to bf16. Every vector path this CPU has is checked (the
AVX512-BF16 one where the CPU has it: the GPU machine's host); routes with a negative id are
left zero; the op's contract (`fused_moe` on the host) against the reference."""
import pytest
import torch
import torch.nn.functional as F

from moeferry.kernels.fused_moe import host, reference

pytestmark = pytest.mark.skipif(not host.available(), reason="no C++ compiler to build the host kernel")


def vector_isas():
    return ["portable"] + (["avx512_bf16"] if host.has_avx512_bf16() else [])


def rounded_model(hidden, w13, w2, weights, ids):
    """[T, K, H] bf16: per route, the kernel's rounding points in float32 torch ops."""
    num_tokens, top_k = ids.shape
    inter = w2.shape[2]
    out = torch.zeros(num_tokens, top_k, hidden.shape[1], dtype=torch.bfloat16)
    for t in range(num_tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            if e < 0:
                continue
            gate_up = w13[e].float() @ hidden[t].float()
            act = (F.silu(gate_up[:inter]) * gate_up[inter:]).bfloat16().float()
            out[t, k] = (float(weights[t, k]) * (w2[e].float() @ act)).bfloat16()
    return out


def make_case(num_tokens, top_k, hidden_size, inter, num_experts, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).bfloat16()
    w13 = (torch.randn(num_experts, 2 * inter, hidden_size, generator=gen) / hidden_size ** 0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden_size, inter, generator=gen) / inter ** 0.5).bfloat16()
    weights = torch.rand(num_tokens, top_k, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).int()
    return hidden, w13, w2, weights, ids


def assert_close_in_bf16(got, want):
    """Equal up to the float32 summation order, which may round an output, or an activation
    element that feeds it, the other way: an output then moves by one bf16 step of its own
    value, or by an activation's step times a down weight, a small share of the outputs'
    scale. Most elements stay bit-equal."""
    got, want = got.float(), want.float()
    bound = want.abs() * 2.0 ** -7 + want.pow(2).mean().sqrt() * 2.0 ** -5
    assert bool(((got - want).abs() <= bound).all()), float((got - want).abs().max())
    assert float((got != want).float().mean()) < 0.05


@pytest.mark.parametrize("vector_isa", vector_isas())
@pytest.mark.parametrize("shape", [(1, 8, 256, 64, 32), (5, 4, 96, 40, 6), (16, 8, 512, 96, 64),
                                   (3, 2, 100, 20, 5), (33, 2, 64, 33, 4)],
                         ids=["decode-1", "odd-5", "decode-16", "tails", "prefill-33"])
def test_host_kernel_matches_its_arithmetic_on_every_route(vector_isa, shape):
    hidden, w13, w2, weights, ids = make_case(*shape, seed=sum(shape))
    got = host.expert_routes(hidden, w13, w2, weights, ids, threads=2, vector_isa=vector_isa)
    assert got.dtype == torch.bfloat16 and got.shape == (*ids.shape, hidden.shape[1])
    assert_close_in_bf16(got, rounded_model(hidden, w13, w2, weights, ids))


@pytest.mark.parametrize("vector_isa", vector_isas())
def test_routes_with_a_negative_id_are_zero_and_the_others_unchanged(vector_isa):
    hidden, w13, w2, weights, ids = make_case(6, 4, 128, 48, 16, seed=3)
    full = host.expert_routes(hidden, w13, w2, weights, ids, threads=2, vector_isa=vector_isa)
    skip = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)) < 0.5
    part = host.expert_routes(hidden, w13, w2, weights, torch.where(skip, -1, ids), threads=2,
                              vector_isa=vector_isa)
    assert bool((part[skip] == 0).all())
    assert torch.equal(part[~skip], full[~skip])  # a route's bits do not depend on its neighbours


def test_thread_count_does_not_change_the_bits():
    hidden, w13, w2, weights, ids = make_case(7, 4, 128, 48, 16, seed=5)
    one = host.expert_routes(hidden, w13, w2, weights, ids, threads=1)
    assert torch.equal(one, host.expert_routes(hidden, w13, w2, weights, ids, threads=3))


@pytest.mark.parametrize("sum_routes", [True, False])
def test_the_host_op_follows_the_fused_moe_contract(sum_routes):
    hidden, w13, w2, weights, ids = make_case(9, 4, 128, 64, 16, seed=6)
    got = host.fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=16, sum_routes=sum_routes)
    want = reference.fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=16, sum_routes=sum_routes)
    assert got.shape == want.shape
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert float(err) < 1e-2  # bf16 rounding of the activation and of each route output


def test_a_float32_call_takes_the_reference():
    hidden, w13, w2, weights, ids = make_case(4, 2, 64, 32, 8, seed=7)
    args = (hidden.float(), w13.float(), w2.float(), weights, ids)
    assert torch.equal(host.fused_moe(*args, num_routed_experts=8), reference.fused_moe(*args, num_routed_experts=8))


def test_bad_calls_are_refused_in_one_line():
    hidden, w13, w2, weights, ids = make_case(2, 2, 64, 32, 8, seed=8)
    out = torch.empty(2, 2, 64, dtype=torch.bfloat16)
    act = torch.empty(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="hidden must be a contiguous CPU torch.bfloat16"):
        host.make_call(hidden.float(), ids, weights, out, w13, w2, act, 1)
    with pytest.raises(ValueError, match="act scratch"):
        host.make_call(hidden, ids, weights, out, w13, w2, act[:1], 1)
    with pytest.raises(ValueError, match="vector_isa"):
        host.make_call(hidden, ids, weights, out, w13, w2, act, 1, vector_isa="sse")
