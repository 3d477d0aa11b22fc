"""benchmarks/bench_quant.py's logic on the CPU (its figures need a GPU): arguments, and the
whole measuring loop on a tiny dummy model: every format, share and batch gets a row, the FP8
rows copy about half the bytes per expert (int4 and mxfp4 about a quarter), the hit rate follows the
resident share."""

import pytest
import torch


def test_bench_quant_arguments_and_no_gpu_exit(capsys):
    from benchmarks import bench_quant

    args = bench_quant.parse_args([])
    assert (args.layers, args.batch, args.shares, args.formats) == (12, [1, 4], [0.25, 0.5, 0.75, 1.0],
                                                                    ["bf16", "fp8", "int4", "mxfp4"])
    with pytest.raises(SystemExit):
        bench_quant.parse_args(["--shares", "0"])
    with pytest.raises(SystemExit):
        bench_quant.parse_args(["--formats", "int3"])
    if not torch.cuda.is_available():
        assert bench_quant.main([]) == 0
        assert "no CUDA GPU" in capsys.readouterr().out


def test_bench_quant_runs_end_to_end_on_the_cpu(tmp_path):
    from benchmarks import bench_quant
    from benchmarks.common import markdown_table
    from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

    tiny = dict(QWEN3_30B_DIR_CONFIG, vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4,
                max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
    model_dir = write_config_dir(str(tmp_path / "tiny"), tiny)
    args = bench_quant.parse_args(["--layers", "2", "--steps", "3", "--warmup", "1", "--prompt-len", "4",
                                   "--shares", "0.5", "1.0", "--repeats", "1", "--cache-gb", "0.001", "--batch", "4"])
    records = bench_quant.run(model_dir, args)
    assert [(r["format"], r["share"], r["batch"]) for r in records] == [
        (f, s, 4) for f in ("bf16", "fp8", "int4", "mxfp4") for s in (1.0, 0.5)]
    by_format = {r["format"]: r for r in records}
    unquantized = 3 * 64 * 32 * 4  # float32 on the CPU
    assert by_format["bf16"]["expert_bytes"] == unquantized
    assert by_format["fp8"]["expert_bytes"] == 3 * 64 * 32 + 4 * (2 * 1 * 1 + 1 * 1)  # 128x128 blocks: one each
    assert by_format["int4"]["expert_bytes"] == 3 * 64 * 32 // 2 + 4 * (2 * 32 * 1 + 64 * 1)  # groups of 128
    assert by_format["mxfp4"]["expert_bytes"] == 3 * 64 * 32 // 2 + (2 * 32 * 2 + 64 * 1)  # a byte per 32 values
    assert by_format["fp8"]["experts_in_budget"] > 3.9 * by_format["bf16"]["experts_in_budget"]
    for r in records:
        assert r["slots"] == int(r["share"] * 2 * 16) and r["tok_s"] > 0
        if r["share"] == 1.0:
            assert r["misses"] == 0 and r["distinct"] > 0
    half = [r for r in records if r["share"] == 0.5]
    assert all(r["misses"] > 0 for r in half)  # uniform routing: half the experts resident misses
    rows = bench_quant.table_rows(records, h2d=50e9)
    assert all(len(row) == len(bench_quant.HEADER) for row in rows)
    assert [row[4] for row in rows if row[0] == "float32"] == ["1.00x"] * 2
    table = markdown_table(bench_quant.HEADER, rows)
    header, wide = bench_quant.wide_rows(rows)
    assert len(wide) == len(rows) and all(len(row) == len(header) for row in wide) and "(4 requests)" in header[2]
    assert "fp8 e4m3, 128x128 blocks" in table and "int4 W4A16, groups of 128" in table
    assert "mxfp4 e2m1, e8m0 scales per 32" in table
    assert [row[2] for row in bench_quant.budget_rows(records, 0.001)] == [
        by_format[f]["experts_in_budget"] for f in ("bf16", "fp8", "int4", "mxfp4")]


def test_the_wide_table_joins_each_batchs_cells_in_one_row():
    from benchmarks import bench_quant

    rows = [[fmt, share, batch, f"{tok:.1f}", "1.00x", "1.00", "0.00", "1.00", 8, "9.000"]
            for fmt in ("bf16", "int4") for share in ("100%", "25%") for batch, tok in ((1, 10.0), (4, 30.0))]
    header, wide = bench_quant.wide_rows(rows)
    assert header[:3] == ["format", "resident", "tok/s (1 / 4 requests)"] and header[-2:] == ["slots", "MiB/expert"]
    assert wide[0] == ["bf16", "100%", "10.0 / 30.0", "1.00x / 1.00x", "1.00 / 1.00", "0.00 / 0.00", "1.00 / 1.00",
                       8, "9.000"]
    assert len(wide) == 4
