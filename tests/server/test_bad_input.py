"""Every kind of bad input gets its status and OpenAI's error body, and the server keeps
serving: a stream running meanwhile finishes with the same text as it does alone."""

import json
import threading

import httpx
import pytest

MODEL = "moeferry-tiny-moe"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
CONTEXT = 256  # the fixture's max_model_len


def chat(**fields):
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **fields}


def completion(**fields):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


# (name, path, JSON body, expected status, expected param or None, expected code or None)
CASES = [
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages", None),
    ("messages not a list", CHAT, chat(messages="hi"), 400, "messages", None),
    ("message without role", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages.0.role", None),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role", None),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages", None),
    ("temperature not a number", CHAT, chat(temperature="hot"), 400, "temperature", None),
    ("negative temperature", CHAT, chat(temperature=-0.5), 400, "temperature", None),
    ("top_p zero", CHAT, chat(top_p=0), 400, "top_p", None),
    ("top_p above one", COMPLETIONS, completion(top_p=1.5), 400, "top_p", None),
    ("max_tokens zero", CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens negative", COMPLETIONS, completion(max_tokens=-3), 400, "max_tokens", None),
    ("max_completion_tokens zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", None),
    ("max_tokens not an integer", COMPLETIONS, completion(max_tokens="ten"), 400, "max_tokens", None),
    ("max_tokens beyond the context", COMPLETIONS, completion(max_tokens=CONTEXT), 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt longer than the context", COMPLETIONS, completion(prompt=[7] * (CONTEXT + 10)), 400, "prompt",
     "context_length_exceeded"),
    ("chat longer than the context", CHAT, chat(messages=[{"role": "user", "content": "one two " * 400}]), 400,
     "messages", "context_length_exceeded"),
    ("token id outside the vocabulary", COMPLETIONS, completion(prompt=[1, 10**9]), 400, "prompt", None),
    ("empty prompt", COMPLETIONS, completion(prompt=""), 400, "prompt", None),
    ("prompt of the wrong type", COMPLETIONS, completion(prompt=5), 400, "prompt", None),
    ("missing prompt", COMPLETIONS, {"model": MODEL}, 400, "prompt", None),
    ("unknown model", CHAT, chat(model="gpt-9"), 404, "model", "model_not_found"),
    ("unknown model (completions)", COMPLETIONS, completion(model="gpt-9"), 404, "model", "model_not_found"),
    ("n > 1", CHAT, chat(n=2), 400, "n", None),
    ("batched prompts", COMPLETIONS, completion(prompt=["a", "b"]), 400, "prompt", None),
    ("logprobs", CHAT, chat(logprobs=True), 400, "logprobs", None),
    ("body not an object", CHAT, [1, 2], 400, None, None),
]


def assert_error_body(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as client:
        yield client


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_its_status_and_error_body(http, name, path, body, status, param, code):
    assert_error_body(http.post(path, json=body), status, param, code)


def test_malformed_json(http):
    r = http.post(CHAT, content=b'{"messages": [', headers={"Content-Type": "application/json"})
    assert_error_body(r, 400, code="invalid_json")
    r = http.post(COMPLETIONS, content=b"\xff\xfe not json")
    assert_error_body(r, 400, code="invalid_json")


def test_oversize_body_by_content_length(http):
    big = json.dumps(completion(prompt="x" * (1 << 20))).encode()
    assert_error_body(http.post(COMPLETIONS, content=big), 413, code="request_too_large")


def test_oversize_body_sent_in_chunks(http):
    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 65536
        yield b'"}'

    assert_error_body(http.post(COMPLETIONS, content=chunks()), 413, code="request_too_large")


def test_api_key_is_required_on_v1(server):
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        assert_error_body(anonymous.get("/v1/models"), 401, code="invalid_api_key")
        assert_error_body(anonymous.post(CHAT, json=chat(), headers={"Authorization": "Bearer wrong"}), 401,
                          code="invalid_api_key")
        assert anonymous.get("/health").status_code == 200  # health and metrics stay open
        assert anonymous.get("/metrics").status_code == 200


def test_unknown_route_and_method(http):
    assert_error_body(http.get("/v1/nothing"), 404)
    assert_error_body(http.get(CHAT), 405)
    assert_error_body(http.get("/v1/models/gpt-9"), 404, code="model_not_found")


def test_bad_input_does_not_disturb_a_running_stream(server, http):
    body = completion(prompt="The quick brown fox", max_tokens=40, temperature=0, ignore_eos=True)
    alone = http.post(COMPLETIONS, json=body).json()["choices"][0]["text"]
    streamed, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", server.url + COMPLETIONS, json={**body, "stream": True}, headers=server.headers(),
                          timeout=60) as r:
            for line in r.iter_lines():
                started.set()
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])
                elif line == "data: [DONE]":
                    streamed.append(None)

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(30)
    for name, path, bad, status, param, code in CASES:
        assert http.post(path, json=bad).status_code == status, name
    http.post(CHAT, content=b"{not json")
    thread.join(60)
    assert streamed[-1] is None, "the stream did not end with [DONE]"
    assert "".join(streamed[:-1]) == alone
    # and new requests are still served
    assert http.post(COMPLETIONS, json=completion()).status_code == 200
    stats = http.get("/v1/stats").json()
    assert stats["requests"]["running"] == 0 and stats["kv"]["pages_used"] == 0


def test_chat_content_as_text_parts(http):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "France?"}]}]
    plain = [{"role": "user", "content": "What is France?"}]
    a = http.post(CHAT, json=chat(messages=parts, temperature=0, max_tokens=6)).json()
    b = http.post(CHAT, json=chat(messages=plain, temperature=0, max_tokens=6)).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"] == b["usage"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    assert_error_body(http.post(CHAT, json=chat(messages=image)), 400)


def test_a_failing_engine_step_fails_only_its_requests(server, http, monkeypatch):
    real_step, calls = server.engine.step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(server.engine, "step", failing_once)
    assert_error_body(http.post(COMPLETIONS, json=completion()), 500)
    ok = http.post(COMPLETIONS, json=completion(max_tokens=3, ignore_eos=True))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    stats = http.get("/v1/stats").json()
    assert stats["requests"]["running"] == 0 and stats["kv"]["pages_used"] == 0
