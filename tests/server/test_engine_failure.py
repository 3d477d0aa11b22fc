"""An engine that fails for good (EngineFailed: a rank of several died) ends the server: every
live request gets a 503 naming why, and `serve_engine` returns exit status 1 instead of serving
on with an engine that cannot step."""

import socket
import threading
import time

import httpx

from moeferry.errors import EngineFailed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_failed_engine_answers_503_and_the_server_exits_with_status_1(monkeypatch):
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine
    from moeferry.server.app import ServerConfig, serve_engine

    engine = Engine(EngineConfig(dtype="float32", device="cpu", max_running_requests=2, max_model_len=128))

    def dead_rank():
        raise EngineFailed("rank 1 of 2 (pid 1234) was killed by signal 9")

    monkeypatch.setattr(engine, "step", dead_rank)
    port = free_port()
    status = []
    thread = threading.Thread(target=lambda: status.append(serve_engine(engine, ServerConfig(port=port, log_interval=0))),
                              daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url + "/health", timeout=1)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
    r = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=30)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_failed" and "killed by signal 9" in r.json()["error"]["message"]
    thread.join(30)
    assert not thread.is_alive() and status == [1]
