"""Tile sweep for the fused MoE's two GEMMs at decode sizes, each timed on its own: us per
layer (a CUDA graph over bench_fused_moe's 8 distinct layer banks) against the floor, the
bytes of the distinct experts' rows of that bank (weights and scales as stored) over 4.3 TB/s.
  python -m benchmarks.sweep_fused_moe [--format bf16|fp8|int4|mxfp4] [--tokens 1 4]
      [--block-n 16 32 64] [--block-k 128 256] [--warps 2 4] [--stages 3 5] [--shape qwen3|gpt-oss]
4-bit formats try every tile with and without split-field dots (FusedMoEConfig.split_fields),
MXFP4 its split tiles both ways: int32 words (FusedMoEConfig.mxfp4_words; K tiles of
--block-k) and bytes (one 32-value scale block a tile). The "K tile" column says what ran and
how deep: one dot over the values in K order, or split fields over words or bytes."""
import argparse
import itertools
from dataclasses import replace

import torch
import triton.testing

from benchmarks.bench_fused_moe import HBM_BYTES_PER_S, SHAPES, MoEShape, _make_layers
from moeferry.kernels.fused_moe import triton as fm
from moeferry.moe.formats import QUANTIZATIONS, expert_format, quantize


def stored_banks(layers, format_name: str):
    """Per layer: ((w13, w13 scales), (w2, w2 scales)) in `format_name`; scales None for bf16."""
    if format_name == "bf16":
        return [((w13, None), (w2, None)) for _, w13, w2, *_ in layers]
    fmt = expert_format(None, format_name)
    return [(quantize(w13, fmt), quantize(w2, fmt)) for _, w13, w2, *_ in layers]


def bank_bytes(bank) -> int:
    """Bytes of one expert's rows of a stored bank, weights and scales."""
    return sum(t[0].numel() * t.element_size() for t in bank if t is not None)


def layer_shape(layer) -> MoEShape:
    """The sizes of one of _make_layers' layers, read off its tensors."""
    _, w13, w2, _, ids, _ = layer
    return MoEShape(hidden=w2.shape[1], inter=w2.shape[2], experts=w13.shape[0], top_k=ids.shape[1])


def gemm_inputs(layers, banks, config):
    """Per layer: (hidden, w13 bank, w2 bank, route weights, blocks, flat ids, act, route_out, naive)."""
    out = []
    for layer, (b13, b2) in zip(layers, banks):
        (hidden, w13, w2, weights, ids, _), shape = layer, layer_shape(layer)
        flat = ids.reshape(-1).contiguous()
        assignment = fm.choose_block_assignment(hidden.shape[0], shape.top_k, shape.experts, w13, w2)
        blocks = fm._route_blocks(flat, w13.shape[0], shape.experts, assignment, config.block_m)
        act = torch.randn(flat.numel(), shape.inter, device=hidden.device, dtype=hidden.dtype)
        route_out = torch.empty(flat.numel(), shape.hidden, device=hidden.device, dtype=hidden.dtype)
        out.append((hidden, b13, b2, weights.reshape(-1).float(), blocks, flat, act, route_out,
                    assignment == "naive"))
    return out


# Per format, the (split_fields, mxfp4_words) pairs a sweep tries for every tile.
TILE_KINDS = {"int4": [(False, False), (True, False)], "mxfp4": [(False, False), (True, False), (True, True)]}


def k_tile(inputs, gated: bool, config, block_shape) -> tuple[str, int]:
    """What a K tile of the first layer's bank runs as under `config` (fused_moe's own choice),
    and its depth."""
    hidden, (w13, s13), (w2, s2), *_, act, _, _ = inputs[0]
    a, bank = (hidden, w13) if gated else (act, w2)
    tiles, stored = fm._k_tiles(config, a, bank, block_shape is not None, block_shape)
    if not fm._splits_fields(tiles, fm._pack(stored)):
        return "one dot", tiles.block_k
    return ("bytes" if stored.dtype == torch.uint8 else "words"), tiles.block_k


