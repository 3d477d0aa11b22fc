import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

API_KEY = "test-key"


@dataclasses.dataclass
class RunningServer:
    """A server on 127.0.0.1 in a background thread of this process, and the Engine behind it
    (read its state only once the server is idle)."""

    url: str
    engine: object
    app: object
    api_key: str = API_KEY

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}

    def wait_idle(self, http, timeout: float = 60.0) -> dict:
        """/v1/stats once nothing runs or waits (`http`: a client of this server)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = http.get("/v1/stats").json()
            if stats["requests"]["running"] == 0 and stats["requests"]["waiting"] == 0:
                return stats
            assert time.monotonic() < deadline, f"the engine is still busy: {stats}"
            time.sleep(0.05)


@contextlib.contextmanager
def serve_engine(engine, **server_options):
    """`engine` served on 127.0.0.1 (a free port) in a thread of this process, with the API key
    (and `server_options`, ServerConfig's fields); stopped (and checked stopped) on exit."""
    from moeferry.server.app import ServerConfig, build_app, make_server

    config = ServerConfig(api_key=API_KEY, log_interval=0, max_body_bytes=1 << 20, **server_options)
    app = build_app(engine, config)
    srv = make_server(app, config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield RunningServer(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, app)
    finally:
        srv.should_exit = True
        thread.join(30)
    assert not thread.is_alive(), "the server did not stop"


@contextlib.contextmanager
def running_server(**engine_options):
    """The built-in model served on 127.0.0.1 (a free port) in a thread of this process, with
    the API key; stopped (and checked stopped) on exit."""
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    engine = Engine(EngineConfig(dtype="float32", device="cpu", **engine_options))
    with serve_engine(engine) as running:
        yield running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, *options: str) -> subprocess.Popen:
    """`moeferry serve` of the built-in model (float32 on the CPU, `options` added) as a process
    on 127.0.0.1:`port`, returned once /health answers; its log is the process's stdout (text,
    stderr joined), a pipe the caller reads (or leaves few lines in: a full pipe blocks it)."""
    cmd = [sys.executable, "-m", "moeferry.cli", "serve", "--port", str(port), "--dtype", "float32", "--device", "cpu",
           *options]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not come up: {proc.communicate()[0]}")
        time.sleep(0.2)


def openai_client(running: RunningServer):
    import openai

    return openai.OpenAI(base_url=running.url + "/v1", api_key=running.api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def long_context_engine(model_cache):
    """The built-in model on the CPU with room for a prompt that lists tools (1,024 tokens)."""
    from moeferry.config import EngineConfig
    from moeferry.engine.engine import Engine

    return Engine(EngineConfig(dtype="float32", device="cpu", max_running_requests=4, max_model_len=1024))


@pytest.fixture(scope="module")
def server(model_cache):
    # max_model_len is kept small: the CPU reference decode attention costs O(max_model_len).
    with running_server(max_running_requests=8, max_model_len=256) as running:
        yield running
