"""benchmarks/bench_structured.py's logic on the CPU (its figures need a GPU): arguments, the
no-GPU exit, and the whole measuring loop on a tiny dummy model with the built-in tokenizer."""

import pytest
import torch


def test_bench_structured_arguments_and_no_gpu_exit(capsys):
    from benchmarks import bench_structured

    args = bench_structured.parse_args([])
    assert (args.layers, args.batch, args.strategy) == (48, [1, 16], "gpu")
    with pytest.raises(SystemExit):
        bench_structured.parse_args(["--steps", "0"])
    if not torch.cuda.is_available():
        assert bench_structured.main([]) == 0
        assert "no CUDA GPU" in capsys.readouterr().out


def test_bench_structured_runs_end_to_end_on_the_cpu(model_cache):
    """Both runs of each batch size on a tiny model: the grammar's requests decode every timed
    step (the schema cannot complete), and the table has its columns."""
    from benchmarks import bench_structured
    from tests.support.fixtures import QWEN3_30B_DIR_CONFIG

    tiny = dict(QWEN3_30B_DIR_CONFIG, vocab_size=4096, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                max_position_embeddings=256, eos_token_id=2, bos_token_id=None)
    model_dir = bench_structured.model_dir_with_tokenizer(tiny)
    args = bench_structured.parse_args(["--layers", "1", "--steps", "3", "--warmup", "1", "--prompt-len", "4",
                                        "--batch", "1", "2", "--repeats", "1"])
    rows = bench_structured.run(model_dir, args)
    assert [r[0] for r in rows] == [1, 2] and all(len(r) == len(bench_structured.HEADER) for r in rows)
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
