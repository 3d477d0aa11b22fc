"""benchmarks/plot_decode.py reads the figure's numbers from RESULTS.md's hybrid/decode table (one
request per row) and the spec's llama.cpp range, and the README's table under the figure is
the one the script prints."""

import os

import pytest

from benchmarks.plot_decode import ROOT, decode_series, markdown, plot, spec_llama_cpp

RESULTS = open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), encoding="utf-8").read()


def test_the_series_are_the_one_request_rows_of_the_table():
    series = decode_series(RESULTS)
    assert set(series) == {"cpu", "offload", "hybrid", "gpu", "llama.cpp"}
    assert sorted(series["hybrid"]) == [0, 25, 50, 75, 100] and sorted(series["offload"]) == [25, 50, 75]
    rows = [line for line in RESULTS.split("<!-- bench:hybrid/decode -->")[1].splitlines()
            if line.startswith("| 50% | 1 | hybrid |")]
    assert series["hybrid"][50] == float(rows[0].split("|")[4])


def test_the_readme_shows_the_numbers_the_script_prints():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert markdown(decode_series(RESULTS)) in readme
    assert "docs/decode.png" in readme and os.path.isfile(os.path.join(ROOT, "docs", "decode.png"))


def test_the_spec_figures_are_each_ranges_upper_end():
    line = "| BF16 decode tok/s (tg64) | 74-82 | 94-106 | 129-142 | 201-250 | 590-597 |"
    assert spec_llama_cpp(f"text\n{line}\n") == {0: 82.0, 25: 106.0, 50: 142.0, 75: 250.0, 100: 597.0}


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    plot(decode_series(RESULTS), str(tmp_path / "d.png"))
    assert (tmp_path / "d.png").stat().st_size > 1000
