"""bf16 parity on the GPU against HF transformers: for each tiny random
checkpoint of tests.support.fixtures, moeferry in bfloat16 on CUDA against transformers in
float32: the largest logit error over a batch of prompts, beside transformers' own model in
bfloat16 against the same float32 logits (the yardstick: how far bf16 rounding alone moves
this checkpoint), and how many of 24 greedy tokens agree (first divergence, since one
flipped token changes everything after it).

GPU only: without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile

import torch

from benchmarks.common import add_results_flag, command_line, markdown_table, report

PROMPTS = [[5, 17, 33, 2, 9, 71, 40], [88, 3], [12, 60, 61, 62, 7, 1, 90, 45, 23, 30, 31, 8, 19]]


def _agree(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="gpu")
    add_results_flag(p)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_parity: no CUDA GPU, nothing measured")
        return 0
    from moeferry import LLM, SamplingParams
    from tests.support.fixtures import family_configs, make_checkpoint

    rows = []
    for name, config in family_configs():  # every family, DeepSeek and gpt-oss included
        path = tempfile.mkdtemp(prefix=name)
        hf = make_checkpoint(config, path)
        llm = LLM(path, dtype="bfloat16", max_running_requests=4, moe_strategy=args.strategy)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        ours = [o.token_ids for o in llm.generate(PROMPTS, params)]
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
        max_err, hf_bf16_err, agree = 0.0, 0.0, []
        for prompt, toks in zip(PROMPTS, ours):
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0, -1].float()
                hf_bf16_err = max(hf_bf16_err, (hf_bf16(torch.tensor([prompt])).logits[0, -1].float() - ref).abs().max().item())
                gen = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
            first = llm.engine.runner  # last-position logits of the prompt through moeferry, bf16
            from moeferry.scheduler.request import Request

            req = Request(prompt, SamplingParams(max_tokens=1))
            req.pages = first.kv.pool.allocate(first.kv.pages_for(len(prompt)))
            logits = first.run_prefill([(req, len(prompt))]).logits[0].cpu()
            first.kv.pool.release(req.pages)
            max_err = max(max_err, (logits - ref).abs().max().item())
            agree.append(_agree(toks, gen))
        rows.append([name, f"{max_err:.4f}", f"{hf_bf16_err:.4f}", f"{ref.abs().max().item():.2f}",
                     " / ".join(f"{a}/24" for a in agree)])
        print(rows[-1], flush=True)
        del llm
    report("parity", "bf16 parity against HF transformers (float32)", command_line("benchmarks.bench_parity", argv),
           markdown_table(["family", "max abs logit error (last position)", "transformers bf16's own error",
                           "max abs logit", "greedy tokens agreeing before the first divergence, per prompt"], rows),
           "moeferry in bfloat16 on CUDA (CUDA graphs on) vs transformers in float32 on the CPU; tiny random "
           "checkpoints (tests.support.fixtures). The yardstick: transformers' own model cast to bfloat16, on "
           "the CPU, against its float32 logits at the same positions.", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
