"""benchmarks/bench_gpt_oss.py's logic on the CPU (its figures need a GPU): arguments, and the
decode section's whole loop on a tiny dummy gpt-oss config."""

import pytest
import torch


def test_bench_gpt_oss_arguments_and_no_gpu_exit(capsys):
    from benchmarks import bench_gpt_oss

    args = bench_gpt_oss.parse_args([])
    assert (args.layers, args.cache_fracs, args.strategies) == (4, [0.25, 1.0], ["gpu", "offload"])
    with pytest.raises(SystemExit):
        bench_gpt_oss.parse_args(["--layers", "0"])
    if not torch.cuda.is_available():
        assert bench_gpt_oss.main([]) == 0
        assert "no CUDA GPU" in capsys.readouterr().out


def test_bench_gpt_oss_decode_runs_end_to_end_on_the_cpu(tmp_path):
    """The decode loop (engines per strategy, statistics runs, floors, table rows) on a tiny
    dummy gpt-oss config cut to 2 of its layers; the CPU runs the references."""
    from benchmarks import bench_gpt_oss
    from tests.support.fixtures import GPT_OSS_20B_DIR_CONFIG, write_config_dir

    tiny = dict(GPT_OSS_20B_DIR_CONFIG, vocab_size=128, hidden_size=64, intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=8, sliding_window=8,
                max_position_embeddings=256, eos_token_id=None, pad_token_id=None)
    model_dir = write_config_dir(str(tmp_path / "tiny"), tiny)
    args = bench_gpt_oss.parse_args(["--layers", "2", "--batch", "1", "2", "--steps", "2", "--warmup", "1",
                                     "--prompt-len", "12", "--repeats", "1"])
    rows = bench_gpt_oss.rows(model_dir, tiny, args, h2d=50e9, hbm=4e12, device_type="cpu")
    assert [(r[0], r[1]) for r in rows] == [(s, b) for s in ("offload 100% (16 slots)", "offload 25% (8 slots)",
                                                                "gpu") for b in (1, 2)]
    by = {(r[0], r[1]): r for r in rows}
    assert by["offload 100% (16 slots)", 1][6] == "1.00"
    assert float(by["offload 25% (8 slots)", 2][6]) < 1.0
    assert all(float(r[4]) > 0 for r in rows)


def test_bench_gpt_oss_hybrid_rows_with_mxfp4_experts_on_the_cpu(tmp_path):
    """--strategies hybrid --quantization mxfp4: a hybrid row per share beside gpu, the experts
    quantized at load, no floor for the hybrid rows (their misses split between two channels)."""
    from benchmarks import bench_gpt_oss
    from tests.support.fixtures import GPT_OSS_20B_DIR_CONFIG, write_config_dir

    tiny = dict(GPT_OSS_20B_DIR_CONFIG, vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=8, sliding_window=8,
                max_position_embeddings=256, eos_token_id=None, pad_token_id=None)
    model_dir = write_config_dir(str(tmp_path / "tiny"), tiny)
    args = bench_gpt_oss.parse_args(["--layers", "2", "--batch", "1", "--steps", "2", "--warmup", "1",
                                     "--prompt-len", "12", "--repeats", "1", "--strategies", "hybrid", "gpu",
                                     "--cache-fracs", "0.5", "--quantization", "mxfp4"])
    rows = bench_gpt_oss.rows(model_dir, tiny, args, h2d=50e9, hbm=4e12, device_type="cpu")
    assert [r[0] for r in rows] == ["hybrid 50% (8 slots)", "gpu"]
    assert rows[0][4] == "-" and rows[0][6] == "-" and float(rows[0][2]) > 0
    with pytest.raises(SystemExit):
        bench_gpt_oss.parse_args(["--strategies", "uva"])
    from benchmarks.bench_deepseek import make_engine

    engine = make_engine(model_dir, args, "hybrid", 8, "cpu", {"num_hidden_layers": 2})
    assert engine.runner.strategy.store.format_description().startswith("mxfp4")


def test_the_peer_table_takes_each_shares_fastest_batch_one_row():
    """Beside llama.cpp: per share, the faster of offload and hybrid at one request (batch 4 rows
    and shares llama.cpp has no figure for left out); gpu is the 100% row."""
    from benchmarks.bench_gpt_oss import LLAMA_CPP_MXFP4_BATCH1, peer_table

    decode = [["offload 75% (576 slots)", 1, "250.0", "4.0"], ["offload 75% (576 slots)", 4, "900.0", "4.4"],
              ["hybrid 75% (576 slots)", 1, "240.0", "4.1"], ["hybrid 0% (32 slots)", 1, "42.0", "23.8"],
              ["offload 0% (32 slots)", 1, "28.0", "35.7"], ["hybrid 10% (76 slots)", 1, "60.0", "16.0"],
              ["gpu", 1, "330.0", "3.0"]]
    lines = peer_table(decode).splitlines()
    assert lines[2:] == [f"| 0% | {LLAMA_CPP_MXFP4_BATCH1[0.0]:.1f} | hybrid | 42.0 | {42 / LLAMA_CPP_MXFP4_BATCH1[0.0]:.2f}x |",
                         f"| 75% | {LLAMA_CPP_MXFP4_BATCH1[0.75]:.1f} | offload | 250.0 | "
                         f"{250 / LLAMA_CPP_MXFP4_BATCH1[0.75]:.2f}x |",
                         f"| 100% | {LLAMA_CPP_MXFP4_BATCH1[1.0]:.1f} | gpu | 330.0 | {330 / LLAMA_CPP_MXFP4_BATCH1[1.0]:.2f}x |"]
    assert peer_table([["offload 75% (576 slots)", 4, "900.0"]]) == ""
