"""Observability: Prometheus metrics (prometheus-client, one registry per app) and the
periodic activity line the engine thread logs."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger("moeferry.server")

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def expert_cache_hit_rate(moe: dict | None) -> float | None:
    """The decode expert-cache hit rate from a strategy's stats(), or None if it reports none."""
    if not moe:
        return None
    for path in (("hit_rate",), ("decode", "hit_rate"), ("decode", "total", "hit_rate")):
        node = moe
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, (int, float)):
            return float(node)
    return None


class _EngineStatsCollector:
    """Exposes the latest Engine.stats() snapshot (set by the /metrics handler just before
    rendering) as gauges and counters; the engine's own counters are the source of truth."""

    def __init__(self):
        self.latest: dict | None = None

    def collect(self):
        s = self.latest
        if s is None:
            return
        req, tok, kv = s["requests"], s["tokens"], s["kv"]
        yield _gauge("moeferry_requests_running", "Requests running (holding KV pages).", req["running"])
        yield _gauge("moeferry_requests_waiting", "Requests waiting for admission.", req["waiting"])
        yield _gauge("moeferry_kv_cache_usage_ratio", "Fraction of KV pages in use.", kv["usage"])
        yield _gauge("moeferry_kv_cache_pages_used", "KV pages in use.", kv["pages_used"])
        yield _gauge("moeferry_kv_cache_pages_total", "KV pages in the pool.", kv["pages_total"])
        yield _counter("moeferry_prompt_tokens", "Prompt tokens received.", tok["prompt_tokens"])
        yield _counter("moeferry_generation_tokens", "Tokens generated.", tok["generation_tokens"])
        yield _counter("moeferry_preemptions", "Requests preempted for lack of KV pages.", req["preemptions"])
        yield _gauge("moeferry_kv_cache_pages_cached", "KV pages holding a cached prefix (used or evictable).",
                     kv["pages_cached"])
        yield _counter("moeferry_prefix_cache_queries", "Tokens of admitted requests looked up in the prefix cache.",
                       tok["prefix_cache_queried_tokens"])
        yield _counter("moeferry_prefix_cache_hits", "Tokens of admitted requests found in the prefix cache.",
                       tok["prefix_cache_hit_tokens"])
        hit = expert_cache_hit_rate(s.get("moe"))
        if hit is not None:
            yield _gauge("moeferry_expert_cache_hit_ratio", "Decode expert-cache hit rate.", hit)
        moe = s.get("moe") or {}
        if "host_experts" in moe:  # the host channel of the cpu and hybrid strategies
            yield _counter("moeferry_host_experts", "Routed experts computed on the host in decode (per layer "
                           "and step).", moe["host_experts"])
            yield _counter("moeferry_host_expert_bytes", "Expert bytes the host kernel read in decode.",
                           moe["host_bytes"])
        prefetch = moe.get("prefetch") or {}
        if "copied" in prefetch:  # --moe-prefetch with --moe-collect-stats
            yield _counter("moeferry_prefetch_copied_experts", "Experts copied ahead of their layer's routing.",
                           prefetch["copied"])
            yield _counter("moeferry_prefetch_useful_experts", "Experts copied ahead that their layer then routed.",
                           prefetch["useful"])
            if prefetch["recall"] is not None:
                yield _gauge("moeferry_prefetch_recall", "Routed experts that were predicted, of all routed.",
                             prefetch["recall"])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """The server's Prometheus registry. Invariant: every metric lives in `registry` (never
    the process-global one), so several apps in one process do not collide. Histogram and
    counter updates are thread-safe: the engine thread observes token timings directly."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("moeferry_http_requests", "HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("moeferry_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("moeferry_inter_token_latency_seconds", "Time between two tokens of a request.",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.engine_stats = _EngineStatsCollector()
        self.registry.register(self.engine_stats)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_next_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self, engine_stats: dict | None) -> bytes:
        self.engine_stats.latest = engine_stats
        return generate_latest(self.registry)


class ActivityLogger:
    """Logs one line every `interval` seconds while the engine has work or made progress:
    running, waiting, prefill and decode tok/s over the interval, KV use, and the expert
    cache hit rate when the strategy reports one. Called from the engine thread only."""

    def __init__(self, interval: float):
        self.interval = interval
        self._last_time = time.monotonic()
        self._last_tokens = (0, 0)

    def __call__(self, engine) -> None:
        now = time.monotonic()
        if self.interval <= 0 or now - self._last_time < self.interval:
            return
        tokens = (engine.counters["prefill_tokens"], engine.counters["decode_tokens"])
        if engine.has_work or tokens != self._last_tokens:
            self._log(engine, tokens, now - self._last_time)
        self._last_time, self._last_tokens = now, tokens

    def _log(self, engine, tokens: tuple[int, int], elapsed: float) -> None:
        s = engine.stats(include_moe=True)
        prefill_tps = (tokens[0] - self._last_tokens[0]) / elapsed
        decode_tps = (tokens[1] - self._last_tokens[1]) / elapsed
        kv = s["kv"]
        line = (f"running {s['requests']['running']}, waiting {s['requests']['waiting']}, "
                f"prefill {prefill_tps:.1f} tok/s, decode {decode_tps:.1f} tok/s, "
                f"KV {100 * kv['usage']:.1f}% ({kv['pages_used']}/{kv['pages_total']} pages)")
        hit = expert_cache_hit_rate(s.get("moe"))
        if hit is not None:
            line += f", expert cache hit {100 * hit:.1f}%"
        logger.info(line)
