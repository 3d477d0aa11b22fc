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
    ("n zero", CHAT, chat(n=0), 400, "n", None),
    ("an empty prompt in a batch", COMPLETIONS, completion(prompt=["a", ""]), 400, "prompt", None),
    ("a field neither OpenAI nor vLLM has", CHAT, chat(frobnicate=1), 400, "frobnicate", None),
    ("an unknown responses field", "/v1/responses", {"input": "hi", "frobnicate": 1}, 400, "frobnicate", None),
    ("responses include", "/v1/responses", {"input": "hi", "include": ["reasoning.encrypted_content"]}, 400,
     "include", None),
    ("responses truncation auto", "/v1/responses", {"input": "hi", "truncation": "auto"}, 400, "truncation", None),
    ("a reasoning summary", "/v1/responses", {"input": "hi", "reasoning": {"summary": "auto"}}, 400,
     "reasoning.summary", None),
    ("prompt_logprobs past 20", COMPLETIONS, completion(prompt_logprobs=21), 400, "prompt_logprobs", None),
    ("negative prompt_logprobs", CHAT, chat(prompt_logprobs=-1), 400, "prompt_logprobs", None),
    ("prompt_logprobs in a stream", CHAT, chat(prompt_logprobs=1, stream=True), 400, "prompt_logprobs", None),
    ("prompt_logprobs in responses", "/v1/responses", {"input": "hi", "prompt_logprobs": 0}, 400, "prompt_logprobs",
     None),
    ("beam search", CHAT, chat(use_beam_search=True), 400, "use_beam_search", None),
    ("min_tokens over max_tokens", CHAT, chat(min_tokens=9), 400, "min_tokens", None),
    ("logprobs of the wrong type", CHAT, chat(logprobs="yes please"), 400, "logprobs", None),
    ("body not an object", CHAT, [1, 2], 400, None, None),
    # the limits of protocol.py and the ranges of sampling.py, each refused naming its field
    ("seed past 64 bits", COMPLETIONS, completion(seed=2**64), 400, "seed", None),
    ("seed below 64 bits", CHAT, chat(seed=-(2**63) - 1), 400, "seed", None),
    ("seed with a fraction", CHAT, chat(seed=1.5), 400, "seed", None),
    ("too many stop strings", COMPLETIONS, completion(stop=[f"s{i}" for i in range(17)]), 400, "stop", None),
    ("100,000 stop strings", COMPLETIONS, completion(stop=["x"] * 100_000), 400, "stop", None),
    ("a stop string too long", CHAT, chat(stop="x" * 257), 400, "stop", None),
    ("stop of the wrong type", CHAT, chat(stop=5), 400, "stop", None),
    ("too many stop_token_ids", CHAT, chat(stop_token_ids=list(range(257))), 400, "stop_token_ids", None),
    ("negative stop token id", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids.0", None),
    ("stop token id outside the vocabulary", CHAT, chat(stop_token_ids=[10**6]), 400, "stop_token_ids", None),
    ("temperature past float range", CHAT, json.dumps(chat()).replace('"max_tokens"', '"temperature": 1e400, "max_tokens"'),
     400, "temperature", None),
    ("top_k too large", CHAT, chat(top_k=2**31), 400, "top_k", None),
    ("presence_penalty out of range", CHAT, chat(presence_penalty=2.5), 400, "presence_penalty", None),
    ("frequency_penalty out of range", COMPLETIONS, completion(frequency_penalty=-3), 400, "frequency_penalty", None),
    ("repetition_penalty zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty", None),
    ("repetition_penalty past float32", CHAT, chat(repetition_penalty=1e-40), 400, "repetition_penalty", None),
    ("temperature past 100", COMPLETIONS, completion(temperature=1e300), 400, "temperature", None),
    ("min_p above one", CHAT, chat(min_p=1.5), 400, "min_p", None),
    ("logit_bias value out of range", CHAT, chat(logit_bias={"5": 101}), 400, "logit_bias.5", None),
    ("logit_bias key not a token id", CHAT, chat(logit_bias={"five": 1}), 400, "logit_bias.five", None),
    ("logit_bias with 301 entries", CHAT, chat(logit_bias={str(i): 1 for i in range(301)}), 400, "logit_bias",
     None),
    ("top_logprobs past 20", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", None),
    ("completion logprobs past 5", COMPLETIONS, completion(logprobs=6), 400, "logprobs", None),
    ("n past the limit", CHAT, chat(n=17), 400, "n", None),
    # fields of the API the server does not honour yet: refused naming them, never ignored
    ("response_format of an unknown type", CHAT, chat(response_format={"type": "yaml"}), 400, "response_format.type",
     None),
    ("response_format json_schema without a schema", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema", None),
    ("a schema the grammar compiler refuses", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     400, "response_format", None),
    ("a bad guided_regex", COMPLETIONS, completion(guided_regex="a(b"), 400, "guided_regex", None),
    ("two structured output fields", COMPLETIONS, completion(guided_regex="a", guided_choice=["a"]), 400,
     "guided_choice", None),
    ("tools on completions", COMPLETIONS, completion(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tools", None),
    ("tool_choice required without tools", CHAT, chat(tool_choice="required"), 400, "tool_choice", None),
    ("tool_choice naming no tool", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                              tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "tool_choice", None),
    ("two tools of one name", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), 400, "tools",
     None),
    ("a tool name with a space", CHAT, chat(tools=[{"type": "function", "function": {"name": "f g"}}]), 400,
     "tools.0.function.name", None),
    ("functions (deprecated)", CHAT, chat(functions=[{"name": "f"}]), 400, "functions", None),
    ("audio output", CHAT, chat(modalities=["text", "audio"]), 400, "modalities", None),
    ("completion suffix", COMPLETIONS, completion(suffix="!"), 400, "suffix", None),
]


def post(http, path, body):
    """POST `body`: JSON from Python values, or sent as it is when already text."""
    return http.post(path, content=body) if isinstance(body, str) else http.post(path, json=body)


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
    assert_error_body(post(http, path, body), status, param, code)


def test_malformed_json(http):
    r = http.post(CHAT, content=b'{"messages": [', headers={"Content-Type": "application/json"})
    assert_error_body(r, 400, code="invalid_json")
    r = http.post(COMPLETIONS, content=b"\xff\xfe not json")
    assert_error_body(r, 400, code="invalid_json")
    r = http.post(COMPLETIONS, content=b'{"prompt": "hi", "temperature": NaN}')
    assert_error_body(r, 400, code="invalid_json")


def test_a_lone_surrogate_is_refused_naming_its_field(http):
    r = http.post(CHAT, content=b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}')
    assert_error_body(r, 400, param="messages.0.content", code="invalid_json")
    r = http.post(COMPLETIONS, content=b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 2}')  # a pair: fine
    assert r.status_code == 200, r.text


def test_deep_nesting_is_refused_before_parsing_and_keeps_the_connection(http):
    for deep in (b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 65 + b"]" * 65 + b"}"):
        assert_error_body(http.post(COMPLETIONS, content=deep), 400, code="invalid_json")
    # brackets inside strings are text, not nesting
    assert http.post(COMPLETIONS, json=completion(prompt="[" * 70 + '"\\' + "{" * 70)).status_code == 200
    # the keep-alive connection was answered, not reset: the next request on it is served
    assert http.post(COMPLETIONS, json=completion()).status_code == 200


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
        assert_error_body(anonymous.get("/v1/models", headers={"Authorization": f"Basic {server.api_key}"}), 401)
        assert_error_body(anonymous.get("/v1/models", headers={"Authorization": server.api_key}), 401)
        assert anonymous.get("/health").status_code == 200  # health and metrics stay open
        assert anonymous.get("/metrics").status_code == 200


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_the_bearer_scheme_is_case_insensitive(server, scheme):
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {server.api_key}"}, timeout=30)
    assert r.status_code == 200, r.text


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
        assert post(http, path, bad).status_code == status, name
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
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
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


def _stream_text(server, body: dict) -> tuple[str, str | None, list[dict]]:
    """A completion stream's text, its last finish_reason and every event."""
    events = []
    with httpx.stream("POST", server.url + COMPLETIONS, json={**body, "stream": True}, headers=server.headers(),
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    chunks = [e["choices"][0] for e in events if e.get("choices")]
    return "".join(c["text"] for c in chunks), (chunks[-1]["finish_reason"] if chunks else None), events


@pytest.mark.parametrize("fields", [dict(temperature=1e-40), dict(temperature=1e-38), dict(top_p=1e-46)],
                         ids=["temperature 1e-40", "temperature 1e-38", "top_p 1e-46"])
def test_extreme_sampling_values_are_served_and_fail_nobody(server, http, fields):
    base = completion(prompt="The quick brown fox", max_tokens=10, ignore_eos=True)
    greedy = http.post(COMPLETIONS, json={**base, "temperature": 0}).json()["choices"][0]["text"]
    results = {}
    beside = threading.Thread(target=lambda: results.setdefault("beside", _stream_text(server, {**base, "temperature": 0})))
    beside.start()
    r = http.post(COMPLETIONS, json={**base, "seed": 1, **fields})
    beside.join(60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy  # a temperature under 1e-5 is greedy; top_p 1e-46 keeps the top
    assert results["beside"][0] == greedy and results["beside"][1] == "length"


def test_a_poisoned_request_fails_alone_over_http(server, http, monkeypatch):
    """One request's params are broken behind validation's back (1/T overflows in the sampler):
    it gets a 500 (or an error event when streamed); the requests beside it finish with the
    text they get alone; nothing leaks."""
    engine, real_add = server.engine, server.engine.add_request

    def add(prompt, params):
        if prompt[:2] == [1, 1]:  # the marker of the poisoned request
            params.temperature = 1e-40
        return real_add(prompt, params)

    prompts = ["The quick brown fox", "Hello, world!", "One two three"]
    base = dict(max_tokens=8, ignore_eos=True, temperature=0)
    alone = [http.post(COMPLETIONS, json=completion(prompt=p, **base)).json()["choices"][0]["text"] for p in prompts]
    monkeypatch.setattr(engine, "add_request", add)
    results: dict = {}
    threads = [threading.Thread(target=lambda i=i, p=p: results.__setitem__(i, _stream_text(
        server, completion(prompt=p, **base)))) for i, p in enumerate(prompts)]
    threads.append(threading.Thread(target=lambda: results.__setitem__("bad", http.post(
        COMPLETIONS, json=completion(prompt=[1, 1, 5, 6], **base)))))
    threads.append(threading.Thread(target=lambda: results.__setitem__("bad stream", _stream_text(
        server, completion(prompt=[1, 1, 7], **base)))))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i][:2] for i in range(len(prompts))] == [(text, "length") for text in alone]
    assert_error_body(results["bad"], 500)
    bad_events = results["bad stream"][2]
    assert bad_events and "error" in bad_events[-1] and bad_events[-1]["error"]["type"] == "server_error"
    stats = http.get("/v1/stats").json()
    assert stats["requests"]["running"] == 0 and stats["kv"]["pages_used"] == 0


def test_openapi_json_describes_every_endpoint(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model_id}", "/health",
            "/v1/stats", "/metrics"} <= set(doc["paths"])
    chat_op = doc["paths"][CHAT]["post"]
    assert chat_op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert chat_op["security"] == [{"bearer": []}] and "401" in chat_op["responses"]
    seed = doc["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]
    assert {"minimum": -(2**63), "maximum": 2**63 - 1}.items() <= seed["anyOf"][0].items()
