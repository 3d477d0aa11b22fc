"""fused_moe: Triton (under TRITON_INTERPRET=1 on CPU) vs the grouped reference vs a
per-token float64 oracle; bit-identity between a layer's bank and a slot pool; the
naive/sorted block assignment rule. GPU tests run the real Qwen3-30B-A3B shapes."""
import pytest
import torch
import torch.nn.functional as F

from moeferry.kernels.fused_moe import fused_moe
from moeferry.kernels.fused_moe import triton as triton_fused_moe


def make_layer(num_experts, hidden_size, intermediate_size, dtype, device="cpu", seed=0):
    """Weights scaled so outputs are O(1): w13 [E, 2I, H], w2 [E, H, I]."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate_size, hidden_size, generator=gen)
    w2 = torch.randn(num_experts, hidden_size, intermediate_size, generator=gen)
    w13 = (w13 / hidden_size ** 0.5).to(dtype).to(device)
    w2 = (w2 / intermediate_size ** 0.25).to(dtype).to(device)
    return w13, w2


def make_routes(num_tokens, hidden_size, num_experts, top_k, dtype, device="cpu", seed=1):
    """hidden [T, H] and router-like top-k (distinct experts per token, softmax weights)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype).to(device)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return hidden, weights.float().to(device), ids.to(device)


def oracle(hidden, w13, w2, topk_weights, topk_ids):
    """Per token, per route, in float64: the definition, not the grouped algorithm."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    intermediate_size = w2.shape[2]
    for t in range(hidden.shape[0]):
        x = hidden[t].double().cpu()
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate_up = w13[e].double().cpu() @ x
            act = F.silu(gate_up[:intermediate_size]) * gate_up[intermediate_size:]
            out[t] += float(topk_weights[t, k]) * (w2[e].double().cpu() @ act)
    return out


def rel_err(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm())


def scatter_into_pool(w13, w2, num_slots, seed=2):
    """A slot pool [S, ...] of random rows holding the layer's experts at random slots;
    returns (pool13, pool2, slot_of [E])."""
    gen = torch.Generator().manual_seed(seed)
    num_experts = w13.shape[0]
    slot_of = torch.randperm(num_slots, generator=gen)[:num_experts]
    pool13 = torch.randn((num_slots,) + tuple(w13.shape[1:]), generator=gen).to(w13.dtype)
    pool2 = torch.randn((num_slots,) + tuple(w2.shape[1:]), generator=gen).to(w2.dtype)
    pool13, pool2 = pool13.to(w13.device), pool2.to(w2.device)
    pool13[slot_of.to(w13.device)] = w13
    pool2[slot_of.to(w2.device)] = w2
    return pool13, pool2, slot_of.to(w13.device)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_per_token_oracle(dtype):
    w13, w2 = make_layer(16, 80, 48, dtype)
    hidden, weights, ids = make_routes(33, 80, 16, 4, dtype)
    got = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=16, impl="reference")
    assert got.dtype == dtype and got.shape == hidden.shape
    assert rel_err(got, oracle(hidden, w13, w2, weights, ids)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,assignment", [(3, "naive"), (3, "sorted"), (21, "sorted")])
def test_triton_matches_reference_and_oracle(dtype, num_tokens, assignment):
    num_experts, top_k, hidden_size, intermediate_size = 32, 2, 80, 48  # non-pow2: masked tails
    w13, w2 = make_layer(num_experts, hidden_size, intermediate_size, dtype)
    hidden, weights, ids = make_routes(num_tokens, hidden_size, num_experts, top_k, dtype)
    if num_tokens > 3:
        ids[:, 0] = ids[0, 0]  # one expert shared by every token: a group of several blocks
    got = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=num_experts,
                        block_assignment=assignment, impl="triton")
    ref = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=num_experts,
                        impl="reference")
    want = oracle(hidden, w13, w2, weights, ids)
    assert got.dtype == dtype and got.abs().max() > 0.1
    assert rel_err(got, want) < TOLERANCE[dtype]
    assert rel_err(got, ref) < TOLERANCE[dtype]
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl,dtype,assignment", [
    ("triton", torch.float32, "sorted"),
    ("triton", torch.bfloat16, "sorted"),
    ("triton", torch.bfloat16, "naive"),
    ("reference", torch.bfloat16, "auto"),
    ("reference", torch.float32, "auto"),
])
def test_slot_pool_gives_bit_identical_output(impl, dtype, assignment):
    """Same routes over the layer's bank [E] and over a 1,100-slot pool, experts scattered."""
    num_experts, top_k, hidden_size, intermediate_size = 16, 2, 64, 32
    num_tokens = 2 if assignment == "naive" else 9
    w13, w2 = make_layer(num_experts, hidden_size, intermediate_size, dtype)
    pool13, pool2, slot_of = scatter_into_pool(w13, w2, 1100)
    hidden, weights, ids = make_routes(num_tokens, hidden_size, num_experts, top_k, dtype)
    over_bank = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=num_experts,
                              block_assignment=assignment, impl=impl)
    over_pool = fused_moe(hidden, pool13, pool2, weights, slot_of[ids],
                              num_routed_experts=num_experts, block_assignment=assignment,
                              impl=impl)
    assert over_bank.abs().max() > 0.1
    assert torch.equal(over_bank, over_pool)


