"""The benchmarks run as modules from the repository root (``python -m benchmarks.NAME``), with
the test fixtures they import; ``python -m benchmarks`` lists every one and what it measures;
the installed command has no way into them."""

import glob
import os
import subprocess
import sys

from benchmarks import BENCHMARKS, listing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_listing_names_every_benchmark_module_and_what_it_measures():
    modules = {os.path.basename(p)[len("bench_"):-3] for p in glob.glob(os.path.join(ROOT, "benchmarks", "bench_*.py"))}
    assert set(BENCHMARKS) == modules
    text = listing()
    for name, what in BENCHMARKS.items():
        assert f"  {name} " in text and what.split()[0] in text


def test_a_benchmark_runs_as_a_module_from_the_repository_root():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_ttft", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert "--thresholds" in out.stdout


def test_the_installed_command_has_no_bench_subcommand(capsys):
    from moeferry.cli import build_parser

    try:
        build_parser().parse_args(["bench", "ttft"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("moeferry bench parsed")
    assert "invalid choice: 'bench'" in capsys.readouterr().err
