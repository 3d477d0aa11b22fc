"""The decode route GEMV (kernels/fused_moe/gemv.py) against the tensor-core GEMM on the same
naive calls, per weight format, each GEMM timed on its own (us per layer: a CUDA graph over
bench_fused_moe's 8 distinct layer banks) against its floor (the distinct experts' rows of the
bank, weights and scales as stored, over 4.3 TB/s); then whole fused_moe calls both ways.
  python -m benchmarks.sweep_route_gemv [--formats bf16 fp8 int4 mxfp4] [--tokens 1 4]
      [--block-n 4 8 16 32] [--step 16 32 64 128] [--warps 2 4 8] [--int8] [--shape qwen3|gpt-oss]
--int8 times int4's int8 path too (activations quantized per group, dp4a dots: gemv.py) at each
of the GEMV's tiles."""
import argparse
import itertools
from dataclasses import replace

import torch
import triton.testing

from benchmarks.bench_fused_moe import HBM_BYTES_PER_S, SHAPES, _make_layers
from benchmarks.sweep_fused_moe import bank_bytes, gemm_inputs, inputs_top_k, layer_shape, stored_banks, time_gemm
from moeferry.kernels.fused_moe import fused_moe
from moeferry.kernels.fused_moe import gemv
from moeferry.kernels.fused_moe import triton as fm
from moeferry.moe.formats import expert_format


def time_route_gemv(inputs, gated: bool, config: gemv.GemvConfig, block_shape, int8: bool = False) -> float:
    top_k = inputs_top_k(inputs)

    def step():
        for hidden, (w13, s13), (w2, s2), weights, _, flat, act, route_out, _ in inputs:
            if gated:
                gemv.launch_route_gemv(hidden, w13, act, weights, flat, gated=True, weighted=False, a_div=top_k,
                                       scales=s13, block_shape=block_shape, config=config, int8=int8)
            else:
                gemv.launch_route_gemv(act, w2, route_out, weights, flat, gated=False, weighted=True, a_div=1,
                                       scales=s2, block_shape=block_shape, config=config, int8=int8)

    step()
    ms = triton.testing.do_bench_cudagraph(step, rep=40, return_mode="median")
    return ms * 1e3 / len(inputs)


def time_fused_moe(layers, banks, block_shape, route_gemv: bool) -> float:
    experts = layer_shape(layers[0]).experts
    select = fm.select_config
    fm.select_config = lambda *args: replace(select(*args), route_gemv=route_gemv)
    try:
        def step():
            for (hidden, _, _, weights, ids, out), ((w13, s13), (w2, s2)) in zip(layers, banks):
                fused_moe(hidden, w13, w2, weights, ids, num_routed_experts=experts, out=out, w13_scale=s13,
                          w2_scale=s2, block_shape=block_shape)
        step()
        ms = triton.testing.do_bench_cudagraph(step, rep=40, return_mode="median")
    finally:
        fm.select_config = select
    return ms * 1e3 / len(layers)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8", "int4", "mxfp4"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--step", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sweep-tokens", type=int, nargs="+", default=[1], help="token counts that sweep the tiles")
    p.add_argument("--int8", action="store_true", help="int4: time the int8 path too, at every GEMV tile")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3", help="the MoE layer's sizes")
    args = p.parse_args()
    shape = SHAPES[args.shape]
    print(f"{torch.cuda.get_device_name()}; H={shape.hidden}, I={shape.inter}, E={shape.experts}, top-{shape.top_k}, "
          "bf16 activations")
    print("| format | tokens | GEMM | kernel | tiles | us / layer | floor us | of floor |")
    print("|---|---:|---|---|---|---:|---:|---:|")
    whole = []
    for fmt, tokens in itertools.product(args.formats, args.tokens):
        layers = _make_layers(tokens, shape=shape)
        block_shape = None if fmt == "bf16" else expert_format(None, fmt).block_shape
        banks = stored_banks(layers, fmt)
        current = fm.select_config(tokens, shape.top_k, shape.hidden, shape.inter, shape.experts, torch.bfloat16)
        inputs = gemm_inputs(layers, banks, current)
        dot_config = replace(current, route_gemv=False)
        for gated in (True, False):
            distinct = sum(int(ids.unique().numel()) for *_, ids, _ in layers) / len(layers)
            floor_us = distinct * bank_bytes(banks[0][0 if gated else 1]) / HBM_BYTES_PER_S * 1e6
            name = "w13" if gated else "w2"
            bank = banks[0][0 if gated else 1][0]
            stored = bank.dtype
            rows = [("dot", f"{dot_config.block_n}x{dot_config.block_k}", lambda: time_gemm(inputs, gated, dot_config,
                                                                                          block_shape))]
            chosen = gemv.select_gemv_config(gated, stored, gemv.stored_row(bank))
            configs = [chosen]
            if tokens in args.sweep_tokens:
                configs += [gemv.GemvConfig(n, s, w) for n, s, w in itertools.product(args.block_n, args.step, args.warps)
                            if gemv.GemvConfig(n, s, w) != chosen]
            for c in configs:
                label = f"{c.block_n}x{c.step}/{c.num_warps}w" + (" (chosen)" if c == chosen else "")
                rows.append(("gemv", label, lambda c=c: time_route_gemv(inputs, gated, c, block_shape)))
                if args.int8 and fmt == "int4":
                    rows.append(("gemv int8", label, lambda c=c: time_route_gemv(inputs, gated, c, block_shape, True)))
            for kernel, label, run in rows:
                try:
                    us = run()
                    cells = f"{us:.2f} | {floor_us:.2f} | {floor_us / us:.0%}"
                except Exception as e:  # noqa: BLE001 (out of resources): the row says so
                    cells = f"{type(e).__name__} | {floor_us:.2f} | -"
                print(f"| {fmt} | {tokens} | {name} | {kernel} | {label} | {cells} |", flush=True)
        whole.append((fmt, tokens, time_fused_moe(layers, banks, block_shape, False),
                      time_fused_moe(layers, banks, block_shape, True)))
        del layers, banks, inputs
        torch.cuda.empty_cache()
    print("\n| format | tokens | fused_moe us / layer, tensor cores | route GEMV | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for fmt, tokens, dot_us, gemv_us in whole:
        print(f"| {fmt} | {tokens} | {dot_us:.2f} | {gemv_us:.2f} | {dot_us / gemv_us:.2f}x |")


if __name__ == "__main__":
    main()