def test_tiles_depend_on_the_routed_layer_not_the_pool(monkeypatch):
    seen = []
    real_select = triton_fused_moe.select_config
    monkeypatch.setattr(triton_fused_moe, "select_config",
                        lambda *args: seen.append(args) or real_select(*args))
    w13, w2 = make_layer(8, 32, 16, torch.float32)
    pool13, pool2, slot_of = scatter_into_pool(w13, w2, 300)
    hidden, weights, ids = make_routes(5, 32, 8, 2, torch.float32)
    fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=8, impl="triton")
    fused_moe(hidden, pool13, pool2, weights, slot_of[ids], num_routed_experts=8,
                  impl="triton")
    assert seen[0] == seen[1] == (5, 2, 32, 16, 8, torch.float32)


def test_config_block_m_follows_tokens_per_expert():
    def block_m(num_tokens):
        return triton_fused_moe.select_config(num_tokens, 8, 2048, 768, 128, torch.bfloat16).block_m
    assert block_m(1) == block_m(64) == 16  # decode: 16 rows per block
    assert block_m(512) == 32
    assert block_m(4096) == 64


def test_pipeline_depth_per_gemm_at_decode_sizes():
    """(gate+up stages, down stages) as the H200 sweep chose them: 3 for the down GEMM up to a
    token per expert, 3 for gate+up from 2 tokens; 4 and 4 past a token per expert."""
    def stages(num_tokens):
        config = triton_fused_moe.select_config(num_tokens, 8, 2048, 768, 128, torch.bfloat16)
        return config.stages(True), config.stages(False)
    assert stages(1) == (4, 3)
    assert stages(2) == stages(4) == stages(16) == (3, 3)
    assert stages(17) == stages(64) == (4, 4)
    same = triton_fused_moe.FusedMoEConfig(16, 64, 128, 1, 4, 5)  # no down depth: both alike
    assert same.stages(True) == same.stages(False) == 5


def test_out_is_written_in_place():
    w13, w2 = make_layer(8, 32, 16, torch.float32)
    hidden, weights, ids = make_routes(4, 32, 8, 2, torch.float32)
    for impl in ("reference", "triton"):
        out = torch.full_like(hidden, float("nan"))
        got = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=8, out=out,
                            impl=impl)
        assert got.data_ptr() == out.data_ptr() and not out.isnan().any()
        assert rel_err(out, oracle(hidden, w13, w2, weights, ids)) < 1e-5


@pytest.mark.parametrize("num_tokens", [1, 2, 4])
def test_device_weights_take_the_naive_path_when_the_rule_allows(num_tokens):
    w13, w2 = make_layer(2, 16, 16, torch.float32)  # only the device matters for the rule
    choose = triton_fused_moe.choose_block_assignment
    assert choose(num_tokens, 8, 128, w13, w2) == "naive"  # T * 8 * 4 <= 128
    assert choose(num_tokens + 4, 8, 128, w13, w2) == "sorted"
    assert choose(num_tokens, 8, 32 * num_tokens - 1, w13, w2) == "sorted"


