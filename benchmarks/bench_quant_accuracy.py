"""Accuracy per expert format: the built-in trained model
(moeferry-tiny-moe) with its routed experts unquantized, in block FP8, in int4 W4A16 and in
MXFP4 (`--quantization`), its perplexity on held-out text (tests/data/austen_heldout.txt: text the
model never trained on) and the largest logit difference from the unquantized model.

The whole held-out text runs through the engine's own forward in windows of `--window` tokens
(one prefill each, every position's logits), on the CPU in float32 by default (the reference
kernels) or on a GPU (the Triton kernels, bf16). Target: perplexity within +1% of
unquantized for fp8, +5% for int4 (and for mxfp4, the other 4-bit format).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import add_results_flag, command_line, markdown_table, report
from moeferry.moe.formats import QUANTIZATIONS

HELD_OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "austen_heldout.txt"
HEADER = ["format", "bytes/expert", "held-out perplexity", "vs unquantized", "max abs logit diff", "mean abs logit diff"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=list(QUANTIZATIONS), choices=list(QUANTIZATIONS))
    p.add_argument("--window", type=int, default=256, help="tokens per forward")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first this many held-out tokens")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--host", action="store_true",
                   help="instead: the host expert kernel (`cpu` strategy, bf16) on int4 and mxfp4 experts with bf16 "
                        "and int8 activations, each against the format's device path in bf16 (section "
                        "quant-accuracy/host; runs on the CPU)")
    add_results_flag(p)
    return p.parse_args(argv)


def held_out_ids(tokenizer, max_tokens: int | None) -> torch.Tensor:
    """The held-out text as the training recipe streams it: paragraphs separated by a blank line,
    each novel ended by <|endoftext|>."""
    novels = [n.splitlines() for n in HELD_OUT.read_text().strip("\n").split("\n\n")]
    text = "".join("\n\n".join(paras) + "<|endoftext|>" for paras in novels)
    ids = torch.tensor(tokenizer(text)["input_ids"])
    return ids if max_tokens is None else ids[:max_tokens + 1]


def window_logits(engine, ids: list[int]) -> torch.Tensor:
    """float32 logits [len(ids), V] of one prefill of `ids` through the engine's forward."""
    from moeferry.sampling import SamplingParams
    from moeferry.scheduler.request import Request

    runner = engine.runner
    req = Request(ids, SamplingParams(max_tokens=1))
    req.pages = runner.kv.pool.allocate(runner.kv.pages_for(len(ids)))
    try:
        batch = runner.prefill_batch([(req, len(ids))])
        batch.logits_rows = torch.arange(batch.num_rows, device=batch.input_ids.device)
        return runner.forward(batch).float().cpu()
    finally:
        runner.kv.pool.release(req.pages)


def score(llm, ids: torch.Tensor, window: int) -> tuple[float, list[torch.Tensor]]:
    """(perplexity of every next token, the logits of every window)."""
    nll, count, logits = 0.0, 0, []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        out = window_logits(llm.engine, chunk[:-1].tolist())
        nll += F.cross_entropy(out, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
        logits.append(out)
    return math.exp(nll / count), logits


def run(args) -> list[list]:
    from moeferry import LLM

    dtype = "float32" if args.device == "cpu" else "bfloat16"
    rows, base = [], None
    for fmt in [None, *args.formats]:
        llm = LLM(None, quantization=fmt, device=args.device, dtype=dtype, max_running_requests=1,
                  max_model_len=args.window + 8, num_tokens=args.window + 64)
        ids = held_out_ids(llm.tokenizer, args.max_tokens)
        ppl, logits = score(llm, ids, args.window)
        strategy = llm.engine.runner.strategy
        if base is None:
            base = (ppl, logits)
        diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(logits, base[1])])
        rows.append([strategy.format_description(), strategy.expert_bytes, f"{ppl:.3f}",
                     f"{100 * (ppl / base[0] - 1):+.2f}%", f"{diffs.max().item():.4f}", f"{diffs.mean().item():.5f}"])
        print(rows[-1], flush=True)
        del llm
    return rows


HOST_HEADER = ["format", "host activations", "device path perplexity", "host perplexity", "vs device path",
               "max abs logit diff", "mean abs logit diff"]


def host_rows(args) -> list[list]:
    """Per 4-bit format: the held-out perplexity through the host expert kernel (the `cpu`
    strategy, every prefill chunk on demand, so the host kernel computes every route) with
    each activation precision, against the same format's device path (`gpu`), both bf16."""
    from moeferry import LLM

    common = dict(device="cpu", dtype="bfloat16", max_running_requests=1, max_model_len=args.window + 8,
                  num_tokens=args.window + 64)
    rows = []
    for fmt in [f for f in args.formats if f in ("int4", "mxfp4")]:
        device_path = LLM(None, quantization=fmt, **common)
        ids = held_out_ids(device_path.tokenizer, args.max_tokens)
        base_ppl, base_logits = score(device_path, ids, args.window)
        described = device_path.engine.runner.strategy.format_description()
        del device_path
        for activations in ("bf16", "int8"):
            llm = LLM(None, quantization=fmt, moe_strategy="cpu", moe_host_activations=activations,
                      moe_prefill_demand_tokens=args.window, **common)
            ppl, logits = score(llm, ids, args.window)
            diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(logits, base_logits)])
            rows.append([described, activations, f"{base_ppl:.3f}", f"{ppl:.3f}", f"{100 * (ppl / base_ppl - 1):+.2f}%",
                         f"{diffs.max().item():.4f}", f"{diffs.mean().item():.5f}"])
            print(rows[-1], flush=True)
            del llm
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_quant_accuracy: --device cuda asked for; no CUDA GPU found, nothing measured.")
        return 0
    command = command_line("benchmarks.bench_quant_accuracy", argv)
    if args.host:
        notes = (f"moeferry-tiny-moe (the built-in trained model), bf16, on the CPU; held-out text in windows of "
                 f"{args.window} tokens, every chunk's routes on the host kernel (`cpu`, "
                 "--moe-prefill-demand-tokens at the window); device path: `gpu`, the same format, torch's "
                 "reference kernels in bf16. int8: activations quantized per token and group of the weights' "
                 "scales, integer dots (kernels/fused_moe/host_experts.cpp). Target: the int8 path within +1% "
                 "of the device path.")
        report("quant-accuracy/host", "Accuracy of the host expert kernel's activation precisions", command,
               markdown_table(HOST_HEADER, host_rows(args)), notes, args.results)
        return 0
    rows = run(args)
    notes = (f"moeferry-tiny-moe (the built-in trained model), its routed experts in each format, dense weights "
             f"unquantized; {args.device}, {'float32 reference kernels' if args.device == 'cpu' else 'bf16 Triton'}; "
             f"held-out text in windows of {args.window} tokens; logit differences against the unquantized row over "
             f"every position. Target: perplexity <= +1% (fp8), <= +5% (int4, mxfp4).")
    report("quant-accuracy", "Accuracy per expert format", command,
           markdown_table(HEADER, rows), notes, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
