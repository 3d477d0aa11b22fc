"""No client stalls, starves or bloats the server for the others: each attack below (scaled
to CI) is refused or bounded before it costs the others, while a 2-token control chat keeps
answering within CONTROL_LATENCY_S and the process's memory returns near its idle figure.

1. huge text prompts (refused by their characters, before tokenizing);
2. long guided_choice strings (bounded each and together, before compiling);
3. bodies of thousands of messages (bounded, parsed off the event loop).
And: an unmatchable regex and an unenforced schema keyword are 400s, OpenAI's nullable fields
take null, an upload cut short is neither a 500 nor a traceback, a slow body times out, and a
client waiting on a pool at shutdown gets the 503 JSON the README promises."""

import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, serve_engine

CONTROL_LATENCY_S = 2.0
RSS_SLACK_BYTES = 200 << 20
CONTROL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as client:
        yield client


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def huge_prompt() -> dict:
    return {"prompt": "word " * 150_000, "max_tokens": 1}


def long_choices() -> dict:
    return {**CONTROL, "guided_choice": ["x" * 150_000]}


def many_messages() -> dict:
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    return {"messages": [{"role": "assistant", "content": None, "tool_calls": call}] * 6_000, "max_tokens": 2}


ATTACKS = [("/v1/completions", huge_prompt, "prompt"), ("/v1/chat/completions", long_choices, "guided_choice"),
           ("/v1/chat/completions", many_messages, "messages")]


@pytest.mark.parametrize("path, make, param", ATTACKS)
def test_each_attack_is_refused_naming_its_field(http, path, make, param):
    started = time.monotonic()
    r = http.post(path, json=make())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)
    assert time.monotonic() - started < CONTROL_LATENCY_S


# The attackers run in a process of their own (as they would on other machines), two threads
# per attack, each posting its body again as soon as it is answered; they print the statuses.
_ATTACKER = """
import json, sys, threading, time, httpx
url, key, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
attacks = json.loads(sys.stdin.read())
statuses, deadline = [], time.monotonic() + seconds
def attack(path, body):
    with httpx.Client(base_url=url, headers={"Authorization": "Bearer " + key,
                                             "content-type": "application/json"}, timeout=120) as client:
        while time.monotonic() < deadline:
            statuses.append(client.post(path, content=body).status_code)
threads = [threading.Thread(target=attack, args=(p, b.encode())) for p, b in attacks for _ in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(statuses))
"""


