"""The bounds a request is held to before any expensive work (protocol.py), the worker
pools' admission and shutdown (pools.py), and the responses store's byte bound."""

import argparse
import asyncio
import threading
import time

import pytest

from moeferry.errors import ConfigError
from moeferry.server.pools import WorkPool
from moeferry.server.protocol import (MAX_CHARS_PER_TOKEN, MAX_MESSAGES, MAX_METADATA_KEYS, APIError,
                                      ChatCompletionRequest, CompletionRequest)
from moeferry.server.responses import InputMessage, ResponsesRequest, ResponseStore


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("field", ["n", "presence_penalty", "frequency_penalty", "stream", "logprobs", "temperature",
                                   "ignore_eos", "stream_options"])
def test_a_nullable_field_sent_as_null_takes_its_default(field):
    assert getattr(chat(**{field: None}), field) == getattr(chat(), field)


def test_completions_echo_and_n_as_null_take_their_defaults():
    body = CompletionRequest.model_validate({"prompt": "x", "echo": None, "n": None, "logprobs": None})
    assert (body.echo, body.n, body.logprobs) == (False, 1, None)
    body.check(context_limit=64)


def test_a_prompt_past_what_the_context_can_hold_is_refused_before_tokenizing():
    limit = 100
    CompletionRequest.model_validate({"prompt": "w" * (limit * MAX_CHARS_PER_TOKEN)}).check(limit)
    with pytest.raises(APIError) as info:
        CompletionRequest.model_validate({"prompt": "w" * (limit * MAX_CHARS_PER_TOKEN + 1)}).check(limit)
    assert (info.value.status, info.value.param, info.value.code) == (400, "prompt", "context_length_exceeded")
    calls = [{"id": "c", "function": {"name": "f", "arguments": "x" * 1000}}]
    many = [{"role": "assistant", "content": None, "tool_calls": calls}] * 2
    with pytest.raises(APIError) as info:
        ChatCompletionRequest.model_validate({"messages": many}).check(limit)
    assert info.value.param == "messages"


def test_message_and_input_item_counts_are_bounded():
    with pytest.raises(Exception, match=f"at most {MAX_MESSAGES}"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)})
    with pytest.raises(Exception, match=f"at most {MAX_MESSAGES}"):
        ResponsesRequest.model_validate({"input": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)})
    assert len(ResponsesRequest.model_validate({"input": "x" * (MAX_MESSAGES + 1)}).input) == MAX_MESSAGES + 1


def test_metadata_is_held_to_openais_limits():
    ResponsesRequest.model_validate({"input": "x", "metadata": {f"k{i}": "v" * 512 for i in range(16)}})
    for metadata in ({f"k{i}": "v" for i in range(MAX_METADATA_KEYS + 1)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        with pytest.raises(Exception, match="metadata"):
            ResponsesRequest.model_validate({"input": "x", "metadata": metadata})


def test_a_reasoning_item_takes_only_its_own_fields_and_counts_its_text():
    item = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "abc"}]}
    assert ResponsesRequest.model_validate({"input": [item]}).prompt_chars() == 3
    with pytest.raises(Exception):
        ResponsesRequest.model_validate({"input": [{**item, "padding": "x" * 100}]})


def test_the_response_store_is_bounded_in_bytes_and_drops_the_oldest():
    store = ResponseStore(size=100, max_bytes=20_000)
    for i in range(10):
        store.put({"id": f"r{i}", "output": []}, [InputMessage(role="user", content="x" * 5000)])
    assert store.bytes <= 20_000
    assert list(store.entries) == ["r7", "r8", "r9"]
    store.put({"id": "huge", "output": []}, [InputMessage(role="user", content="x" * 30_000)])
    assert "huge" not in store.entries and "r9" in store.entries
    with pytest.raises(APIError):
        store.get("r0", "previous_response_id")


def test_an_empty_api_key_is_refused_in_one_line():
    from moeferry.server.app import ServerConfig

    args = argparse.Namespace(host="h", port=1, api_key="", served_model_name=None, log_interval=0,
                              tool_call_parser=None)
    with pytest.raises(ConfigError, match="--api-key is empty") as info:
        ServerConfig.from_args(args)
    assert "\n" not in str(info.value)


def test_the_cli_refuses_an_empty_api_key_before_loading_anything(capsys):
    from moeferry.cli import main

    assert main(["serve", "--api-key", "", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--api-key is empty" in err


# ---- pools ----------------------------------------------------------------------------------
def test_a_full_pool_refuses_at_once_with_retry_after():
    release = threading.Event()

    async def main():
        pool = WorkPool("test", workers=1, queue_limit=1)
        running = asyncio.ensure_future(pool.run(release.wait))
        queued = asyncio.ensure_future(pool.run(lambda: "queued"))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(APIError) as info:
            await pool.run(lambda: "refused")
        assert time.monotonic() - started < 0.1
        assert info.value.status == 503 and info.value.headers == {"Retry-After": "1"}
        release.set()
        assert await running is True and await queued == "queued"
        assert pool.admitted == 0
        pool.close()

    asyncio.run(main())


def test_a_job_timed_out_keeps_its_place_until_it_returns_and_a_left_job_never_runs():
    release = threading.Event()
    ran = []

    async def main():
        pool = WorkPool("test", workers=1, queue_limit=1)
        with pytest.raises(asyncio.TimeoutError):
            await pool.run(release.wait, timeout=0.05)
        left = asyncio.ensure_future(pool.run(lambda: ran.append(1)))
        await asyncio.sleep(0.05)
        left.cancel()
        await asyncio.sleep(0.01)
        with pytest.raises(APIError):  # the timed-out job still holds a place, the cancelled one the other
            await pool.run(lambda: None)
        release.set()
        for _ in range(100):
            if pool.admitted == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.admitted == 0 and ran == []
        pool.close()

    asyncio.run(main())


def test_closing_a_pool_answers_every_waiting_caller_with_a_503_at_once():
    release = threading.Event()

    async def main():
        pool = WorkPool("test", workers=1, queue_limit=4)
        waiting = [asyncio.ensure_future(pool.run(release.wait)) for _ in range(3)]
        await asyncio.sleep(0.05)
        started = time.monotonic()
        pool.close()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert time.monotonic() - started < 0.5
        assert all(isinstance(r, APIError) and r.status == 503 for r in results)
        with pytest.raises(APIError):
            await pool.run(lambda: None)
        release.set()

    asyncio.run(main())
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("moeferry-test"))
