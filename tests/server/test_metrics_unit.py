"""The pieces of observability that need no server: the expert-cache hit rate as each
strategy reports it, and the periodic activity line."""

import logging
from types import SimpleNamespace

from moeferry.server.metrics import ActivityLogger, expert_cache_hit_rate


def test_expert_cache_hit_rate_from_the_strategy_stats_shapes():
    assert expert_cache_hit_rate({}) is None
    assert expert_cache_hit_rate(None) is None
    assert expert_cache_hit_rate({"strategy": "gpu"}) is None
    assert expert_cache_hit_rate({"hit_rate": 0.5}) == 0.5
    assert expert_cache_hit_rate({"decode": {"total": {"hit_rate": 0.75, "misses": 3}}}) == 0.75


class FakeEngine:
    def __init__(self, moe):
        self.counters = {"prefill_tokens": 0, "decode_tokens": 0}
        self.has_work = True
        self.moe = moe

    def stats(self, include_moe=True):
        return {"requests": {"running": 3, "waiting": 1}, "kv": {"usage": 0.25, "pages_used": 4, "pages_total": 16},
                "moe": self.moe}


def test_activity_line_every_interval_while_busy(caplog, monkeypatch):
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr("moeferry.server.metrics.time.monotonic", lambda: clock.now)
    engine = FakeEngine({"decode": {"total": {"hit_rate": 0.9}}})
    log = ActivityLogger(interval=2.0)
    with caplog.at_level(logging.INFO, logger="moeferry.server"):
        engine.counters.update(prefill_tokens=40, decode_tokens=10)
        clock.now = 101.0
        log(engine)
        assert not caplog.records  # not yet an interval
        clock.now = 102.0
        log(engine)
        engine.has_work = False
        clock.now = 104.5
        log(engine)  # idle and no progress: silent
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["running 3, waiting 1, prefill 20.0 tok/s, decode 5.0 tok/s, KV 25.0% (4/16 pages), "
                     "expert cache hit 90.0%"]
