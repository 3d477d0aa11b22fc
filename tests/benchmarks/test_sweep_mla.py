"""benchmarks/sweep_mla.py's logic on the CPU (its figures need a GPU): arguments, the tile grid
with select_config's choice first, the dry listing, the fastest tile per shape, the no-GPU exit."""

import pytest
import torch


def test_sweep_mla_arguments_grid_and_dry_listing(capsys):
    from benchmarks import sweep_mla
    from moeferry.kernels.mla.triton import select_config

    args = sweep_mla.parse_args([])
    assert args.shapes == [(1, 4096), (1, 32768), (16, 4096), (64, 4096), (64, 32768)] and args.grid == "quick"
    tiles = sweep_mla.shape_tiles(args, 64, 4096)
    assert tiles[0] == select_config(64, 128, 512, 4096) and len(tiles) == len(set(tiles))
    full = sweep_mla.parse_args(["--grid", "full", "--shapes", "2x1024", "--warps", "8", "--stages", "2"])
    assert full.shapes == [(2, 1024)] and len(sweep_mla.tiles(full)) == 2 * 3 * 3
    with pytest.raises(SystemExit):
        sweep_mla.parse_args(["--grid", "full", "--block-n", "128"])
    assert sweep_mla.main(["--dry", "--shapes", "1x4096"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].endswith("(default)") and len(listed) == len(sweep_mla.shape_tiles(args, 1, 4096))
    if not torch.cuda.is_available():
        assert sweep_mla.main([]) == 0
        assert "no CUDA GPU" in capsys.readouterr().out


def test_the_fastest_timed_tile_per_shape_beside_the_default():
    from benchmarks.sweep_mla import best_rows

    rows = [[1, 4096, "a (default)", 16, "30.0", "5%", "10", "0.01"],
            [1, 4096, "b", 16, "20.0", "8%", "15", "0.01"],
            [1, 4096, "c", 16, "-", "-", "-", "OutOfResources"],
            [64, 4096, "a (default)", 2, "-", "-", "-", "9 MISMATCH"]]
    assert best_rows(rows) == [[1, 4096, "b", "20.0", "8%", "15", "30.0"]]


def test_the_flop_count_is_one_pass_over_the_scores_and_the_values():
    from benchmarks.sweep_mla import useful_flops

    assert useful_flops(64, 32768) == 64 * 32768 * 128 * (576 + 512) * 2
