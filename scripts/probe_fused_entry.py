"""A MoE layer's entry at decode sizes, one launch against four: 48 calls (one per layer, distinct
inputs and weights, Qwen3-30B-A3B: 2048 wide, 128 experts, top 8, bf16) captured in a CUDA graph
and replayed 20 times, us per call:
  fused     kernels/router.add_norm_route
  separate  norm_rope.fused_add_rms_norm, linear (the skinny GEMV), router.softmax_topk
Checks that both pick the same experts for tie-free logits first.
  python3 scripts/probe_fused_entry.py [--rows 1 2 4]"""
import argparse

import torch

from benchmarks.common import elapsed_us
from moeferry.kernels import linear, norm_rope, router


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--layers", type=int, default=48)
    args = p.parse_args()
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    print(f"{'rows':>4} {'fused us':>9} {'separate us':>12} {'saved us':>9} {'same experts':>13}")
    for t in args.rows:
        layers = [dict(x=torch.randn(t, 2048, device=dev, dtype=bf16), res=torch.randn(t, 2048, device=dev, dtype=bf16) * 4,
                       norm=torch.rand(2048, device=dev, dtype=bf16) + 0.5,
                       gate=torch.randn(128, 2048, device=dev, dtype=bf16) * 0.05,
                       ticket=torch.zeros(1, dtype=torch.int32, device=dev)) for _ in range(args.layers)]

        def fused():
            return [router.add_norm_route(L["x"], L["res"], L["norm"], 1e-6, L["gate"], 8, True, L["ticket"])[3]
                    for L in layers]

        def separate():
            out = []
            for L in layers:
                h, _ = norm_rope.fused_add_rms_norm(L["x"], L["res"], L["norm"], 1e-6)
                out.append(router.softmax_topk(linear.linear(h, L["gate"]), 8, True)[1])
            return out

        times, ids = {}, {}
        for name, fn in (("fused", fused), ("separate", separate), ("fused", fused), ("separate", separate)):
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                result = fn()
            graph.replay()
            torch.cuda.synchronize()
            ids[name] = torch.stack(result)

            def replays(graph=graph):
                for _ in range(20):
                    graph.replay()

            times[name] = min(times.get(name, float("inf")), elapsed_us(replays) / 20 / args.layers)
        same = (ids["fused"].sort(-1).values == ids["separate"].sort(-1).values).all(-1).float().mean().item()
        print(f"{t:>4} {times['fused']:>9.2f} {times['separate']:>12.2f} {times['separate'] - times['fused']:>9.2f} "
              f"{same:>12.0%}")


if __name__ == "__main__":
    main()
