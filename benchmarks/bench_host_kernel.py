"""The host expert kernel alone, per weight format and activation precision, on the CPU (no GPU
needed): GB/s of the distinct experts' stored bytes (weights and scales) a call reads, and
experts a second, for bf16, fp8, int4 and mxfp4 banks of one Qwen3-30B-A3B-shaped layer (128
experts, H 2048, I 768; 0.3-1.2 GB, beyond the L3), uniform top-8 routing, on the exact path
(bf16 activations against float32 weights) and the int8 path (kernels/fused_moe/host.py
ACTIVATIONS_PRECISIONS; int4 and mxfp4 only). The banks hold random stored codes and scales:
the speed does not depend on the values.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import add_results_flag, command_line, markdown_table, report
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG

FORMATS = ("bf16", "fp8", "int4", "mxfp4")
INT8_FORMATS = ("int4", "mxfp4")  # the formats the int8 activations apply to


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="tokens a call")
    p.add_argument("--calls", type=int, default=10, help="timed calls a row (after 2 untimed)")
    p.add_argument("--experts", type=int, default=QWEN3_30B_DIR_CONFIG["num_experts"],
                   help="experts of the layer (fewer: less memory, but a bank that fits a cache reads faster)")
    p.add_argument("--int4-group", type=int, default=128)
    p.add_argument("--shape", type=int, nargs=2, metavar=("HIDDEN", "INTER"),
                   default=[QWEN3_30B_DIR_CONFIG["hidden_size"], QWEN3_30B_DIR_CONFIG["moe_intermediate_size"]])
    add_results_flag(p)
    return p.parse_args(argv)


def stored_banks(fmt: str, experts: int, hidden: int, inter: int, int4_group: int, gen: torch.Generator) -> dict:
    """Random banks of one layer in `fmt` as make_call takes them (w13, w2 and the scale arguments)."""
    def codes(rows, cols, pack, dtype):
        shape = (experts, rows, -(-cols // pack))
        if dtype == torch.int32:
            return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int32)
        raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        return raw if dtype == torch.uint8 else torch.where((raw & 0x7F) == 0x7F, 0, raw).view(torch.float8_e4m3fn)

    if fmt == "bf16":
        return dict(w13=torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen),
                    w2=torch.empty(experts, hidden, inter, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen))
    dtype, pack, block = {"fp8": (torch.float8_e4m3fn, 1, (128, 128)), "int4": (torch.int32, 8, (1, int4_group)),
                          "mxfp4": (torch.uint8, 2, (1, 32))}[fmt]

    def scales(rows, cols):
        shape = (experts, -(-rows // block[0]), -(-cols // block[1]))
        if fmt == "mxfp4":
            return torch.randint(118, 124, shape, generator=gen, dtype=torch.uint8)
        return torch.rand(shape, generator=gen) * 1e-3

    return dict(w13=codes(2 * inter, hidden, pack, dtype), w2=codes(hidden, inter, pack, dtype),
                w13_scale=torch.cat([scales(inter, hidden), scales(inter, hidden)], dim=1),
                w2_scale=scales(hidden, inter), block_shape=block)


def expert_bytes(banks: dict) -> int:
    """Stored bytes of one expert: its weights and scales."""
    tensors = [banks[k] for k in ("w13", "w2", "w13_scale", "w2_scale") if k in banks]
    return sum(t[0].numel() * t.element_size() for t in tensors)


def timed_calls(banks: dict, threads: int, batch: int, activations: str, calls: int, gen: torch.Generator) -> tuple:
    """(GB/s, experts/s) over `calls` calls of `batch` tokens routed uniformly to top-8 experts,
    after 2 untimed."""
    from moeferry.kernels.fused_moe import host

    w13, w2 = banks["w13"], banks["w2"]
    experts, hidden, inter, top_k = w13.shape[0], w2.shape[1], w13.shape[1] // 2, 8
    scales = {k: banks[k] for k in ("w13_scale", "w2_scale", "block_shape") if k in banks}
    x = torch.randn(batch, hidden, generator=gen).bfloat16()
    weights = torch.full((batch, top_k), 1.0 / top_k)
    out = torch.empty(batch, top_k, hidden, dtype=torch.bfloat16)
    act = torch.empty(batch * top_k, inter, dtype=torch.bfloat16)
    ids = [torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(batch)]).int()
           for _ in range(calls + 2)]
    records = [host.make_call(x, i, weights, out, w13, w2, act, threads, activations=activations, **scales) for i in ids]
    for record in records[:2]:
        host.run(record)
    start = time.perf_counter()
    for record in records[2:]:
        host.run(record)
    seconds = time.perf_counter() - start
    distinct = sum(len(torch.unique(i)) for i in ids[2:])
    return distinct * expert_bytes(banks) / seconds / 1e9, distinct / seconds


def rows(args) -> list[list]:
    from moeferry.kernels.fused_moe import host

    gen = torch.Generator().manual_seed(0)
    table, bf16_rate = [], {}
    for fmt in args.formats:
        banks = stored_banks(fmt, args.experts, *args.shape, args.int4_group, gen)
        for threads in args.threads:
            for batch in args.batch:
                figures = {a: timed_calls(banks, threads, batch, a, args.calls, gen)
                           for a in (["bf16", "int8"] if fmt in INT8_FORMATS else ["bf16"])}
                best = max(rate for _, rate in figures.values())
                if fmt == "bf16":
                    bf16_rate[threads, batch] = best
                base = bf16_rate.get((threads, batch))
                exact, int8 = figures["bf16"], figures.get("int8")
                table.append([fmt, threads, batch, f"{expert_bytes(banks) / 2**20:.2f}", f"{exact[0]:.1f}",
                              f"{int8[0]:.1f}" if int8 else "-", f"{exact[1]:.0f}", f"{int8[1]:.0f}" if int8 else "-",
                              f"{best / base:.2f}x" if base else "-"])
                print(table[-1], flush=True)
        del banks
    print(f"int8 dots: {host.int8_isa()}; AVX512-BF16: {host.has_avx512_bf16()}", flush=True)
    return table


HEADER = ["format", "threads", "tokens", "MiB/expert", "exact GB/s", "int8 GB/s", "exact experts/s",
          "int8 experts/s", "best experts/s vs bf16"]


def main(argv=None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    table = rows(args)
    report("hybrid/host-kernel-formats", "The host expert kernel per weight format", command_line(
        "benchmarks.bench_host_kernel", argv), markdown_table(HEADER, table),
        "One Qwen3-30B-A3B-shaped layer (128 experts, random stored codes), uniform top-8 routing, "
        f"{args.calls} timed calls after 2 untimed; GB/s of the distinct experts' stored bytes (weights and "
        "scales). exact: bf16 activations against weights dequantized to float32; int8: activations quantized "
        "to int8 per group, integer dots (int4, mxfp4).", args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