@pytest.mark.parametrize("host_bank", ["w13", "w2", "both"])
def test_host_resident_weights_take_the_sorted_path(monkeypatch, host_bank):
    w13, w2 = make_layer(2, 16, 16, torch.float32)
    host = {"w13": [w13], "w2": [w2], "both": [w13, w2]}[host_bank]
    monkeypatch.setattr(triton_fused_moe, "is_host_resident",
                        lambda t: any(t is h for h in host))
    for num_tokens in (1, 2, 4):
        assert triton_fused_moe.choose_block_assignment(num_tokens, 8, 128, w13, w2) == "sorted"


@pytest.mark.parametrize("host_resident", [False, True])
def test_moe_align_runs_exactly_when_sorted(monkeypatch, host_resident):
    num_experts, top_k = 128, 8
    w13, w2 = make_layer(num_experts, 32, 16, torch.float32)
    calls = []
    real_align = triton_fused_moe.moe_align_block_size
    monkeypatch.setattr(triton_fused_moe, "moe_align_block_size",
                        lambda *args: calls.append(args) or real_align(*args))
    monkeypatch.setattr(triton_fused_moe, "is_host_resident", lambda t: host_resident)
    for num_tokens in (1, 2, 4, 5):
        hidden, weights, ids = make_routes(num_tokens, 32, num_experts, top_k, torch.float32,
                                           seed=num_tokens)
        calls.clear()
        got = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=num_experts,
                            impl="triton")
        sorted_path = host_resident or num_tokens == 5
        assert len(calls) == (1 if sorted_path else 0)
        assert rel_err(got, oracle(hidden, w13, w2, weights, ids)) < 1e-5


def test_naive_is_refused_past_the_small_batch_rule():
    w13, w2 = make_layer(8, 32, 16, torch.float32)
    hidden, weights, ids = make_routes(3, 32, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="naive"):
        fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=8,
                      block_assignment="naive", impl="triton")


def summed_then_normed_both_ways(hidden, w13, w2, weights, ids, num_experts, impl, seed=3):
    """(norm and residual after fused_moe's own sum, the same after the residual add summed
    the route partials, the partials)."""
    from moeferry.kernels import norm_rope
    gen = torch.Generator().manual_seed(seed)
    residual = torch.randn(hidden.shape, generator=gen).to(hidden.dtype).to(hidden.device)
    norm_weight = (1 + 0.5 * torch.randn(hidden.shape[1], generator=gen)).to(hidden.dtype).to(hidden.device)
    kwargs = dict(num_routed_experts=num_experts, impl=impl)
    summed = fused_moe(hidden, w13, w2, weights, ids, **kwargs)
    partials = fused_moe(hidden, w13, w2, weights, ids, sum_routes=False, **kwargs)
    want = norm_rope.fused_add_rms_norm(summed, residual, norm_weight, 1e-6, impl=impl)
    got = norm_rope.fused_add_rms_norm(partials, residual, norm_weight, 1e-6, impl=impl)
    return want, got, partials


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 4), (5, 2), (21, 3)])
def test_route_partials_summed_by_the_residual_add_give_the_same_bits(impl, dtype,
                                                                      num_tokens, top_k):
    """A decoder layer hands a MoE block's per-route outputs to the next residual add +
    RMSNorm, which sums them: its results must be those of the MoE's own sum, bit for bit."""
    w13, w2 = make_layer(16, 80, 48, dtype)
    hidden, weights, ids = make_routes(num_tokens, 80, 16, top_k, dtype)
    (want_norm, want_res), (got_norm, got_res), partials = summed_then_normed_both_ways(
        hidden, w13, w2, weights, ids, 16, impl)
    assert partials.shape == (num_tokens, top_k, 80)
    assert partials.dtype == (dtype if impl == "triton" else torch.float32)
    assert torch.equal(got_res, want_res) and torch.equal(got_norm, want_norm)
    assert not torch.equal(partials[:, 0], partials[:, 1])  # real partials, not one row K times


def test_route_partials_of_an_empty_batch():
    w13, w2 = make_layer(8, 32, 16, torch.float32)
    hidden, weights, ids = make_routes(0, 32, 8, 2, torch.float32)
    for impl in ("reference", "triton"):
        partials = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=8, sum_routes=False,
                                 impl=impl)
        assert partials.shape == (0, 2, 32)


