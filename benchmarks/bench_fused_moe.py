"""Fused MoE layer time at Qwen3-30B-A3B shapes (H=2048, I=768, E=128, top-8, bf16), GPU only.

Each row times one MoE layer's grouped GEMM inside a CUDA graph (triton.testing's
do_bench_cudagraph). The graph runs NUM_LAYERS distinct layer banks, each with its own routes,
as a decode step does, so the weights of one layer are not still in L2 when it runs again;
the time per layer is the graph's time / NUM_LAYERS. Achieved bandwidth counts each distinct
expert a layer touches once (9 MiB in bf16), against the H200's ~4.3 TB/s HBM.

    python -m benchmarks.bench_fused_moe [--tokens 1 4 16 64 512] [--results FILE...]
"""
import argparse
import sys
from dataclasses import astuple, dataclass

import torch

from benchmarks.common import add_results_flag, command_line, report


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer's sizes: hidden, intermediate rows per expert, routed experts, top-k."""

    hidden: int
    inter: int
    experts: int
    top_k: int


# The layers the sweeps take (--shape): Qwen3-30B-A3B's, this benchmark's, and gpt-oss-20b's (its
# biases and clamped SwiGLU left out: they move no weight bytes).
SHAPES = {"qwen3": MoEShape(2048, 768, 128, 8), "gpt-oss": MoEShape(2880, 2880, 32, 4)}
HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K = astuple(SHAPES["qwen3"])
EXPERT_BYTES = 3 * HIDDEN * INTERMEDIATE * 2  # gate + up + down, bf16: 9 MiB
HBM_BYTES_PER_S = 4.3e12
NUM_LAYERS = 8


def _make_layers(num_tokens: int, seed: int = 0, shape: MoEShape = SHAPES["qwen3"], device: str = "cuda",
                 count: int = NUM_LAYERS) -> list[tuple]:
    """`count` independent (hidden, w13, w2, weights, ids, out) of `shape` on `device`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, inter, experts = shape.hidden, shape.inter, shape.experts
    layers = []
    for _ in range(count):
        w13 = torch.randn(experts, 2 * inter, h, device=device, generator=gen, dtype=torch.bfloat16) * h ** -0.5
        w2 = torch.randn(experts, h, inter, device=device, generator=gen, dtype=torch.bfloat16) * inter ** -0.5
        hidden = torch.randn(num_tokens, h, device=device, generator=gen, dtype=torch.bfloat16)
        logits = torch.randn(num_tokens, experts, device=device, generator=gen)
        weights, ids = torch.softmax(logits, -1).topk(shape.top_k, dim=-1)
        layers.append((hidden, w13, w2, weights.contiguous(), ids.to(torch.int32).contiguous(),
                       torch.empty_like(hidden)))
    return layers


def _time_per_layer_us(layers: list[tuple], assignment: str) -> float:
    import triton.testing

    from moeferry.kernels.fused_moe import fused_moe

    def step():
        for hidden, w13, w2, weights, ids, out in layers:
            fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=NUM_EXPERTS,
                      block_assignment=assignment, out=out)

    ms = triton.testing.do_bench_cudagraph(step, rep=200, return_mode="median")
    return ms * 1e3 / len(layers)


def _rows(token_counts: list[int]) -> list[str]:
    from moeferry.kernels.fused_moe.triton import naive_allowed

    rows = []
    for num_tokens in token_counts:
        layers = _make_layers(num_tokens)
        distinct = sum(int(ids.unique().numel()) for *_, ids, _ in layers) / len(layers)
        assignments = ["auto"] + (["sorted"] if naive_allowed(num_tokens, TOP_K, NUM_EXPERTS)
                                  else [])
        for assignment in assignments:
            us = _time_per_layer_us(layers, assignment)
            bytes_per_s = distinct * EXPERT_BYTES / (us * 1e-6)
            shown = "naive (auto)" if assignment == "auto" and len(assignments) > 1 else assignment
            rows.append(f"| {num_tokens} | {shown} | {distinct:.1f} | {us:.1f} | "
                        f"{bytes_per_s / 1e12:.2f} | {100 * bytes_per_s / HBM_BYTES_PER_S:.0f}% |")
        del layers
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    add_results_flag(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fused_moe: needs a CUDA GPU; nothing measured.")
        return 0
    header = ["| tokens | blocks | distinct experts | us / layer | TB/s (distinct x 9 MiB) | of 4.3 TB/s |",
              "|---|---|---|---|---|---|"]
    report("fused_moe", f"fused_moe, Qwen3-30B-A3B layer (H={HIDDEN}, I={INTERMEDIATE}, E={NUM_EXPERTS}, "
           f"top-{TOP_K}, bf16)", command_line("benchmarks.bench_fused_moe", argv),
           "\n".join(header + _rows(args.tokens)),
           f"Routes: top-{TOP_K} of random logits (near-uniform); {NUM_LAYERS} distinct layer banks per CUDA "
           f"graph, time per layer.", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
