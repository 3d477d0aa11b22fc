"""Next-layer expert prediction (moeferry/routing/predict.py): how often layer l+1's own router,
applied early to a hidden state of layer l, names the experts layer l+1 then routes to, and
what a prefetch of its guesses would copy for nothing. No training, no weights of its own.

Models: the built-in trained model on held-out Austen (tests/data/austen_heldout.txt, never
trained on), and every family's tiny checkpoint (tests/support/fixtures.py: random
weights, random prompts). Each prompt is prefilled once; every token of every prefill counts,
each consecutive pair of MoE layers. Inputs (predict.INPUTS): `moe_input`, layer l's MoE
input; `residual`, the stream entering layer l+1 under its post-attention norm;
`residual_input_norm`, the same under its input norm; and `fitted`, a linear map from layer
l's MoE input to layer l+1's router scores fitted on other prompts (predict.FittedPredictors:
the built-in model's on the held-out text's first part, evaluated on its last part; the tiny
checkpoints' on other random prompts).

Recall@W = true experts among the W predicted / experts routed (top-k), at W = k and 2k.
Wasted = predicted experts not routed, per token and layer, in experts and in bytes (an
expert's bf16 gate, up and down: 3 x hidden x moe_intermediate x 2 bytes, the model's own; and
at Qwen3-30B-A3B's 9.44 MB, what the same count costs at scale). A prefetch already resident
costs nothing, so these are the most a step's prefetch can waste, not what it does.

Runs on the CPU (a few minutes); `--device cuda` on a GPU.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

import torch

from benchmarks.common import add_results_flag, command_line, markdown_table, pivot, report
from moeferry.routing.predict import fit_on, probe_prefills, windows

DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data"
QWEN3_30B_EXPERT_MB = 3 * 2048 * 768 * 2 / 1e6
FIT_PART = (0.0, 0.6)  # the held-out text's part the fitted predictors see; the rest is measured
# one row per model and input (rows_of); the table has one row per model, a cell per figure
# holding every input's value in INPUTS order
ROW_FIELDS = ["model", "experts, top-k", "layer pairs", "tokens", "input", "recall@k", "wasted experts/token/layer @k",
              "wasted KB/token/layer @k", "at 30B MB @k", "recall@2k", "wasted experts @2k", "at 30B MB @2k"]
SHOWN = ["recall@k", "recall@2k", "wasted experts/token/layer @k", "at 30B MB @k", "wasted experts @2k",
         "at 30B MB @2k"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["builtin", "families"], choices=["builtin", "families"])
    p.add_argument("--prompts", type=int, default=16, help="held-out windows (built-in) or random prompts")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--fit-prompts", type=int, default=200, help="prompts the fitted predictors are fitted on")
    p.add_argument("--fit-hidden", type=int, default=512,
                   help="the built-in model's fitted predictors' MLP width (FittedPredictors.fit_mlp); 0: a "
                        "Linear by ridge regression (FittedPredictors.fit), as the tiny checkpoints' always are")
    p.add_argument("--ridge", type=float, default=1e-3, help="the Linear fit's ridge")
    p.add_argument("--device", default="cpu")
    add_results_flag(p)
    return p.parse_args(argv)


def held_out_prompts(tokenizer, count: int, length: int, part: tuple[float, float] = (0.0, 1.0)) -> list[list[int]]:
    """`count` windows of `length` tokens spread over `part` (fractions of its tokens) of the
    held-out text, as the training recipe streams it (paragraphs separated by a blank line, each
    novel ended by <|endoftext|>)."""
    novels = [n.splitlines() for n in (DATA / "austen_heldout.txt").read_text().strip("\n").split("\n\n")]
    ids = tokenizer("".join("\n\n".join(paras) + "<|endoftext|>" for paras in novels))["input_ids"]
    return windows(ids[int(part[0] * len(ids)):int(part[1] * len(ids))], count, length)


def fitted_on(llm, prompts: list[list[int]], args, hidden: int):
    """FittedPredictors fitted on one prefill of each of `prompts` (an MLP of `hidden`, or with 0
    a Linear by ridge regression)."""
    return fit_on(llm, prompts, hidden, args.ridge).to(args.device)


def fitted_description(args) -> str:
    linear = f"a Linear fitted to the router scores by ridge regression ({args.ridge:g})"
    what = (f"an MLP of {args.fit_hidden} (GELU) trained on the routed experts (binary cross-entropy, full-batch "
            f"Adam)" if args.fit_hidden else linear)
    return (f"fitted: from layer l's MoE input, on {args.fit_prompts} other prompts, for the built-in model {what} "
            f"(fitted on the held-out text's first {FIT_PART[1]:.0%}, measured on the rest), for the tiny "
            f"checkpoints {linear}")


def rows_of(name: str, llm, probe, tokens: int) -> list[list]:
    mc = llm.engine.mc
    k, pairs = mc.top_k, len(probe.pairs)
    expert_kb = 3 * mc.hidden_size * mc.moe_intermediate_size * 2 / 1e3
    rows = []
    for inp in probe.names:
        one, two = probe.counts[inp, k], probe.counts[inp, 2 * k]
        per = max(1, tokens * pairs)
        w1, w2 = one.wasted / per, two.wasted / per
        rows.append([name, f"{mc.num_experts}, {k}", pairs, tokens, inp, f"{one.recall:.3f}", f"{w1:.2f}",
                     f"{w1 * expert_kb:.1f}", f"{w1 * QWEN3_30B_EXPERT_MB:.1f}", f"{two.recall:.3f}", f"{w2:.2f}",
                     f"{w2 * QWEN3_30B_EXPERT_MB:.1f}"])
    return rows


def builtin_rows(args) -> list[list]:
    from moeferry.default_model import DEFAULT_MODEL_NAME
    from moeferry.llm import LLM

    llm = LLM(DEFAULT_MODEL_NAME, device=args.device, dtype="float32", max_prefill_tokens=4 * args.prompt_len)
    fitted = fitted_on(llm, held_out_prompts(llm.tokenizer, args.fit_prompts, args.prompt_len, FIT_PART), args,
                       args.fit_hidden)
    prompts = held_out_prompts(llm.tokenizer, args.prompts, args.prompt_len, (FIT_PART[1], 1.0))
    probe, tokens = probe_prefills(llm, prompts, fitted)
    return rows_of("built-in (trained, held-out Austen)", llm, probe, tokens)


def family_rows(args) -> list[list]:
    from moeferry.llm import LLM
    from tests.support.fixtures import family_configs, make_checkpoint

    rows = []
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in family_configs():
            path = os.path.join(tmp, name)
            make_checkpoint(config, path)
            llm = LLM(path, device=args.device, dtype="float32", max_prefill_tokens=4 * args.prompt_len)
            vocab = llm.engine.mc.vocab_size
            fit = [torch.randint(vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.fit_prompts)]
            prompts = [torch.randint(vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
            probe, tokens = probe_prefills(llm, prompts, fitted_on(llm, fit, args, hidden=0))
            rows += rows_of(f"{name} (tiny, random)", llm, probe, tokens)
            print(rows[-1], flush=True)
            del llm
    return rows


def wide_table(rows: list[list]) -> str:
    """One row per model; each figure's cell lists its value per input, in INPUTS order."""
    groups, inputs = pivot(rows, key=lambda r: tuple(r[:4]), across=lambda r: r[4])
    at = {name: ROW_FIELDS.index(name) for name in SHOWN}
    header = ROW_FIELDS[:4] + [f"{name}: {' / '.join(inputs)}" for name in SHOWN]
    return markdown_table(header, [[*key, *(" / ".join(g[i][at[name]] for i in inputs) for name in SHOWN)]
                                   for key, g in groups.items()])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rows = (builtin_rows(args) if "builtin" in args.models else []) + (
        family_rows(args) if "families" in args.models else [])
    notes = (f"{args.prompts} prompts of {args.prompt_len} tokens per model, one prefill each, on {args.device}, "
             "float32. Predictor: layer l+1's own router on the input named (moeferry/routing/predict.py), its "
             f"top W experts; {fitted_description(args)}. Wasted: predicted experts layer l+1 did not route, "
             "per token and layer pair, and what they weigh at Qwen3-30B-A3B's 9.44 MB an expert. The tiny checkpoints' weights are "
             "random: their figures test the predictor's plumbing on each family's router, not what a trained "
             "model of that family would recall.")
    report("predictor", "Next-layer expert prediction: recall and wasted prefetch",
           command_line("benchmarks.bench_predictor", argv), wide_table(rows), notes, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