def test_route_partials_refuse_an_output_buffer_and_aliasing():
    from moeferry.kernels import norm_rope
    w13, w2 = make_layer(8, 32, 16, torch.float32)
    hidden, weights, ids = make_routes(3, 32, 8, 2, torch.float32)
    for impl in ("reference", "triton"):
        with pytest.raises(ValueError, match="sum_routes"):
            fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=8, out=torch.empty_like(hidden),
                          sum_routes=False, impl=impl)
    partials = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=8, sum_routes=False,
                             impl="triton")
    weight = torch.ones(32)
    with pytest.raises(ValueError, match="residual_out"):
        norm_rope.fused_add_rms_norm(partials, hidden.clone(), weight, 1e-6, residual_out=partials[:, 0],
                                     impl="triton")
    with pytest.raises(ValueError, match="one dtype"):
        norm_rope.fused_add_rms_norm(partials, hidden.to(torch.bfloat16), weight.bfloat16(), 1e-6,
                                     impl="triton")


# --- GPU: real Qwen3-30B-A3B shapes ------------------------------------------------------

QWEN3 = dict(hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8)


def _qwen3_layer(num_tokens, seed=0):
    w13, w2 = make_layer(QWEN3["num_experts"], QWEN3["hidden_size"],
                         QWEN3["intermediate_size"], torch.bfloat16, "cuda", seed)
    hidden, weights, ids = make_routes(num_tokens, QWEN3["hidden_size"], QWEN3["num_experts"],
                                       QWEN3["top_k"], torch.bfloat16, "cuda", seed + 1)
    return hidden, w13, w2, weights, ids


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 600])
def test_triton_matches_reference_on_gpu(num_tokens):
    hidden, w13, w2, weights, ids = _qwen3_layer(num_tokens)
    got = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=128)
    ref = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=128, impl="reference")
    assert rel_err(got, ref) < 1e-2
    for assignment in ("sorted", "naive") if num_tokens <= 4 else ("sorted",):
        again = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=128,
                              block_assignment=assignment)
        assert rel_err(again, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 600])
def test_slot_pool_bit_identity_on_gpu(num_tokens):
    hidden, w13, w2, weights, ids = _qwen3_layer(num_tokens)
    pool13, pool2, slot_of = scatter_into_pool(w13, w2, 1100)
    for assignment in ("auto", "sorted"):
        over_bank = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=128,
                                  block_assignment=assignment)
        over_pool = fused_moe(hidden, pool13, pool2, weights, slot_of[ids],
                                  num_routed_experts=128, block_assignment=assignment)
        assert torch.equal(over_bank, over_pool)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [4, 64])
def test_cuda_graph_replays_identically(num_tokens):
    hidden, w13, w2, weights, ids = _qwen3_layer(num_tokens)
    out = torch.empty_like(hidden)
    fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=128, out=out)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=128, out=out)
    new_hidden, _, _, new_weights, new_ids = _qwen3_layer(num_tokens, seed=10)
    hidden.copy_(new_hidden)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    eager = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=128)
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 16])
def test_pinned_host_weights_are_read_in_place(num_tokens):
    hidden, w13, w2, weights, ids = _qwen3_layer(num_tokens)
    host13, host2 = w13.cpu().pin_memory(), w2.cpu().pin_memory()
    assert triton_fused_moe.is_host_resident(host13)
    assert triton_fused_moe.choose_block_assignment(num_tokens, 8, 128, host13, host2) == "sorted"
    on_device = fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=128,
                              block_assignment="sorted")
    from_host = fused_moe(hidden, host13, host2, weights, ids, num_routed_experts=128)
    half_host = fused_moe(hidden, host13, w2, weights, ids, num_routed_experts=128)
    assert torch.equal(from_host, on_device)
    assert torch.equal(half_host, on_device)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64])
def test_route_partials_summed_by_the_residual_add_on_gpu(num_tokens):
    hidden, w13, w2, weights, ids = _qwen3_layer(num_tokens)
    (want_norm, want_res), (got_norm, got_res), partials = summed_then_normed_both_ways(
        hidden, w13, w2, weights, ids, QWEN3["num_experts"], None)
    assert partials.shape == (num_tokens, QWEN3["top_k"], QWEN3["hidden_size"])
    assert torch.equal(got_res, want_res) and torch.equal(got_norm, want_norm)
