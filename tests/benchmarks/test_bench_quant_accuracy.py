"""benchmarks/bench_quant_accuracy.py on a slice of the held-out text: a row per format, the
unquantized row its own baseline, the quantized rows smaller per expert and off by a little."""


def test_bench_quant_accuracy_scores_every_format():
    from benchmarks import bench_quant_accuracy

    args = bench_quant_accuracy.parse_args(["--max-tokens", "96", "--window", "32"])
    assert args.formats == ["fp8", "int4", "mxfp4"] and args.device == "cpu"
    rows = bench_quant_accuracy.run(args)
    assert [row[0] for row in rows] == ["float32", "fp8 e4m3, 128x128 blocks", "int4 W4A16, groups of 128",
                                        "mxfp4 e2m1, e8m0 scales per 32"]
    assert rows[0][3:5] == ["+0.00%", "0.0000"]
    assert rows[0][1] > 3.5 * rows[1][1] and rows[1][1] > 1.7 * rows[2][1]  # float32 / fp8 / int4 bytes
    assert 0.9 * rows[2][1] < rows[3][1] < 1.1 * rows[2][1]  # mxfp4: 4.25 bits a value, as int4
    for row in rows[1:]:
        assert 0 < float(row[4]) < 10 and abs(float(row[3].rstrip("%"))) < 10  # changed, not broken
        assert float(row[2]) < 200  # the trained model still predicts the text
