"""bench_hybrid's timeline part on the CPU at a tiny shape: one row per share and batch, every
span of the layer timeline filled, the steps it averaged those timed (the graph part runs on
the GPU only; the stamps here are the host clock's)."""
import os

import pytest

from benchmarks import bench_hybrid
from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir


def test_the_timeline_part_gives_every_span_per_share_and_batch(tmp_path, monkeypatch):
    cfg = dict(QWEN3_30B_DIR_CONFIG, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
               num_experts=16, num_experts_per_tok=4)
    config_dir = write_config_dir(os.path.join(tmp_path, "m"), cfg)
    make_engine = bench_hybrid.make_engine
    monkeypatch.setattr(bench_hybrid, "make_engine",
                        lambda *a, **o: make_engine(*a, device="cpu", dtype="float32", **o))
    monkeypatch.setattr(bench_hybrid, "free_engine_memory", lambda: None)
    args = bench_hybrid.parse_args(["--parts", "timeline", "--batch", "1", "2", "--timeline-shares", "0.25", "0.75"])
    args.layers, args.warmup, args.steps = 3, 2, 4
    rows = bench_hybrid.timeline_rows(config_dir, args, 55e9)
    assert [(r[0], r[1]) for r in rows] == [("25%", 1), ("25%", 2), ("75%", 1), ("75%", 2)]
    for row in rows:
        spans = [float(v) for v in row[4:4 + len(bench_hybrid.TIMELINE_SPANS)]]
        assert all(v >= 0 for v in spans) and sum(spans) > 0
        assert row[-1] == 4  # the timed steps, not the prefill's or the warm-up's
        whole, divisible = row[-3:-1]
        if whole != "-":  # both channels took experts: the floors order as they must
            assert float(divisible) <= float(whole)


def test_the_split_floors_by_hand():
    """An expert of 1 MB over 250 GB/s (4 us) or 166.7 GB/s (6 us). One always missing: the copy
    takes it whole; divisible, both channels share it (4 * 6 / 10 = 2.4 us). Two experts, each
    missing half the time: none with p 1/4, one (copied, 4) with p 1/2, two (one each, 6) with
    p 1/4: 3.5 us."""
    mb, pcie, host = 10 ** 6, 250e9, 1e12 / 6
    assert bench_hybrid.split_floors(1, 1, mb, pcie, host) == pytest.approx((4.0, 2.4))
    assert bench_hybrid.split_floors(2, 1, mb, pcie, host) == pytest.approx((3.5, 2.4))
    assert bench_hybrid.split_floors(2, 2, mb, pcie, pcie) == pytest.approx((4.0, 4.0))


def test_host_threads_reach_the_host_strategies_only(monkeypatch):
    """--host-threads sets the cpu and hybrid engines' --moe-host-threads, nothing else's."""
    import moeferry.engine.engine as engine_module

    made = []
    monkeypatch.setattr(engine_module, "Engine", lambda ec: made.append(ec))
    args = bench_hybrid.parse_args(["--host-threads", "12"])
    for strategy in ("cpu", "hybrid", "offload", "gpu"):
        bench_hybrid.make_engine("unused", args, strategy)
    assert [ec.moe_host_threads for ec in made] == [12, 12, 0, 0]  # 0: the default


def test_the_preemption_part_times_each_schedule_alone_and_beside_busy_processes():
    from moeferry.kernels.fused_moe import host

    if not host.available():
        pytest.skip("no C++ compiler for the host kernel")
    bench = bench_hybrid.host_kernel_calls(1, "dynamic")
    assert {call.schedule for call in bench.calls} == {host.SCHEDULES["dynamic"]}
    rows = bench_hybrid.preemption_rows(bench_hybrid.parse_args(["--parts", "preemption"]), seconds=0.2)
    assert [(r[0], r[2]) for r in rows] == [(s, b) for s in ("static", "dynamic") for b in (0, 1, 2)]
    assert all(float(r[3]) > 0 for r in rows)


def test_host_rows_run_once_per_dispatch_schedule_and_share_and_say_which():
    """--schedule, --dispatch and --host-share multiply the host strategies' rows; a row's label
    names only what varies between them."""
    one = bench_hybrid.parse_args([])
    assert bench_hybrid.host_channel_modes(one) == [("mailbox", "kernel", bench_hybrid.DEFAULT_SCHEDULE, None)]
    assert bench_hybrid.mode_label(one, bench_hybrid.host_channel_modes(one)[0]) == ""
    both = bench_hybrid.parse_args(["--schedule", "static", "dynamic", "--dispatch", "host_function", "mailbox"])
    modes = bench_hybrid.host_channel_modes(both)
    assert modes == [("host_function", "kernel", "static", None), ("host_function", "kernel", "dynamic", None),
                     ("mailbox", "kernel", "static", None), ("mailbox", "kernel", "dynamic", None)]
    assert [bench_hybrid.mode_label(both, m) for m in modes] == [
        ", kernel staging, static schedule", ", kernel staging, dynamic schedule",
        ", mailbox, static schedule", ", mailbox, dynamic schedule"]
    shares = bench_hybrid.parse_args(["--host-share", "tuned", "0.5"])
    assert [bench_hybrid.mode_label(shares, m) for m in bench_hybrid.host_channel_modes(shares)] == [
        ", host share tuned", ", host share 0.5"]


def test_miss_copy_rows_reach_the_slot_cache_strategies_and_say_which(monkeypatch):
    """--miss-copy gather dma runs every offload and hybrid row once per way (the engine's
    --moe-miss-copy), labelled so; cpu and gpu rows run once, without it."""
    from types import SimpleNamespace

    made, labels = [], []

    def fake_engine(config_dir, args, strategy, **options):
        made.append((strategy, options.get("moe_miss_copy")))
        store = SimpleNamespace(build_cache=lambda slots: None)
        strategy_part = SimpleNamespace(store=store, host=None, expert_bytes=1, prefetch=None)
        return SimpleNamespace(runner=SimpleNamespace(strategy=strategy_part, recapture_graphs=lambda: None))

    monkeypatch.setattr(bench_hybrid, "make_engine", fake_engine)
    monkeypatch.setattr(bench_hybrid, "force_routing", lambda *a, **k: None)
    monkeypatch.setattr(bench_hybrid, "share_slots", lambda engine, share: 1)
    monkeypatch.setattr(bench_hybrid, "free_engine_memory", lambda: None)
    monkeypatch.setattr(bench_hybrid, "decode_row", lambda engine, args, label, *rest: labels.append(label) or [label])
    args = bench_hybrid.parse_args(["--shares", "0", "0.5", "1", "--batch", "1", "--miss-copy", "gather", "dma"])
    bench_hybrid.decode_rows("unused", args, h2d=1.0)
    assert made == [("cpu", None), ("offload", "gather"), ("offload", "dma"), ("hybrid", "gather"),
                    ("hybrid", "dma"), ("gpu", None)]
    assert "offload, misses by dma" in labels and "hybrid, misses by gather" in labels and "gpu" in labels
    assert bench_hybrid.parse_args([]).miss_copy == ["dma"]
