"""A bounded soak: 200 mixed requests (greedy, seeded sampling, stop strings, penalties; streamed
or not), 8 at a time, 15% of them dropped by their client mid-stream. Nothing answers 5xx,
every request gets its answer (or was dropped), and afterwards nothing runs and the KV pages
are back at their baseline."""

import asyncio
import json
import random

import httpx

REQUESTS, CONCURRENCY, DISCONNECT_SHARE = 200, 8, 0.15
PROMPTS = ["The quick brown fox", "Hello, world!", "One two three four", "What is the capital of France?",
           "A journey of a thousand miles"]
PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def plan(rng: random.Random) -> list[dict]:
    """Each request's body and what its client does (kind, stream, disconnect)."""
    requests = []
    for i in range(REQUESTS):
        kind = rng.choice(["greedy", "sampled", "stop", "penalties"])
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 24), "temperature": 0}
        if kind == "sampled":
            body.update(temperature=rng.choice([0.7, 1.0, 1.3]), top_p=0.9, top_k=rng.choice([-1, 20]), seed=i)
        elif kind == "stop":
            body.update(stop=[rng.choice(["e", " ", "o"])], ignore_eos=True)
        elif kind == "penalties":
            body[rng.choice(PENALTY_FIELDS)] = 1.2
        disconnect = rng.random() < DISCONNECT_SHARE
        requests.append({"kind": kind, "body": body, "stream": disconnect or rng.random() < 0.5,
                         "disconnect": disconnect})
    return requests


async def run_one(client: httpx.AsyncClient, req: dict) -> dict:
    body = {**req["body"], "stream": req["stream"]}
    if not req["stream"]:
        r = await client.post("/v1/completions", json=body)
        return {"status": r.status_code, "answer": r.json()}
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "answer": json.loads(await r.aread())}
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if req["disconnect"]:
                    return {"status": 200, "dropped": True}  # leaving the block closes the connection
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    return {"status": 200, "done": events[-1] == "[DONE]", "finish": chunks[-1]["finish_reason"],
            "text": "".join(c["text"] for c in chunks)}


async def soak(server) -> list[dict]:
    reqs, gate = plan(random.Random(17)), asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=120) as client:
        async def bounded(req):
            async with gate:
                return {**req, **await run_one(client, req)}

        return await asyncio.gather(*(bounded(r) for r in reqs))




def test_a_soak_of_mixed_requests_loses_nothing_and_frees_every_page(server):
    http = httpx.Client(base_url=server.url, headers=server.headers(), timeout=60)
    before = server.wait_idle(http)
    results = asyncio.run(soak(server))
    after = server.wait_idle(http)

    assert not [r for r in results if r["status"] >= 500], "a request got a 5xx"
    assert len(results) == REQUESTS
    for r in results:
        assert r["status"] == 200, r
    answered = [r for r in results if r["status"] == 200 and not r.get("dropped")]
    assert all(r["done"] for r in answered if r["stream"]), "a stream ended without [DONE]"
    finishes = [r["finish"] if r["stream"] else r["answer"]["choices"][0]["finish_reason"] for r in answered]
    assert set(finishes) <= {"stop", "length"}
    accepted = sum(1 for r in results if r["status"] == 200)
    done = {k: after["requests"][k] - before["requests"][k] for k in ("finished", "aborted", "failed")}
    assert done["finished"] + done["aborted"] == accepted and done["failed"] == 0, done  # no request lost
    assert done["aborted"] >= 1, done  # a dropped stream is aborted, not run to its end
    assert sum(r.get("dropped", False) for r in results) >= REQUESTS * DISCONNECT_SHARE / 2
    assert after["kv"]["pages_used"] == before["kv"]["pages_used"] == 0
    pool = server.engine.scheduler.pool
    assert pool.free_pages == pool.num_pages
    _greedy_answers_agree(answered)


def _greedy_answers_agree(answered: list[dict]) -> None:
    """Greedy requests with the same prompt and length got the same text, whatever ran beside them."""
    texts: dict = {}
    for r in answered:
        if r["kind"] == "greedy":
            text = r["text"] if r["stream"] else r["answer"]["choices"][0]["text"]
            texts.setdefault((r["body"]["prompt"], r["body"]["max_tokens"]), set()).add(text)
    assert texts and all(len(v) == 1 for v in texts.values()), texts
