"""benchmarks/bench_linear.py on the CPU: its tile candidates are valid configurations, and
without a GPU it says so and exits 0."""

import torch


def test_bench_linear_candidates_and_no_gpu_exit(capsys):
    from benchmarks import bench_linear

    for m in (1, 2, 5, 16):
        configs = list(bench_linear.candidate_configs(m, 2048))
        assert configs and all(c.check() is None for c in configs)
    if not torch.cuda.is_available():
        assert bench_linear.main([]) == 0
        assert "needs a CUDA GPU" in capsys.readouterr().out
