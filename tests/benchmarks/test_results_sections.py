"""RESULTS.md regenerated in place: a benchmark's --results replaces its own marked section,
leaves every other line as it was, and adds the section where it is missing."""

import pytest

from benchmarks import common

DOC = """# results

<!-- bench:copy -->
### copy, old
| a |
<!-- /bench:copy -->

<!-- bench:admission/lru -->
### admission lru, old
<!-- /bench:admission/lru -->

## Findings

- a finding
"""


def block(name: str, body: str) -> str:
    return f"<!-- bench:{name} -->\n### {body}\n<!-- /bench:{name} -->\n"


def test_a_section_is_replaced_and_nothing_else_changes():
    new = common.replace_section(DOC, "copy", block("copy", "copy, new"))
    assert new == DOC.replace("### copy, old\n| a |\n", "### copy, new\n")
    assert common.replace_section(new, "copy", block("copy", "copy, new")) == new  # idempotent


def test_a_name_matches_only_its_own_markers():
    new = common.replace_section(DOC, "admission/lru", block("admission/lru", "lru, new"))
    assert "### copy, old" in new and "### lru, new" in new and "lru, old" not in new
    added = common.replace_section(DOC, "admission/layer_lru", block("admission/layer_lru", "layer_lru"))
    assert "### admission lru, old" in added and added.count("<!-- bench:") == 3


def test_a_missing_section_goes_before_the_findings_or_at_the_end():
    new = common.replace_section(DOC, "decode", block("decode", "decode"))
    assert new.index("<!-- /bench:decode -->") < new.index("## Findings")
    assert new.replace(block("decode", "decode") + "\n", "") == DOC
    assert common.replace_section("", "decode", block("decode", "d")) == block("decode", "d")
    assert common.replace_section("# t", "decode", block("decode", "d")) == "# t\n\n" + block("decode", "d")


def test_an_unterminated_section_is_an_error():
    with pytest.raises(ValueError, match="has no"):
        common.replace_section("<!-- bench:copy -->\n### copy\n", "copy", block("copy", "x"))


def test_report_prints_the_section_and_writes_each_results_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOEFERRY_COMMIT", "abc1234")
    current, this_call = tmp_path / "RESULTS.md", tmp_path / "results.md"
    current.write_text(DOC)
    text = common.report("copy", "copy, new", "python -m benchmarks.bench_copy", "| b |\n|---|", "a note",
                         [str(current), str(this_call)])
    assert text in capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "<!-- bench:copy -->" and lines[-1] == "<!-- /bench:copy -->"
    assert lines[1] == "### copy, new"
    assert lines[2].endswith(", commit abc1234: `python -m benchmarks.bench_copy`")
    assert "| b |" in lines and "a note" in lines
    assert current.read_text() == common.replace_section(DOC, "copy", text)
    assert this_call.read_text() == text


def test_the_command_line_leaves_out_where_the_tables_went():
    argv = ["--layers", "12", "--results", "a.md", "b.md", "--batch", "1", "4", "--results=c.md"]
    assert (common.command_line("benchmarks.bench_decode", argv)
            == "python -m benchmarks.bench_decode --layers 12 --batch 1 4")


def test_every_section_of_the_committed_results_is_closed_once_and_on_its_own_line():
    """benchmarks/RESULTS.md as committed: each section starts and ends once, in order, each
    marker on a line of its own (a lost end marker makes the next --results run refuse)."""
    import pathlib
    import re

    lines = (pathlib.Path(common.__file__).parent / "RESULTS.md").read_text().splitlines()
    open_name, seen = None, set()
    for number, line in enumerate(lines, 1):
        marks = re.findall(r"<!-- (/?)bench:(\S+) -->", line)
        if not marks or "`" in line:  # prose naming the markers
            continue
        assert len(marks) == 1 and line.strip() == f"<!-- {marks[0][0]}bench:{marks[0][1]} -->", \
            f"line {number}: a marker shares its line: {line[:80]}"
        closing, name = marks[0]
        if closing:
            assert open_name == name, f"line {number}: closes {name}, open: {open_name}"
            open_name = None
        else:
            assert open_name is None, f"line {number}: opens {name} inside {open_name}"
            assert name not in seen, f"line {number}: {name} twice"
            open_name = name
            seen.add(name)
    assert open_name is None, f"{open_name} is never closed"
