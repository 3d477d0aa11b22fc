"""The documents stay true to the tree: every docs page that the README, the docs, the package
or the benchmarks name exists; the architecture page stays a map; every section of
benchmarks/RESULTS.md names its date, GPU, commit and the command that produced it."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def texts():
    for pattern in ["README.md", "docs/*.md", "benchmarks/*.md", "benchmarks/*.py", "moeferry/**/*.py", "scripts/*"]:
        for path in ROOT.glob(pattern):
            yield path, path.read_text(encoding="utf-8", errors="replace")


def test_every_docs_page_named_anywhere_exists():
    missing = {(str(path.relative_to(ROOT)), page) for path, text in texts()
               for page in re.findall(r"docs/[A-Za-z_]+\.md", text) if not (ROOT / page).is_file()}
    assert missing == set()


def test_the_architecture_page_is_a_map_of_at_most_200_lines():
    assert len((ROOT / "docs/architecture.md").read_text().splitlines()) <= 200


def test_every_results_section_names_its_date_gpu_commit_and_command():
    lines = (ROOT / "benchmarks/RESULTS.md").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if re.fullmatch(r"<!-- bench:\S+ -->", line)]
    assert starts
    for i in starts:
        assert lines[i + 1].startswith("### "), lines[i]
        assert re.fullmatch(r"\d{4}-\d\d-\d\d, .+, commit \w+: `python -m benchmarks\.\w+.*`", lines[i + 2]), lines[i]
