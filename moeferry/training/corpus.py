"""The training corpus: Jane Austen's six novels as Debian's package r-cran-janeaustenr ships
them (the texts are in the public domain; the package is MIT licensed).

The package stores each novel as an R character vector (one hard-wrapped line per element) in
R's lazy-load database (``data/Rdata.rdx`` indexes zlib blocks of ``data/Rdata.rdb``);
``rdata`` (PyPI) reads R's serialization. Lines are joined into paragraphs; ``_word_`` italics
lose their underscores.

Invariant: the split is fixed by the text alone. Each novel's last ``HELD_OUT_FRACTION`` of
paragraphs is held out (``valid.txt``) and never trained on.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import re
import subprocess
import tempfile
import warnings
import zlib

DEBIAN_PACKAGE = "r-cran-janeaustenr"
HELD_OUT_FRACTION = 0.04
NOVEL_SEPARATOR = "\n\n"


def _novel_lines(data_dir: str) -> dict[str, list[str]]:
    """Each novel's lines, read from the package's lazy-load database."""
    import rdata

    def parse(raw: bytes):
        with warnings.catch_warnings():  # a bare serialization stream: rdata says "assumed RDS"
            warnings.simplefilter("ignore")
            return rdata.conversion.convert(rdata.parser.parse_data(raw))

    with open(os.path.join(data_dir, "Rdata.rdx"), "rb") as f:
        index = parse(gzip.decompress(f.read()))
    with open(os.path.join(data_dir, "Rdata.rdb"), "rb") as f:
        database = f.read()
    novels = {}
    for name, (offset, length) in sorted(index["variables"].items()):
        block = database[int(offset):int(offset) + int(length)]
        novels[str(name)] = [str(line) for line in parse(zlib.decompress(block[4:]))]  # 4 bytes: raw length
    return novels


def paragraphs(lines: list[str]) -> list[str]:
    """Blank-line separated paragraphs, each on one line, italics' underscores removed."""
    out, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            out.append(re.sub(r"_", "", " ".join(current)))
            current = []
    return out


def split(novels: dict[str, list[str]]) -> tuple[list[list[str]], list[list[str]]]:
    """(train, held out): per novel, its paragraphs before and after the held-out cut."""
    train, held_out = [], []
    for lines in novels.values():
        paras = paragraphs(lines)
        cut = len(paras) - max(1, int(len(paras) * HELD_OUT_FRACTION))
        train.append(paras[:cut])
        held_out.append(paras[cut:])
    return train, held_out


def word_list(texts) -> list[str]:
    """The distinct lower-case words (letters and inner apostrophes) of ``texts``, sorted."""
    return sorted({w.lower() for t in texts for w in re.findall(r"[A-Za-z]+(?:'[A-Za-z]+)*", t)})


def _download_deb(work: str) -> str:
    subprocess.run(["apt-get", "download", DEBIAN_PACKAGE], cwd=work, check=True, capture_output=True)
    return glob.glob(os.path.join(work, f"{DEBIAN_PACKAGE}_*.deb"))[0]


def build_corpus(out_dir: str, deb: str | None = None) -> dict:
    """Write ``train.txt`` and ``valid.txt`` (paragraphs one per line, novels separated by a
    blank line), ``words.txt`` (every word of the six novels) and ``source.json`` (package,
    its sha256, sizes) into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        deb = deb or _download_deb(work)
        subprocess.run(["dpkg-deb", "-x", deb, work], check=True)
        data_dir = os.path.join(work, "usr/lib/R/site-library/janeaustenr/data")
        novels = _novel_lines(data_dir)
        with open(deb, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    train, held_out = split(novels)
    for name, part in (("train.txt", train), ("valid.txt", held_out)):
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(NOVEL_SEPARATOR.join("\n".join(p) for p in part) + "\n")
    with open(os.path.join(out_dir, "words.txt"), "w") as f:
        f.write("\n".join(word_list(p for n in train + held_out for p in n)) + "\n")
    source = {"debian_package": DEBIAN_PACKAGE, "deb": os.path.basename(deb), "sha256": digest,
              "novels": sorted(novels), "licence": "texts public domain; package MIT",
              "train_chars": sum(len(p) for n in train for p in n),
              "valid_chars": sum(len(p) for n in held_out for p in n)}
    with open(os.path.join(out_dir, "source.json"), "w") as f:
        json.dump(source, f, indent=1)
    return source
