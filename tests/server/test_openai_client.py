"""The official `openai` client against the server: chat and completions, streaming and not,
the model list; greedy streams equal their non-streamed answers; concurrent streams each
equal the same request run alone."""

import asyncio

import openai
import pytest

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)


def test_model_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["moeferry-tiny-moe"]
    assert client.models.retrieve("moeferry-tiny-moe").id == "moeferry-tiny-moe"


def test_chat_completion(client):
    out = client.chat.completions.create(model="moeferry-tiny-moe", messages=CHAT, max_tokens=12, **GREEDY)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and choice.message.content
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert 0 <= out.usage.prompt_tokens_details.cached_tokens < out.usage.prompt_tokens  # the client reads it


def test_chat_stream_equals_non_streamed(client):
    full = client.chat.completions.create(model="moeferry-tiny-moe", messages=CHAT, max_completion_tokens=16,
                                          **GREEDY)
    stream = client.chat.completions.create(model="moeferry-tiny-moe", messages=CHAT, max_completion_tokens=16,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream_equals_non_streamed(client):
    full = client.completions.create(model="moeferry-tiny-moe", prompt="Hello, world!", max_tokens=16, **GREEDY)
    assert full.object == "text_completion" and full.usage.completion_tokens == 16
    stream = client.completions.create(model="moeferry-tiny-moe", prompt="Hello, world!", max_tokens=16,
                                       stream=True, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_takes_token_ids(client, server):
    ids = server.engine.tokenizer.encode("The quick brown fox")
    by_ids = client.completions.create(model="moeferry-tiny-moe", prompt=ids, max_tokens=8, **GREEDY)
    by_text = client.completions.create(model="moeferry-tiny-moe", prompt="The quick brown fox", max_tokens=8,
                                        **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_stop_string_ends_the_text_before_it(client):
    prompt, n = "One two three", 24
    free = client.completions.create(model="moeferry-tiny-moe", prompt=prompt, max_tokens=n, **GREEDY)
    text = free.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"the greedy text {text!r} has no usable stop string"
    cut = client.completions.create(model="moeferry-tiny-moe", prompt=prompt, max_tokens=n, stop=[stop], **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.find(stop)]


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model="moeferry-tiny-moe", prompt="Numbers:", max_tokens=12, temperature=1.0,
                                         top_p=0.9, seed=seed, extra_body={"top_k": 50, "ignore_eos": True})

    assert sample(7).choices[0].text == sample(7).choices[0].text


def test_eight_concurrent_streams_each_equal_running_alone(server, client):
    prompts = [f"Numbers: {i} {i + 1} {i + 2}" for i in range(8)]
    alone = [client.completions.create(model="moeferry-tiny-moe", prompt=p, max_tokens=20, **GREEDY).choices[0].text
             for p in prompts]

    async def stream_all():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)

        async def one(prompt):
            stream = await aclient.completions.create(model="moeferry-tiny-moe", prompt=prompt, max_tokens=20,
                                                      stream=True, **GREEDY)
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(stream_all()) == alone


def test_chat_log_probs_through_the_client(client):
    out = client.chat.completions.create(model="moeferry-tiny-moe", messages=CHAT, max_tokens=6, logprobs=True,
                                         top_logprobs=3, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely token
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    assert "".join(entry.token for entry in content) == out.choices[0].message.content


def test_completion_log_probs_streamed_and_not(client):
    full = client.completions.create(model="moeferry-tiny-moe", prompt="Hello, world!", max_tokens=6, logprobs=2,
                                     **GREEDY)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == full.choices[0].text and lp.text_offset[0] == 0
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="moeferry-tiny-moe", prompt="Hello, world!", max_tokens=6, logprobs=2, stream=True, **GREEDY)
        if c.choices and c.choices[0].logprobs is not None]
    assert sum((c.token_logprobs for c in streamed), []) == pytest.approx(lp.token_logprobs)


def test_n_samples_of_one_prompt(client):
    out = client.chat.completions.create(model="moeferry-tiny-moe", messages=CHAT, max_tokens=8, n=3, seed=11,
                                         temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) > 1  # each choice its own draw
    assert out.usage.completion_tokens == 24
    again = client.chat.completions.create(model="moeferry-tiny-moe", messages=CHAT, max_tokens=8, n=3, seed=11,
                                           temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == texts  # seeded: the same three answers
    stream = client.chat.completions.create(model="moeferry-tiny-moe", messages=CHAT, max_tokens=8, n=3, seed=11,
                                            temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    streamed = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