def inputs_top_k(inputs) -> int:
    """Routes a token of gemm_inputs' layers: their flat ids over their tokens."""
    hidden, *_, flat, _, _, _ = inputs[0]
    return flat.numel() // hidden.shape[0]


def time_gemm(inputs, gated: bool, config, block_shape) -> float:
    top_k = inputs_top_k(inputs)

    def step():
        for hidden, (w13, s13), (w2, s2), weights, blocks, flat, act, route_out, naive in inputs:
            if gated:
                fm._launch_gemm(hidden, w13, act, weights, blocks, flat, gated=True, weighted=False,
                                a_div=top_k, naive=naive, config=config, scales=s13, block_shape=block_shape)
            else:
                fm._launch_gemm(act, w2, route_out, weights, blocks, flat, gated=False, weighted=True,
                                a_div=1, naive=naive, config=config, scales=s2, block_shape=block_shape)

    step()
    ms = triton.testing.do_bench_cudagraph(step, rep=40, return_mode="median")
    return ms * 1e3 / len(inputs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--format", default="bf16", choices=["bf16", *QUANTIZATIONS])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--block-k", type=int, nargs="+", default=[128, 256])
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    p.add_argument("--stages", type=int, nargs="+", default=[3, 5])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3", help="the MoE layer's sizes")
    args = p.parse_args()
    shape = SHAPES[args.shape]
    block_shape = None if args.format == "bf16" else expert_format(None, args.format).block_shape
    print(f"{torch.cuda.get_device_name()}; H={shape.hidden}, I={shape.inter}, E={shape.experts}, top-{shape.top_k}, "
          f"{args.format} experts, bf16 activations")
    print("| tokens | GEMM | block_n | K tile | warps | stages | us / layer | floor us | of floor |")
    print("|---:|---|---:|---|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        layers = _make_layers(tokens, shape=shape)
        distinct = sum(int(ids.unique().numel()) for *_, ids, _ in layers) / len(layers)
        current = fm.select_config(tokens, shape.top_k, shape.hidden, shape.inter, shape.experts, torch.bfloat16)
        banks = stored_banks(layers, args.format)
        inputs = gemm_inputs(layers, banks, current)
        for gated in (True, False):
            floor_us = distinct * bank_bytes(banks[0][0 if gated else 1]) / HBM_BYTES_PER_S * 1e6
            name = "w13 (gate+up)" if gated else "w2 (down)"
            kinds = TILE_KINDS.get(args.format, [(False, False)])
            configs = [current] + [
                fm.FusedMoEConfig(current.block_m, n, k, current.group_m, w, s, split_fields=split, mxfp4_words=words)
                for n, k, w, s, (split, words) in itertools.product(args.block_n, args.block_k, args.warps,
                                                                    args.stages, kinds)]
            seen = set()
            for i, config in enumerate(configs):
                kind, depth = k_tile(inputs, gated, config, block_shape)
                ran = (replace(config, block_k=depth, split_fields=kind != "one dot", mxfp4_words=kind == "words"),
                       config.stages(gated))
                if i > 0 and ran in seen:  # byte tiles are 32 deep whatever --block-k asked
                    continue
                seen.add(ran)
                try:
                    us = f"{time_gemm(inputs, gated, config, block_shape):.2f}"
                    share = f"{floor_us / float(us):.0%}"
                except Exception as e:  # noqa: BLE001 (out of shared memory, say): the row says so
                    us, share = type(e).__name__, "-"
                label = " (current)" if i == 0 else ""
                print(f"| {tokens} | {name}{label} | {config.block_n} | {kind} {depth} | {config.num_warps} "
                      f"| {config.stages(gated)} | {us} | {floor_us:.2f} | {share} |", flush=True)
        del layers, banks, inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
