"""The decode profile's arithmetic over a trace's device events (the profiler itself needs a GPU)."""

import pytest

from benchmarks.bench_profile import device_events, intersection, parse_args, step_summary, union, variants


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_union_and_intersection_of_intervals():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert intersection([(0, 3), (5, 8)], [(2, 6), (7, 10)]) == 1 + 1 + 1


def test_step_summary_splits_copy_compute_overlap_and_idle():
    events = [kernel("_gather_rows_kernel", 0, 10), {**kernel("fused_moe_kernel", 5, 10), "tid": 2},
              kernel("rms_norm", 20, 5), kernel("Memcpy HtoD (Pinned -> Device)", 30, 10, cat="gpu_memcpy"),
              kernel("_gather_rows_kernel", 100, 10), {**kernel("fused_moe_kernel", 105, 10), "tid": 2},
              kernel("rms_norm", 120, 5), kernel("Memcpy HtoD (Pinned -> Device)", 130, 10, cat="gpu_memcpy")]
    s = step_summary(events, steps=2)
    assert s["window"] == 140 / 2
    assert s["copy"] == 20 and s["compute"] == 15 and s["overlap"] == 5
    assert s["busy"] == 30 and s["idle"] == 70 - 30
    names = [k[0] for k in s["kernels"]]
    assert names[0] in ("_gather_rows_kernel", "fused_moe_kernel", "Memcpy HtoD (Pinned -> Device)")
    assert dict((n, (c, t)) for n, c, t in s["kernels"])["rms_norm"] == (1.0, 5.0)


def test_a_kernel_waiting_on_a_host_worker_is_neither_copy_nor_compute():
    events = [kernel("Memcpy HtoD (Pinned -> Device)", 0, 10, cat="gpu_memcpy"), {**kernel("_wait_done_kernel", 0, 12),
                                                                                "tid": 2},
              kernel("rms_norm", 20, 5)]
    s = step_summary(events, steps=1)
    assert s["waiting"] == 12 and s["compute"] == 5 and s["copy"] == 10 and s["overlap"] == 0


def test_a_copy_wait_splits_into_its_latency_before_and_after_the_copies():
    """A wait of 100 µs over two copies (20-50, 45-80): 20 before, 20 after; a wait with no copy
    under it (the host's experts) counts in neither."""
    events = [{**kernel("_wait_done_kernel", 0, 100), "tid": 1},
              kernel("Memcpy HtoD (Pinned -> Device)", 20, 30, cat="gpu_memcpy"),
              kernel("Memcpy HtoD (Pinned -> Device)", 45, 35, cat="gpu_memcpy"),
              {**kernel("_wait_done_kernel", 200, 50), "tid": 1}]
    s = step_summary(events, steps=2)
    assert s["copy_waits"] == 0.5 and s["wait_lead"] == 10 and s["wait_tail"] == 10


def test_only_device_events_count():
    trace = {"traceEvents": [kernel("k", 0, 1), kernel("cudaLaunchKernel", 0, 1, cat="cuda_runtime"),
                             {"ph": "i", "cat": "kernel", "name": "x", "ts": 0}]}
    assert [e["name"] for e in device_events(trace)] == ["k"]
    assert step_summary([], 1)["busy"] == 0.0


def test_rows_take_a_lookahead_and_statistics_only_over_a_slot_cache():
    args = parse_args(["--strategies", "gpu", "offload", "--prefetch", "off", "oracle", "--stats", "on", "off"])
    rows = variants(args)
    assert rows[0] == ("gpu", "off", "off", "on") and len(rows) == 1 + 4
    both = variants(parse_args(["--strategies", "gpu", "--async-scheduling", "on", "off"]))
    assert both == [("gpu", "off", "off", "on"), ("gpu", "off", "off", "off")]


def test_a_kernel_launched_early_counts_from_the_end_of_the_one_before_it_on_its_stream():
    from benchmarks.bench_profile import effective_spans

    events = [{"ts": 0, "dur": 10, "tid": 7, "name": "a"}, {"ts": 2, "dur": 12, "tid": 7, "name": "b"},
              {"ts": 3, "dur": 5, "tid": 9, "name": "c"}]
    assert effective_spans(events) == [(0, 10), (10, 14), (3, 8)]


def test_a_shape_of_its_own_router_refuses_generated_routes(capsys):
    """--shape gpt-oss has 32 experts of top-4, which the generated profiles do not draw: it takes
    --routing model, and the Qwen3 shape keeps its generated default."""
    assert parse_args([]).shape == "qwen3" and parse_args([]).routing == "qwen3"
    assert parse_args(["--shape", "gpt-oss", "--routing", "model"]).shape == "gpt-oss"
    with pytest.raises(SystemExit):
        parse_args(["--shape", "gpt-oss"])
    assert "--routing model" in capsys.readouterr().err
