"""gpt-oss-20b shapes: decode tokens/s of a dummy model cut to a few layers.

Section gpt-oss/decode: gpt-oss-20b's config in its bf16 form
(tests.support.fixtures.GPT_OSS_20B_DIR_CONFIG: hidden 2880, 64 heads of 64 over 8 kv heads
with sinks, a 128-token window on every other layer, 32 experts of 2880 rows with biases and
the clamped SwiGLU, top-4) with ``--layers`` layers (--hf-overrides num_hidden_layers), dummy
weights, the experts bf16 or ``--quantization`` (mxfp4: the release's format, its own section);
``offload`` and ``hybrid`` with ``--cache-fracs`` of the experts resident, and ``gpu``. Rows,
floor and hit rate as bench_deepseek's decode section (its decode_rows). Routing: --routing (bench_deepseek's
add_decode_flags), the dummy router as it is (near-uniform) by default. At --layers 24 with mxfp4
experts a second table puts each share's fastest batch-1 row beside llama.cpp's decode of the
same shape (LLAMA_CPP_MXFP4_BATCH1).

GPU only: without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from benchmarks.bench_deepseek import add_decode_flags, decode_rows
from benchmarks.common import (MODEL_ROUTING, add_results_flag, command_line, gpu_main, h2d_bandwidth, hbm_bandwidth,
                               markdown_table, report, routed_section, routing_note)
from tests.support.fixtures import GPT_OSS_20B_DIR_CONFIG, write_config_dir

# llama.cpp's llama-bench tg tokens/s on the 24-layer MXFP4 shape (benchmarks/llamacpp_gpt_oss.py: a GGUF
# of random weights, --n-cpu-moe 24 / 18 / 12 / 6 / 0), by share of the experts on the GPU; measured on
# the H100 host on 2026-12-07, beside this benchmark's run of fe80758.
LLAMA_CPP_MXFP4_BATCH1 = {0.0: 40.0, 0.25: 47.8, 0.5: 72.3, 0.75: 115.2, 1.0: 246.4}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_decode_flags(p, layers=4)
    add_results_flag(p)
    args = p.parse_args(argv)
    if args.layers < 1 or args.steps < 1:
        p.error("--layers and --steps must be positive")
    return args


def peer_table(decode: list[list]) -> str:
    """Each share's fastest batch-1 row of `decode` (the section's rows: strategy label, requests,
    tok/s first) beside llama.cpp's figure for that share; "" where no share has both."""
    best: dict[float, tuple[float, str]] = {}
    for label, requests, tok_s, *_ in decode:
        if requests != 1:
            continue
        share = 1.0 if label == "gpu" else int(label.split()[1].rstrip("%")) / 100
        if share in LLAMA_CPP_MXFP4_BATCH1 and float(tok_s) > best.get(share, (0.0, ""))[0]:
            best[share] = (float(tok_s), label.split()[0])
    lines = [[f"{share:.0%}", f"{LLAMA_CPP_MXFP4_BATCH1[share]:.1f}", strategy, f"{tok_s:.1f}",
              f"{tok_s / LLAMA_CPP_MXFP4_BATCH1[share]:.2f}x"] for share, (tok_s, strategy) in sorted(best.items())]
    return markdown_table(["experts on GPU", "llama.cpp MXFP4 tok/s", "moeferry's fastest", "tok/s", "vs llama.cpp"],
                          lines) if lines else ""


def rows(config_dir: str, cfg: dict, args, h2d: float, hbm: float, device_type: str = "cuda") -> list[list]:
    """The section's rows for the model of `config_dir` (its config.json `cfg`) cut to --layers."""
    return decode_rows(config_dir, cfg, args, h2d, hbm, device_type, overrides={"num_hidden_layers": args.layers})


@gpu_main("bench_gpt_oss", parse_args)
def main(argv, args) -> int:
    command = command_line("benchmarks.bench_gpt_oss", argv)
    h2d, hbm = h2d_bandwidth(), hbm_bandwidth()
    cfg_dir = write_config_dir(os.path.join(tempfile.mkdtemp(), "gpt-oss-20b"), GPT_OSS_20B_DIR_CONFIG)
    header = ["strategy", "requests", "tok/s", "ms/step", "floor ms/step", "vs floor", "hit rate",
              "distinct experts/step"]
    experts = ("bf16 experts, the MXFP4 release dequantized; 50 MB each, biases included" if args.quantization is None
               else f"{args.quantization} experts, drawn in bf16 and quantized at load")
    notes = (f"gpt-oss-20b shapes ({experts}) cut to {args.layers} layers of 32 experts, dummy weights, "
             f"prompt {args.prompt_len} tokens, "
             f"{args.warmup} warm-up + {args.steps} timed steps, the fastest of {args.repeats} runs. Measured H2D "
             f"{h2d / 1e9:.1f} GB/s, HBM "
             f"{hbm / 1e12:.2f} TB/s. Floor: missed bytes / H2D + (resident distinct experts + dense weights) / HBM, "
             "with the misses and distinct experts of the offload run with statistics (the gpu row takes the "
             "offload rows' distinct experts; hybrid rows have none). "
             + routing_note(args.routing, args.routing_seed))
    section = routed_section("gpt-oss/decode", args.routing, MODEL_ROUTING) + (
        f"/{args.quantization}" if args.quantization else "")
    decode = rows(cfg_dir, GPT_OSS_20B_DIR_CONFIG, args, h2d, hbm)
    body = markdown_table(header, decode)
    beside = peer_table(decode) if args.quantization == "mxfp4" and args.layers == 24 else ""
    if beside:
        body += ("\n\nBatch 1 beside llama.cpp (llama-bench tg on the same shape, MXFP4 experts, --n-cpu-moe for "
                 "the share):\n\n" + beside)
    report(section, f"gpt-oss-20b-shaped decode tokens/s vs floor{', ' + args.quantization if args.quantization else ''}",
           command, body, notes, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
