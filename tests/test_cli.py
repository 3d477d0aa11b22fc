"""The CLI: flags built from EngineConfig parse to the right types; the main job's command runs."""

import subprocess
import sys

from moeferry.cli import build_parser, engine_config_from_args


def test_engine_flags_parse_to_their_types():
    args = build_parser().parse_args([
        "generate", "--prompt", "x", "--hf-overrides", '{"num_hidden_layers": 2}', "--moe-cache-slots", "64",
        "--moe-prefill-demand-tokens", "auto", "--moe-collect-stats", "--memory-ratio", "0.5"])
    ec = engine_config_from_args(args)
    assert ec.hf_overrides == {"num_hidden_layers": 2}
    assert ec.moe_cache_slots == 64 and ec.moe_prefill_demand_tokens == "auto"
    assert ec.moe_collect_stats is True and ec.memory_ratio == 0.5


def test_generate_on_the_default_model_streams_text(tmp_path):
    env = {"MOEFERRY_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "moeferry.cli", "generate", "--prompt", "Hello", "--max-tokens", "6",
                          "--ignore-eos"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[6 tokens, finish_reason=length]" in out.stderr


def test_a_bad_flag_value_is_a_clear_error(tmp_path):
    env = {"MOEFERRY_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "moeferry.cli", "generate", "--prompt", "Hi", "--moe-strategy", "offload",
                          "--moe-cache-slots", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2
    assert "fewer than one layer's 16" in out.stderr


def test_bench_runs_a_benchmark_from_the_checkout(tmp_path):
    out = subprocess.run([sys.executable, "-m", "moeferry.cli", "bench", "ttft", "--help"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "usage: bench_ttft" in out.stdout and "--thresholds" in out.stdout
