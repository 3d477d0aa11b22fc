"""gpt-oss-20b shapes: decode tokens/s of a dummy model cut to a few layers.

Section gpt-oss/decode: gpt-oss-20b's config in its bf16 form
(tests.support.fixtures.GPT_OSS_20B_DIR_CONFIG: hidden 2880, 64 heads of 64 over 8 kv heads
with sinks, a 128-token window on every other layer, 32 experts of 2880 rows with biases and
the clamped SwiGLU, top-4) with ``--layers`` layers (--hf-overrides num_hidden_layers), dummy
weights, the experts bf16 or ``--quantization`` (mxfp4: the release's format, its own section);
``offload`` and ``hybrid`` with ``--cache-fracs`` of the experts resident, and ``gpu``. Rows,
floor and hit rate as bench_deepseek's decode section (its decode_rows). Routing: --routing (bench_deepseek's
add_decode_flags), the dummy router as it is (near-uniform) by default.

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


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_decode_flags(p, layers=4)
    add_results_flag(p)
    args = p.parse_args(argv)
    if args.layers < 1 or args.steps < 1:
        p.error("--layers and --steps must be positive")
    return args


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
    report(section, f"gpt-oss-20b-shaped decode tokens/s vs floor{', ' + args.quantization if args.quantization else ''}",
           command, markdown_table(header, rows(cfg_dir, GPT_OSS_20B_DIR_CONFIG, args, h2d, hbm)), notes, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
