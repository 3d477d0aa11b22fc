"""benchmarks/bench_host_kernel.py on a small layer: a row per format, thread count and batch;
the int8 columns only for int4 and mxfp4; stored bytes per expert as each format packs them."""
import pytest

from moeferry.kernels.fused_moe import host

pytestmark = pytest.mark.skipif(not host.available(), reason="no C++ compiler to build the host kernel")


def test_the_host_kernel_bench_measures_every_format_on_the_cpu(capsys):
    from benchmarks import bench_host_kernel

    args = bench_host_kernel.parse_args(["--experts", "16", "--shape", "256", "64", "--calls", "2", "--batch", "1", "3",
                                         "--threads", "1"])
    table = bench_host_kernel.rows(args)
    assert [(r[0], r[2]) for r in table] == [(f, b) for f in bench_host_kernel.FORMATS for b in (1, 3)]
    for row in table:
        assert (row[5] != "-") == (row[0] in ("int4", "mxfp4")) and float(row[4]) > 0
    mib = {row[0]: float(row[3]) for row in table}
    bf16_bytes = 3 * 256 * 64 * 2
    assert mib["bf16"] == pytest.approx(bf16_bytes / 2**20, abs=0.01)
    assert mib["fp8"] > bf16_bytes / 2 / 2**20 and mib["int4"] < mib["fp8"] and mib["mxfp4"] < mib["fp8"]
    assert "int8 dots:" in capsys.readouterr().out
