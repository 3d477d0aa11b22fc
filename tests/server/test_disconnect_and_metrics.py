"""A client that goes away mid-request has its request aborted and its KV pages freed;
/v1/stats and /metrics report what happened."""

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as client:
        yield client




def long_request(stream: bool) -> dict:
    return {"prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": stream}


def test_disconnect_mid_stream_aborts_the_request_and_frees_its_pages(server, http):
    before = server.wait_idle(http)
    with httpx.stream("POST", server.url + "/v1/completions", json=long_request(True), headers=server.headers(),
                      timeout=60) as r:
        assert r.status_code == 200  # hang up right after the headers, before reading any event
    with httpx.stream("POST", server.url + "/v1/completions", json=long_request(True), headers=server.headers(),
                      timeout=60) as r:  # read a few events, then hang up
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                events += 1
            if events == 3:
                # still connected (leaving this loop closes the connection): the request runs
                assert http.get("/v1/stats").json()["kv"]["pages_used"] > 0
                break
    after = server.wait_idle(http)
    assert after["requests"]["aborted"] == before["requests"]["aborted"] + 2
    assert after["kv"]["pages_used"] == 0
    assert after["tokens"]["generation_tokens"] - before["tokens"]["generation_tokens"] < 2 * 200
    pool = server.engine.scheduler.pool
    assert pool.free_pages == pool.num_pages


def test_disconnect_while_waiting_for_a_full_answer_aborts_it(server, http):
    before = server.wait_idle(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=long_request(False), headers=server.headers(), timeout=0.3)
    after = server.wait_idle(http)
    assert after["requests"]["aborted"] == before["requests"]["aborted"] + 1
    assert after["kv"]["pages_used"] == 0


def test_stats_endpoint(server, http):
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    stats = server.wait_idle(http)
    assert set(stats) == {"requests", "tokens", "kv", "moe"}
    assert stats["kv"]["pages_total"] > 0 and 0.0 <= stats["kv"]["usage"] <= 1.0
    assert stats["tokens"]["generation_tokens"] >= 3 and stats["tokens"]["prompt_tokens"] >= 1


def _samples(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_parse_and_count_the_requests_made(server, http):
    before = _samples(http.get("/metrics").text)
    body = {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True}
    for _ in range(3):
        assert http.post("/v1/completions", json=body).status_code == 200
    assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    server.wait_idle(http)
    after = _samples(http.get("/metrics").text)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("moeferry_http_requests_total", endpoint="/v1/completions", status="200") == 3
    assert delta("moeferry_http_requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert delta("moeferry_time_to_first_token_seconds_count") == 3
    assert delta("moeferry_inter_token_latency_seconds_count") == 3 * 3
    assert delta("moeferry_generation_tokens_total") == 3 * 4
    assert delta("moeferry_prompt_tokens_total") >= 3
    for gauge in ("moeferry_requests_running", "moeferry_requests_waiting", "moeferry_kv_cache_usage_ratio"):
        assert after[(gauge, ())] == 0.0


def test_a_repeated_prompt_is_counted_as_prefix_cache_hits_in_stats_and_metrics(server, http):
    prompt = list(range(100, 140))  # 40 tokens: pages of 16, so 32 can be found again (not the last token's page)
    before, metrics_before = server.wait_idle(http), _samples(http.get("/metrics").text)
    answers = [http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[1] == 32 and cached[0] in (0, 32)  # the first may find an earlier test's pages
    after, metrics_after = server.wait_idle(http), _samples(http.get("/metrics").text)

    def delta(counter: str, metric: str) -> tuple[int, float]:
        return (after["tokens"][counter] - before["tokens"][counter],
                metrics_after[(metric, ())] - metrics_before[(metric, ())])

    assert delta("prefix_cache_queried_tokens", "moeferry_prefix_cache_queries_total") == (80, 80.0)
    assert delta("prefix_cache_hit_tokens", "moeferry_prefix_cache_hits_total") == (32, 32.0)
    assert after["kv"]["pages_cached"] >= 2 and after["kv"]["pages_used"] == 0


def test_health(http):
    assert http.get("/health").json() == {"status": "ok"}
