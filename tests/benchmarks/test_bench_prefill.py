"""benchmarks/bench_prefill.py's logic on the CPU (its figures need a GPU): arguments, and both
tables' measuring loops on a tiny dummy model; the CPU runs the reference kernels, so only the
bookkeeping is checked."""

import pytest
import torch


def test_bench_prefill_arguments_and_no_gpu_exit(capsys):
    from benchmarks import bench_prefill

    args = bench_prefill.parse_args([])
    assert (args.layers, args.lengths, args.shares) == (12, [512, 4096], [0.25, 0.5, 0.75, 1.0])
    assert (args.system_tokens, args.turns, args.turn_share) == (2000, 8, 0.25)
    if not torch.cuda.is_available():
        assert bench_prefill.main([]) == 0
        assert "no CUDA GPU" in capsys.readouterr().out


@pytest.fixture
def tiny(tmp_path):
    from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

    config = dict(QWEN3_30B_DIR_CONFIG, vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=2,
                  max_position_embeddings=512, eos_token_id=None, bos_token_id=None)
    return write_config_dir(str(tmp_path / "tiny"), config)


def test_the_prefill_table_streams_only_what_is_not_resident(tiny):
    from benchmarks import bench_prefill

    args = bench_prefill.parse_args(["--layers", "2", "--lengths", "24", "40", "--shares", "0.5", "1.0",
                                     "--repeats", "1", "--scatter-steps", "3"])
    records = bench_prefill.prefill_records(tiny, args)
    assert [(r["length"], r["strategy"]) for r in records] == [(24, "gpu"), (40, "gpu")] + [
        (n, "offload") for _ in args.shares for n in (24, 40)]
    expert_bytes = 3 * 64 * 16 * 4  # w13 + w2, float32 on the CPU
    by_share = {(r["share"], r["length"]): r for r in records if r["strategy"] == "offload"}
    assert set(by_share) == {(0.5, 24), (0.5, 40), (1.0, 24), (1.0, 40)}
    for length in (24, 40):
        assert by_share[0.5, length]["bytes"] == 16 * expert_bytes  # the half not resident, every one copied
        assert by_share[1.0, length]["bytes"] == 0
    assert by_share[0.5, 24]["spread"] != "-"
    rows = bench_prefill.prefill_rows(records, h2d=50e9)
    assert all(len(row) == len(bench_prefill.PREFILL_HEADER) for row in rows)
    assert [(row[0], row[1], row[2]) for row in rows] == [
        (n, s, share) for n in (24, 40) for s, share in (("offload", "50%"), ("offload", "100%"), ("gpu", "100%"))]
    assert all(row[-1] == "1.00x" for row in rows if row[1] == "gpu")


def test_the_multi_turn_table_computes_less_with_prefix_caching(tiny):
    from benchmarks import bench_prefill

    args = bench_prefill.parse_args(["--layers", "2", "--system-tokens", "40", "--turns", "3", "--user-tokens", "6",
                                     "--answer-tokens", "5", "--scatter-steps", "2", "--turn-share", "0.5"])
    turns = bench_prefill.multi_turn_records(tiny, args)
    plain, cached = turns[False], turns[True]
    assert [t["prompt"] for t in plain] == [t["prompt"] for t in cached] == [46, 57, 68]
    assert [t["computed"] for t in plain] == [46, 57, 68]
    assert cached[0]["computed"] == 46 and all(t["computed"] <= t["prompt"] - 32 for t in cached[1:])  # two pages hit
    rows = bench_prefill.multi_turn_rows(turns)
    assert [row[0] for row in rows] == [2, 3] and all(len(row) == len(bench_prefill.TURN_HEADER) for row in rows)