def test_a_control_chat_keeps_its_latency_and_memory_returns_while_attacks_run(server, http):
    import subprocess
    import sys

    http.post("/v1/chat/completions", json=CONTROL).raise_for_status()  # warm
    idle = rss_bytes()
    attacks = json.dumps([(path, json.dumps(make())) for path, make, _ in ATTACKS])
    attackers = subprocess.Popen([sys.executable, "-c", _ATTACKER, server.url, API_KEY, "12"], text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    attackers.stdin.write(attacks)
    attackers.stdin.close()
    latencies = []
    try:
        time.sleep(2.0)  # the attackers are up and posting
        for _ in range(8):
            started = time.monotonic()
            r = http.post("/v1/chat/completions", json=CONTROL)
            latencies.append(time.monotonic() - started)
            assert r.status_code == 200, r.text
            time.sleep(0.2)
    finally:
        statuses = json.loads(attackers.stdout.read() or "[]")
        attackers.wait(60)
    assert max(latencies) < CONTROL_LATENCY_S, latencies
    assert len(statuses) > len(ATTACKS) * 2 and set(statuses) <= {400, 503}, set(statuses)
    assert rss_bytes() - idle < RSS_SLACK_BYTES, (idle, rss_bytes())


def test_nullable_fields_sent_as_null_are_served(http):
    r = http.post("/v1/chat/completions", json={**CONTROL, "n": None, "presence_penalty": None,
                                                "frequency_penalty": None, "stream": None})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": None, "echo": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fields, param, words", [
    ({"guided_regex": "a[^\\s\\S]"}, "guided_regex", "never match"),
    ({"guided_json": {"type": "number", "multipleOf": 7.5}}, "guided_json", "`multipleOf`"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format", "`not`"),
])
def test_an_unmatchable_constraint_is_a_400_before_generating(http, fields, param, words):
    r = http.post("/v1/chat/completions", json={**CONTROL, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


def test_oversized_metadata_is_refused(http):
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "metadata": {"k": "v" * 4096}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"


def raw_post(url: str, body_prefix: bytes, declared: int) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n".encode() + body_prefix)
    return sock


def count_500s(http) -> float:
    text = http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("moeferry_http_requests_total") and 'status="500"' in line)


def test_an_upload_cut_short_is_neither_a_500_nor_a_traceback(server, http, caplog):
    before = count_500s(http)
    with caplog.at_level(logging.ERROR, logger="moeferry.server"):
        for _ in range(5):
            raw_post(server.url, b'{"messages": [', 10_000).close()
        time.sleep(0.5)
        http.post("/v1/chat/completions", json=CONTROL).raise_for_status()
    assert count_500s(http) == before
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@contextlib.contextmanager
def own_server(engine, **options):
    """`engine` served as serve_engine serves it, plus the uvicorn server object (to stop it)."""
    from moeferry.server import app as app_module

    made = []
    real = app_module.make_server
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app_module, "make_server", lambda *a: made.append(real(*a)) or made[-1])
        with serve_engine(engine, **options) as running:
            yield running, made[0]


@pytest.fixture(scope="module")
def second_engine(model_cache):
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    return Engine(EngineConfig(dtype="float32", device="cpu", max_running_requests=2, max_model_len=128))


def test_a_body_that_does_not_arrive_in_time_is_a_408(second_engine):
    with own_server(second_engine, body_timeout_s=0.5) as (running, _):
        sock = raw_post(running.url, b'{"messages": [', 1000)
        sock.settimeout(10)
        started = time.monotonic()
        reply = b""
        while b'"request_timeout"' not in reply and (chunk := sock.recv(65536)):  # headers and body may come apart
            reply += chunk
        reply = reply.decode()
        sock.close()
    assert time.monotonic() - started < 5
    assert reply.startswith("HTTP/1.1 408"), reply
    assert '"request_timeout"' in reply


def test_shutdown_answers_a_client_waiting_on_a_grammar_compile_with_a_503_json(second_engine, monkeypatch):
    class SlowCompiler:
        def compile(self, constraint):
            time.sleep(30)

    monkeypatch.setattr(second_engine, "grammar_compiler", lambda: SlowCompiler())
    replies = []
    with own_server(second_engine) as (running, srv):
        def ask():
            with httpx.Client(base_url=running.url, headers=running.headers(), timeout=30) as client:
                replies.append(client.post("/v1/chat/completions", json={**CONTROL, "guided_choice": ["a", "b"]}))

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(1.0)
        started = time.monotonic()
        srv.should_exit = True
        asker.join(20)
    assert time.monotonic() - started < 10
    (reply,) = replies
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "shutting_down", reply.text


def test_the_screening_process_refuses_a_body_of_too_many_messages_without_parsing_it_here():
    from moeferry.server.protocol import MAX_MESSAGES, APIError, ChatCompletionRequest
    from moeferry.server.screen import SCREEN_BYTES, BodyScreen

    screen, fields = BodyScreen(), ChatCompletionRequest
    body = json.dumps(many_messages()).encode()
    assert len(body) > SCREEN_BYTES and len(many_messages()["messages"]) > MAX_MESSAGES
    try:
        with pytest.raises(APIError) as refused:
            screen.check(body, fields)
        assert refused.value.status == 400 and refused.value.param == "messages"
        with pytest.raises(APIError) as invalid:
            screen.check(b"{" + b" " * SCREEN_BYTES, fields)
        assert invalid.value.code == "invalid_json"
        long_text = {"messages": [{"role": "user", "content": "x" * SCREEN_BYTES}], "max_tokens": 2}
        screen.check(json.dumps(long_text).encode(), fields)  # passes: its length is the server's to judge
    finally:
        screen.close()
