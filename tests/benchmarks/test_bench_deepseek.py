"""benchmarks/bench_deepseek.py's logic on the CPU (its figures need a GPU): arguments, the
decode section's whole loop on a tiny dummy DeepSeek-V3 config, the MLA section's inputs."""

import pytest
import torch


def test_bench_deepseek_arguments_and_no_gpu_exit(capsys):
    from benchmarks import bench_deepseek

    args = bench_deepseek.parse_args([])
    assert (args.layers, args.dense_layers, args.cache_fracs) == (5, 1, [0.25, 1.0])
    assert args.mla_contexts == [1024, 4096, 16384, 32768] and args.mla_batches == [1, 4, 16, 64]
    with pytest.raises(SystemExit):
        bench_deepseek.parse_args(["--layers", "2", "--dense-layers", "2"])
    if not torch.cuda.is_available():
        assert bench_deepseek.main([]) == 0
        assert "no CUDA GPU" in capsys.readouterr().out


def test_a_quarter_of_the_cut_models_experts_is_one_layers_worth():
    from benchmarks.bench_deepseek import cache_slots

    assert cache_slots(0.25, 4, 256) == 256 and cache_slots(1.0, 4, 256) == 1024
    assert cache_slots(0.25, 2, 256) == 256  # never below one layer's experts


def test_bench_deepseek_decode_runs_end_to_end_on_the_cpu(tmp_path):
    """The decode loop (engines per strategy, statistics runs, floors, table rows) on a tiny
    dummy DeepSeek-V3 config; the CPU runs the references, so only the bookkeeping is checked."""
    from benchmarks import bench_deepseek
    from tests.support.fixtures import DEEPSEEK_V3_DIR_CONFIG, write_config_dir

    tiny = dict(DEEPSEEK_V3_DIR_CONFIG, vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                topk_group=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
    model_dir = write_config_dir(str(tmp_path / "tiny"), tiny)
    args = bench_deepseek.parse_args(["--layers", "3", "--dense-layers", "1", "--batch", "1", "2", "--steps", "2",
                                      "--warmup", "1", "--prompt-len", "4", "--repeats", "1"])
    rows = bench_deepseek.decode_rows(model_dir, tiny, args, h2d=50e9, hbm=4e12, device_type="cpu")
    assert [(r[0], r[1]) for r in rows] == [(s, b) for s in ("offload 100% (32 slots)", "offload 25% (16 slots)",
                                                                "gpu") for b in (1, 2)]
    by = {(r[0], r[1]): r for r in rows}
    assert by["offload 100% (32 slots)", 1][6] == "1.00"  # every expert resident: no miss
    assert float(by["offload 25% (16 slots)", 2][6]) < 1.0  # one layer's slots for two layers: misses
    assert all(float(r[7]) >= 1 for r in rows)  # distinct experts per step known for every row
    assert all(float(r[4]) > 0 for r in rows)


def test_mla_inputs_are_the_v3_shapes_and_count_the_latent_bytes():
    from benchmarks.bench_deepseek import latent_bytes, mla_inputs

    q, cache, table, lens = mla_inputs(3, 40, device="cpu")
    assert q.shape == (3, 128, 576) and cache.shape == ((3 * 3 + 1) * 16, 1, 576) and table.shape == (3, 3)
    assert sorted(table.flatten().tolist()) == list(range(9)) and lens.tolist() == [40] * 3
    assert latent_bytes(3, 40) == 3 * 40 * 576 * 2
