"""GPU: `cpu` and `hybrid` generate what `gpu` generates on the built-in model, through CUDA
graphs whose host nodes run the host kernel, eager too, on quantized experts (fp8, int4,
mxfp4: the host kernel dequantizes them as it reads) and on gpt-oss's biased, clamped experts
(bf16 and mxfp4); the host channel's outputs inside a captured graph equal the same call run
eagerly."""
import pytest
import torch

pytestmark = pytest.mark.gpu

TIE = 0.2  # log-probability gap under which bf16 rounding on another channel may pick the runner-up


def assert_same_until_a_near_tie(want, got):
    """Greedy tokens equal, or equal up to a position where the reference's lead over its
    runner-up was under TIE: the tiny model has many near ties (range(10, 50)'s first token
    leads by 0.06, one bf16 step of its logit), which rounding decides, and the host and the
    GPU round in different orders. A divergence at a clear choice is an error."""
    for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)):
        if a != b:
            top = want.logprobs[i].top
            assert top[0][1] - top[1][1] < TIE, f"diverged at token {i} where the reference led by {top[0][1] - top[1][1]:.3f}"
            return


@pytest.mark.parametrize("options", [
    dict(moe_strategy="cpu"),
    dict(moe_strategy="cpu", disable_cuda_graph=True),
    dict(moe_strategy="cpu", moe_prefill_demand_tokens=64),
    dict(moe_strategy="hybrid", moe_cache_slots=48, moe_host_share=0.5, moe_collect_stats=True),
    dict(moe_strategy="hybrid", moe_cache_slots=48, moe_prefill_demand_tokens="auto"),
    dict(moe_strategy="hybrid", moe_cache_slots=48, moe_host_share=1.0, disable_cuda_graph=True),
    dict(moe_strategy="hybrid", moe_cache_slots=48, moe_host_share=0.5, moe_host_dispatch="host_function"),
], ids=["cpu", "cpu-eager", "cpu-demand", "hybrid-half", "hybrid-auto", "hybrid-all-misses-eager",
        "hybrid-host-function"])
def test_host_strategies_generate_what_gpu_generates(options):
    from moeferry import LLM, SamplingParams
    from moeferry.default_model import ensure_default_model

    path = ensure_default_model()
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(10, 50))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    ref = LLM(path, max_running_requests=4).generate(prompts, params)
    llm = LLM(path, max_running_requests=4, **options)
    for want, got in zip(ref, llm.generate(prompts, params)):
        assert_same_until_a_near_tie(want, got)
    stats = llm.engine.runner.strategy.stats()
    assert not stats["host_stalled"]
    assert (llm.engine.runner.graphs is None) == bool(options.get("disable_cuda_graph"))
    if options["moe_strategy"] == "hybrid" and options.get("moe_host_share") is None:
        # The measured split: the host takes round(share x misses - offset) of a layer's decode
        # misses, none at all when its fixed cost per call outweighs the most a step can miss
        # (a busy host measures a larger one).
        speeds, most_misses = stats["speeds"], min(llm.engine.mc.num_experts, len(prompts) * llm.engine.mc.top_k)
        never = speeds["host_share"] * most_misses - speeds["host_offset_experts"] < 0.5
        assert (stats["host_experts"] == 0) if never else (stats["host_experts"] > 0)
    else:
        assert stats["host_experts"] > 0
    if options["moe_strategy"] == "hybrid" and options.get("moe_collect_stats"):
        assert stats["decode"]["total"]["misses"] > 0


@pytest.mark.parametrize("dispatch", ["host_function", "mailbox"])
def test_the_host_channel_replays_in_a_graph_as_it_runs_eagerly(dispatch):
    """Either dispatch (a CUDA host function on the side stream, or the mailbox worker polled
    and awaited by kernels): the graph's replay gives the eager bits, the same in both, the
    host's routes nonzero and the others zero, and no wait gave up."""
    from moeferry.engine.cuda_graph import capture
    from moeferry.kernels.fused_moe import host as host_kernel
    from moeferry.moe.banks import ExpertBanks
    from moeferry.moe.host_channel import HostChannelOptions, HostExpertChannel

    gen = torch.Generator().manual_seed(0)
    hidden_size, inter, experts, top_k, tokens = 1024, 256, 32, 4, 8
    banks = {layer: ExpertBanks((torch.randn(experts, 2 * inter, hidden_size, generator=gen) * 0.03).bfloat16().pin_memory(),
                                (torch.randn(experts, hidden_size, inter, generator=gen) * 0.06).bfloat16().pin_memory())
             for layer in range(3)}
    channel = HostExpertChannel(banks, tokens, top_k, torch.device("cuda"), threads=8,
                                options=HostChannelOptions(dispatch=dispatch))
    hidden = torch.randn(tokens, hidden_size, generator=gen).bfloat16().cuda()
    weights = torch.rand(tokens, top_k, generator=gen).cuda()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int().cuda()
    host_ids = torch.where(torch.rand(tokens, top_k, generator=gen).cuda() < 0.5, ids, -1)

    def step():
        outs = []
        for layer in range(3):
            channel.begin(layer, hidden, weights, host_ids)
            outs.append(channel.finish().clone())
        return outs

    eager = step()
    graph, outs = capture(step)
    for out in outs:
        out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for layer in range(3):
        assert torch.equal(outs[layer], eager[layer])
        assert bool((outs[layer][host_ids < 0] == 0).all()) and bool((outs[layer][host_ids >= 0] != 0).any())
        expected = host_kernel.expert_routes(hidden.cpu(), banks[layer].w13, banks[layer].w2, weights.cpu(),
                                             host_ids.cpu(), threads=8)
        assert torch.equal(outs[layer].cpu(), expected)
    assert not channel.stalled()


