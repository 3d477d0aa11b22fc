"""The README's figure: decode tokens/s of one request by the share of the experts on the GPU,
each moeferry strategy beside llama.cpp, read from benchmarks/RESULTS.md's hybrid/decode section
(bench_hybrid; its llama.cpp column was measured on the same host in the same hold) and, with
--spec, llama.cpp's BF16 figures from the spec's peer table (the upper end of each range).
Writes a PNG (matplotlib: `pip install 'moeferry[plot]'`) and prints the numbers as a Markdown
table.

    python -m benchmarks.plot_decode --out docs/decode.png
"""

from __future__ import annotations

import argparse
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "hybrid/decode"
SHARES = (0, 25, 50, 75, 100)


def section(text: str, name: str) -> str:
    """The body of a RESULTS.md section between its `<!-- bench:NAME -->` markers."""
    match = re.search(rf"<!-- bench:{re.escape(name)} -->(.*?)<!-- /bench:{re.escape(name)} -->", text, re.S)
    if match is None:
        raise ValueError(f"no section {name!r} in RESULTS.md")
    return match.group(1)


def table_rows(body: str) -> list[dict[str, str]]:
    """The first Markdown table of `body` as dicts by column name."""
    lines = [line for line in body.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def decode_series(results_text: str) -> dict[str, dict[int, float]]:
    """{series: {share %: tok/s}} of one request: cpu, offload, hybrid (its 0% row is hybrid with
    one layer of slots), gpu, and llama.cpp from the section's own column."""
    series: dict[str, dict[int, float]] = {}
    for row in table_rows(section(results_text, SECTION)):
        if row["requests"] != "1":
            continue
        share = int(row["experts on GPU"].rstrip("%"))
        name = row["strategy"].split(",")[0]
        series.setdefault(name, {})[share] = float(row["tok/s"])
        if row.get("llama.cpp tok/s", "-") != "-":
            series.setdefault("llama.cpp", {})[share] = float(row["llama.cpp tok/s"])
    return series


def spec_llama_cpp(spec_text: str) -> dict[int, float]:
    """llama.cpp's BF16 decode tok/s by share from the spec's peer table (each range's upper end)."""
    line = next(line for line in spec_text.splitlines() if line.startswith("| BF16 decode tok/s"))
    cells = [c.strip() for c in line.strip("|").split("|")][1:]
    return {share: float(cell.replace(",", "").split("-")[-1]) for share, cell in zip(SHARES, cells)}


def markdown(series: dict[str, dict[int, float]]) -> str:
    lines = ["| decode tok/s, 1 request | " + " | ".join(f"{s}%" for s in SHARES) + " |",
             "|---" * (len(SHARES) + 1) + "|"]
    for name, points in series.items():
        lines.append(f"| {name} | " + " | ".join(f"{points[s]:.0f}" if s in points else "-" for s in SHARES) + " |")
    return "\n".join(lines)


def plot(series: dict[str, dict[int, float]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, points in series.items():
        shares = sorted(points)
        style = {"linestyle": "--", "color": "black"} if name.startswith("llama.cpp") else {}
        ax.plot(shares, [points[s] for s in shares], marker="o", label=name, **style)
    ax.set_xlabel("share of the experts on the GPU (%)")
    ax.set_ylabel("decode tokens/s, one request")
    ax.set_yscale("log")
    ax.set_xticks(SHARES)
    ax.set_title("Qwen3-30B-A3B shape (12 of 48 layers), bf16, H200")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    parser.add_argument("--spec", default=None, help="also plot llama.cpp's BF16 figures from this spec file")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "decode.png"))
    args = parser.parse_args(argv)
    with open(args.results, encoding="utf-8") as f:
        series = decode_series(f.read())
    if args.spec:
        with open(args.spec, encoding="utf-8") as f:
            series["llama.cpp (spec, best of 3 days)"] = spec_llama_cpp(f.read())
    plot(series, args.out)
    print(markdown(series))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
