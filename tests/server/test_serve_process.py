"""`moeferry serve` as a process: it logs its plan and a periodic activity line, and on
SIGTERM or SIGINT ends the in-flight stream properly (a final chunk with an OpenAI finish_reason,
`data: [DONE]`), answers an in-flight non-streamed request with a 503 error body, and exits 0."""

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import free_port, start_server


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_ends_streams_properly_and_exits_cleanly(model_cache, sig):
    port = free_port()
    proc = start_server(port, "--max-model-len", "256", "--log-interval", "0.3")
    events, enough, answers = [], threading.Event(), []

    def whole():
        body = {"prompt": "Hi", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
        answers.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60))

    def stream():
        body = {"prompt": "Hello", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) >= 40:
                    enough.set()
        enough.set()

    thread, waiting = threading.Thread(target=stream), threading.Thread(target=whole)
    try:
        thread.start()
        waiting.start()
        assert enough.wait(60)
        time.sleep(0.4)  # let the periodic line come out
        proc.send_signal(sig)
        thread.join(30)
        waiting.join(30)
        assert not thread.is_alive() and not waiting.is_alive()
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])["choices"][0]
    assert last["finish_reason"] == "length"  # OpenAI's value for text cut off ("abort" is not one)
    assert len(events) - 2 < 240  # it was cut short, not run to the end
    assert answers[0].status_code == 503, answers[0].text
    assert answers[0].json()["error"]["code"] == "shutting_down" and "choices" not in answers[0].json()
    assert "serving moeferry-tiny-moe" in output and "KV cache" in output and "max batch 8" in output
    assert "CUDA graphs off" in output
    assert "decode" in output and "tok/s" in output and "KV " in output
    assert "stopped by signal" in output