@pytest.mark.parametrize("family, fmt, strategy", [
    ("qwen3_moe", "fp8", "hybrid"), ("qwen3_moe", "int4", "hybrid"), ("qwen3_moe", "mxfp4", "cpu"),
    ("gpt_oss", "bf16", "hybrid"), ("gpt_oss", "mxfp4", "cpu"), ("gpt_oss", "mxfp4", "hybrid"),
])
def test_host_strategies_generate_what_gpu_generates_on_quantized_and_biased_experts(tmp_path, family, fmt, strategy):
    """A tiny Qwen3-MoE in each quantized format (the fp8 and int4 checkpoint layouts; mxfp4 by
    --quantization), and a tiny gpt-oss (expert biases and the clamped SwiGLU) with bf16 or
    mxfp4 experts: the host kernel computes its share of the misses inside the decode graph
    (the exact path, the GPU's arithmetic)."""
    from moeferry import LLM, SamplingParams
    from tests.support.fixtures import family_configs, make_checkpoint, make_fp8_checkpoint, make_int4_checkpoint

    config = dict(family_configs())[family]
    make = {"fp8": lambda p: make_fp8_checkpoint(config, p, seed=3, block_shape=(16, 16)),
            "int4": lambda p: make_int4_checkpoint(config, p, seed=5, group_size=16)}.get(
        fmt, lambda p: make_checkpoint(config, p, seed=7))  # bf16 experts; mxfp4 by --quantization
    make(str(tmp_path))
    common = dict(dtype="bfloat16", device="cuda", max_running_requests=4, num_tokens=4096,
                  **({"quantization": "mxfp4"} if fmt == "mxfp4" else {}))
    options = dict(moe_cache_slots=10, moe_host_share=0.5, moe_collect_stats=True) if strategy == "hybrid" else {}
    prompts = [[5, 17, 33, 2, 9, 71, 40], [88, 3], list(range(10, 50))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    ref = LLM(str(tmp_path), **common).generate(prompts, params)
    llm = LLM(str(tmp_path), moe_strategy=strategy, moe_host_activations="bf16", **common, **options)
    assert llm.engine.runner.strategy.host.channel.compiled
    for want, got in zip(ref, llm.generate(prompts, params)):
        assert_same_until_a_near_tie(want, got)
    stats = llm.engine.runner.strategy.stats()
    assert stats["host_experts"] > 0 and stats["host_kernel"]["calls"] > 0
    if strategy == "hybrid":
        assert stats["decode"]["total"]["misses"] > 0


def test_a_new_split_reaches_the_captured_graphs():
    """The split is a device tensor the route split reads at replay: written by the tuner's
    own path (pinned row, stream-ordered copy) as no host share, decode computes no expert on
    the host; as all of the misses, it does, with the same graphs (none recaptured)."""
    from moeferry import LLM, SamplingParams
    from moeferry.default_model import ensure_default_model

    llm = LLM(ensure_default_model(), max_running_requests=4, moe_strategy="hybrid", moe_cache_slots=48)
    strategy, graphs = llm.engine.runner.strategy, llm.engine.runner.graphs
    tuner = strategy.split.tuner
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(10, 50))]

    def host_experts_with(share: float) -> int:
        tuner.hold(share)
        before = int(strategy.host.experts.sum())
        llm.generate(prompts, params)
        return int(strategy.host.experts.sum()) - before

    assert graphs is not None and graphs.can_run(len(prompts))
    assert host_experts_with(0.0) == 0
    assert host_experts_with(1.0) > 0
    assert llm.engine.runner.graphs is graphs
