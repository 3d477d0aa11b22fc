"""benchmarks/bench_uva.py's logic on the CPU (its figures need a GPU): arguments, the skewed
router's bias, and the whole measuring loop on a tiny dummy model."""

import pytest
import torch


def test_bench_uva_arguments_and_no_gpu_exit(capsys):
    from benchmarks import bench_uva

    args = bench_uva.parse_args([])
    assert (args.layers, args.batch, args.routings) == (48, [1, 2, 3, 4, 8, 16], ["uniform", "skewed"])
    assert bench_uva.parse_args(["--layers", "12", "--steps", "3", "--batch", "2", "4"]).batch == [2, 4]
    with pytest.raises(SystemExit):
        bench_uva.parse_args(["--steps", "0"])
    if not torch.cuda.is_available():
        assert bench_uva.main([]) == 0
        assert "no CUDA GPU" in capsys.readouterr().out


def test_bench_uva_zipf_bias_is_log_of_zipf_probabilities():
    from benchmarks.bench_uva import zipf_bias

    bias = zipf_bias(128, 1.1, seed=3)
    p = bias.double().exp().sort(descending=True).values
    assert p.sum() == pytest.approx(1.0)
    assert float(p[0] / p[1]) == pytest.approx(2 ** 1.1, rel=1e-5)
    assert float(p[0] / p[127]) == pytest.approx(128 ** 1.1, rel=1e-4)
    assert not torch.equal(bias, zipf_bias(128, 1.1, seed=4))  # each layer its own hot experts


def test_bench_uva_runs_end_to_end_on_the_cpu(tmp_path):
    """The whole measuring loop (engines, skew hooks, path switches, counters, table) on a
    tiny dummy model; the CPU runs the reference kernels, so only the bookkeeping is checked."""
    from benchmarks import bench_uva
    from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

    tiny = dict(QWEN3_30B_DIR_CONFIG, vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=32, num_experts_per_tok=2,
                max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
    model_dir = write_config_dir(str(tmp_path / "tiny"), tiny)
    args = bench_uva.parse_args(["--layers", "2", "--steps", "2", "--warmup", "1", "--prompt-len", "4"])
    records, expert_bytes = bench_uva.run(model_dir, args)
    assert expert_bytes == 3 * 64 * 16 * 4
    for routing in ("uniform", "skewed"):
        rows = bench_uva.table_rows(records, routing, expert_bytes, h2d=50e9)
        assert [(r[0], r[1]) for r in rows] == [(s, b) for s in ("uva naive", "uva sorted", "offload 50%")
                                                for b in args.batch]
        assert all(len(r) == len(bench_uva.HEADER) for r in rows)
        naive = {r[1]: r for r in rows if r[0] == "uva naive"}
        assert naive[8][2] == naive[16][2] == "n/a" and naive[4][2] != "n/a"  # 8 * 2 * 4 > 32
    by_key = {(r["routing"], r["strategy"], r["requests"]): r for r in records}
    for b in (1, 2, 4):
        sorted_run, naive_run = by_key["uniform", "uva sorted", b], by_key["uniform", "uva naive", b]
        assert naive_run["reads"] == naive_run["routes"] == sorted_run["routes"] == 2 * b * 2  # one read per route
        assert sorted_run["reads"] <= sorted_run["routes"]
    skewed = [by_key["skewed", "uva sorted", b]["reads"] for b in (8, 16)]
    uniform = [by_key["uniform", "uva sorted", b]["reads"] for b in (8, 16)]
    assert sum(skewed) < sum(uniform)  # the hooks concentrate routing on few experts
