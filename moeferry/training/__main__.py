"""`python -m moeferry.training corpus|tokenizer|train|export`: the built-in model's recipe,
one stage per command (each stage's output is the next one's input)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from moeferry.training.train import Architecture, Recipe


def _overrides(kind, text: str | None):
    return kind(**json.loads(text)) if text else kind()


def _corpus(args):
    from moeferry.training.corpus import build_corpus

    print(json.dumps(build_corpus(args.out, args.deb), indent=1))


def _tokenizer(args):
    from moeferry.default_model import build_tokenizer

    with open(os.path.join(args.corpus, "train.txt")) as f:
        build_tokenizer(f.read().splitlines(), args.out, Architecture().vocab_size)


def _train(args):
    from moeferry.training.train import train

    summary = train(args.corpus, os.path.join(args.tokenizer, "tokenizer.json"), args.out,
                    _overrides(Architecture, args.arch), _overrides(Recipe, args.recipe), args.device)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}))


def _export(args):
    from safetensors.torch import load_file

    from moeferry.training.export import write_checkpoint

    with open(os.path.join(args.trained, "train_log.json")) as f:
        log = json.load(f)
    arch = Architecture(**log["architecture"])
    generation = json.loads(args.generation) if args.generation else None
    write_checkpoint(load_file(os.path.join(args.trained, "weights.safetensors")), arch, args.out, args.tokenizer,
                     generation)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moeferry.training", description=__doc__)
    sub = parser.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("corpus", help="extract the Austen corpus from Debian's r-cran-janeaustenr")
    p.add_argument("--out", required=True, help="folder for train.txt, valid.txt, source.json")
    p.add_argument("--deb", default=None, help="the .deb, if already downloaded (default: apt-get download)")
    p.set_defaults(func=_corpus)
    p = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer on train.txt")
    p.add_argument("--corpus", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_tokenizer)
    p = sub.add_parser("train", help="train the model (a GPU: minutes; a CPU: a smoke test)")
    p.add_argument("--corpus", required=True)
    p.add_argument("--tokenizer", required=True, help="folder holding tokenizer.json")
    p.add_argument("--out", required=True, help="folder for weights.safetensors and train_log.json")
    p.add_argument("--arch", default=None, help=f"JSON overrides of {[f.name for f in dataclasses.fields(Architecture)]}")
    p.add_argument("--recipe", default=None, help=f"JSON overrides of {[f.name for f in dataclasses.fields(Recipe)]}")
    p.add_argument("--device", default="cuda")
    p.set_defaults(func=_train)
    p = sub.add_parser("export", help="write the trained weights as a transformers checkpoint")
    p.add_argument("--trained", required=True, help="the train stage's --out")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--generation", default=None, help="generation_config.json's content, as JSON")
    p.set_defaults(func=_export)
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
