"""No request field is silently ignored: every field of OpenAI's chat and completions APIs and of
vLLM's extensions (listed here from their documentation) is either honoured, with a test that
shows its effect, or refused with a 400 naming it; a field neither has is a 400 naming it too.
Then the honoured vLLM fields, each against the built-in model."""

import json
import os

import httpx
import pytest

from moeferry.server.protocol import parse_request
from moeferry.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

HERE = os.path.dirname(__file__)

# OpenAI's API reference: Create chat completion, Create completion (request bodies).
OPENAI_CHAT = {
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options"}
OPENAI_COMPLETIONS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user"}
# vLLM's OpenAI-compatible server: the extra parameters of both APIs (sampling, then the rest).
VLLM_BOTH = {
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words",
    "add_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs", "priority",
    "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs"}
VLLM_CHAT = VLLM_BOTH | {
    "best_of", "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "include_reasoning"}
VLLM_COMPLETIONS = VLLM_BOTH | {"prompt_embeds"}

# Honoured fields: the test file (under tests/) that shows each one's effect; it must name the field.
HONOURED = {
    **dict.fromkeys(["messages", "model", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
                     "temperature", "top_p", "seed", "stop", "logprobs", "top_logprobs", "prompt", "top_k",
                     "ignore_eos"], "server/test_openai_client.py"),
    **dict.fromkeys(["frequency_penalty", "presence_penalty", "logit_bias", "min_p", "repetition_penalty"],
                    "engine/test_device_sampling.py"),
    **dict.fromkeys(["response_format", "guided_regex", "guided_choice", "structured_outputs"],
                    "server/test_structured_output.py"),
    **dict.fromkeys(["tools", "tool_choice", "parallel_tool_calls"], "server/test_tools.py"),
    **dict.fromkeys(["chat_template_kwargs", "include_reasoning"], "server/test_reasoning.py"),
    **dict.fromkeys(["min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "truncate_prompt_tokens", "add_special_tokens", "request_id",
                     "add_generation_prompt", "continue_final_message", "echo", "reasoning_effort", "stop_token_ids",
                     "chat_template", "user", "guided_json", "prompt_logprobs"], "server/test_request_fields.py"),
}
# A value that means something (not the neutral one) for each field a model refuses.
MEANINGFUL = {
    "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto", "functions": [{"name": "f"}],
    "metadata": {"k": "v"}, "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "prompt_cache_key": "k", "safety_identifier": "u", "service_tier": "flex", "store": True, "verbosity": "low",
    "web_search_options": {}, "best_of": 2, "echo": True, "suffix": "!", "use_beam_search": True,
    "length_penalty": 2.0, "allowed_token_ids": [1, 2], "bad_words": ["x"], "priority": 1,
    "logits_processors": ["m.P"], "return_tokens_as_token_ids": True, "return_token_ids": True, "cache_salt": "s",
    "kv_transfer_params": {}, "vllm_xargs": {"k": 1}, "guided_grammar": "root ::= \"a\"",
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ", "structural_tag": "{}",
    "documents": [{"title": "t", "text": "x"}], "mm_processor_kwargs": {"k": 1}, "prompt_embeds": "AAAA",
}
BASE = {ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]}, CompletionRequest: {"prompt": "hi"}}


def refusal(model, field: str) -> APIError | None:
    """The 400 a request with `field` set to a meaningful value gets before any work, or None."""
    try:
        body = parse_request(model, {**BASE[model], field: MEANINGFUL[field]})
        body.check()
    except APIError as exc:
        return exc
    return None


@pytest.mark.parametrize("model,official", [(ChatCompletionRequest, OPENAI_CHAT | VLLM_CHAT),
                                            (CompletionRequest, OPENAI_COMPLETIONS | VLLM_COMPLETIONS)],
                         ids=["chat", "completions"])
def test_every_official_field_is_honoured_with_a_test_or_refused_by_name(model, official):
    sources = {name: open(os.path.join(HERE, "..", name)).read() for name in set(HONOURED.values())}
    for field in sorted(official):
        assert field in model.model_fields, f"{field}: not declared, so a request with it is refused as unknown"
        if field in HONOURED and (field not in MEANINGFUL or refusal(model, field) is None):
            assert field in sources[HONOURED[field]], f"{field}: no test in {HONOURED[field]} names it"
            continue
        assert field in MEANINGFUL, f"{field}: neither honoured nor given a value to refuse"
        exc = refusal(model, field)
        assert exc is not None and exc.status == 400 and exc.param == field and field in exc.message, field


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_every_field_of_a_request_model_is_an_official_one(model):
    official = OPENAI_CHAT | VLLM_CHAT | OPENAI_COMPLETIONS | VLLM_COMPLETIONS
    assert set(model.model_fields) - official == set()


def test_an_unknown_field_is_refused_naming_it():
    with pytest.raises(APIError) as exc:
        parse_request(ChatCompletionRequest, {**BASE[ChatCompletionRequest], "temprature": 0.5})
    assert exc.value.status == 400 and exc.value.param == "temprature"


# ---- the honoured fields, against the built-in model -------------------------------------------
PROMPT = "It is a truth universally acknowledged, that a single man"
MSGS = [{"role": "user", "content": "Tell me of Mr. Darcy."}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as client:
        yield client


def complete(http, **fields):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def greedy_ids(http, prompt=PROMPT, n=12) -> list[int]:
    text = complete(http, prompt=prompt, max_tokens=n, ignore_eos=True)["choices"][0]["text"]
    return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_min_tokens_keeps_a_stop_token_from_ending_the_answer_early(http):
    first = greedy_ids(http)[0]
    early = complete(http, stop_token_ids=[first])
    assert early["usage"]["completion_tokens"] == 1 and early["choices"][0]["finish_reason"] == "stop"
    held = complete(http, stop_token_ids=[first], min_tokens=5)
    assert held["usage"]["completion_tokens"] >= 5


def test_include_stop_str_in_output_keeps_the_stop_string(http):
    text = complete(http, ignore_eos=True)["choices"][0]["text"]
    stop = text[4:8]
    assert stop.strip(), text
    cut = complete(http, stop=[stop])["choices"][0]["text"]
    kept = complete(http, stop=[stop], include_stop_str_in_output=True)["choices"][0]["text"]
    assert kept == cut + stop and not cut.endswith(stop)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    out = complete(http, truncate_prompt_tokens=4)
    assert out["usage"]["prompt_tokens"] == 4 < len(ids)
    assert out["choices"][0]["text"] == complete(http, prompt=ids[-4:])["choices"][0]["text"]


def test_echo_puts_the_prompt_before_the_answer_streamed_or_not(http):
    answer = complete(http)["choices"][0]["text"]
    assert complete(http, echo=True)["choices"][0]["text"] == PROMPT + answer
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "echo": True, "stream": True}
    texts = []
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                texts += [c["text"] for c in httpx.Response(200, content=line[6:]).json()["choices"]]
    assert "".join(texts) == PROMPT + answer


def test_a_list_of_prompts_gets_n_choices_each_in_order(http):
    other = "Mr. Bennet was so odd a mixture of quick parts"
    alone = [complete(http, prompt=p)["choices"][0]["text"] for p in (PROMPT, other)]
    out = complete(http, prompt=[PROMPT, other], n=2)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
    lengths = [http.post("/tokenize", json={"prompt": p}).json()["count"] for p in (PROMPT, other)]
    assert out["usage"]["prompt_tokens"] == sum(lengths)


def test_prompt_logprobs_give_each_prompt_token_its_logprob_in_vllms_shape(http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    # temperature 1: `logprobs` are then the model's own distribution, as prompt log-probs are
    out = complete(http, prompt=ids, max_tokens=1, temperature=1.0, seed=1, logprobs=5, prompt_logprobs=5)
    prompt, first = out["choices"][0]["prompt_logprobs"], out["choices"][0]["logprobs"]
    assert len(prompt) == len(ids) == out["usage"]["prompt_tokens"] and prompt[0] is None
    for token, entry in zip(ids[1:], prompt[1:]):
        assert list(entry)[0] == str(token) and 5 <= len(entry) <= 6  # the prompt token's first, then the top 5
        assert set(entry[str(token)]) == {"logprob", "rank", "decoded_token"}
        assert entry[str(token)]["decoded_token"] == http.post("/detokenize", json={"tokens": [token]}).json()["prompt"]
        ranked = sorted(entry.values(), key=lambda lp: lp["rank"])
        assert [lp["rank"] for lp in ranked if lp["rank"] <= 5] == [1, 2, 3, 4, 5]
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(ranked, ranked[1:]))
    # one token more: the prompt's log-probs again (causal), then the distribution the answer's
    # first token was drawn from, as the sampler reported it
    longer = complete(http, prompt=ids + [ids[3]], max_tokens=1, prompt_logprobs=5)["choices"][0]["prompt_logprobs"]
    for a, b in zip(prompt[1:], longer[1:]):
        assert {t: lp["rank"] for t, lp in a.items()} == {t: lp["rank"] for t, lp in b.items()}
        assert max(abs(lp["logprob"] - b[t]["logprob"]) for t, lp in a.items()) < 1e-4
    last = {lp["decoded_token"]: lp["logprob"] for lp in longer[-1].values() if lp["rank"] <= 5}
    assert last.keys() == first["top_logprobs"][0].keys()
    assert all(abs(last[t] - v) < 1e-4 for t, v in first["top_logprobs"][0].items())


def test_prompt_logprobs_reach_every_choice_chat_and_echo(http):
    out = complete(http, n=2, temperature=1.0, prompt_logprobs=0, echo=True)
    prompts = [c["prompt_logprobs"] for c in out["choices"]]
    assert prompts[0] == prompts[1] and len(prompts[0]) == out["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in prompts[0][1:]) and out["choices"][0]["text"].startswith(PROMPT)
    assert "prompt_logprobs" not in complete(http)["choices"][0]
    chat = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "prompt_logprobs": 1}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) in (1, 2) for entry in chat["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in chat["choices"][0]
    # vLLM's rule: a stream may ask for 0 (nothing is computed or sent), not more
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "prompt_logprobs": 0}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200 and "prompt_logprobs" not in response.read().decode()


def test_request_id_names_the_answer(http):
    assert complete(http, request_id="abc")["id"] == "cmpl-abc"


def test_guided_json_holds_the_answer_to_its_schema(http):
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    out = complete(http, guided_json=schema, max_tokens=30)["choices"][0]
    assert json.loads(out["text"])["a"] in ("x", "y") and out["finish_reason"] == "stop"


def test_user_is_an_identifier_that_leaves_the_answer_as_it_is(http):
    assert complete(http, user="reader-1")["choices"][0]["text"] == complete(http)["choices"][0]["text"]


def test_skip_special_tokens_false_keeps_them_in_the_text(server, http):
    from tests.support.scripted import scripted_answers

    with scripted_answers(server.engine, lambda prompt: "a<|im_start|>b" if "special" in prompt else None):
        skipped = complete(http, prompt="special", max_tokens=8)["choices"][0]["text"]
        kept = complete(http, prompt="special", max_tokens=8, skip_special_tokens=False,
                        spaces_between_special_tokens=False)["choices"][0]["text"]
    assert skipped == "ab" and kept == "a<|im_start|>b"


def test_spaces_between_special_tokens_reaches_the_tokenizers_decode():
    from moeferry.tokenizer.tokenizer import IncrementalDetokenizer

    seen = []

    class Recorder:
        def decode(self, ids, **options):
            seen.append(options["spaces_between_special_tokens"])
            return "x" * len(ids)

    IncrementalDetokenizer(Recorder(), [1], spaces_between_special_tokens=False).push(2)
    assert seen and not any(seen)


def test_add_generation_prompt_and_continue_final_message_shape_the_chat_prompt(http):
    def rendered(**fields):
        ids = http.post("/tokenize", json={"messages": MSGS, **fields}).json()["tokens"]
        return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]

    assert rendered().endswith("<|im_start|>assistant\n")
    assert rendered(add_generation_prompt=False).endswith("<|im_end|>\n")
    partial = MSGS + [{"role": "assistant", "content": "He is"}]
    assert rendered(messages=partial, add_generation_prompt=False, continue_final_message=True).endswith("He is")
    response = http.post("/v1/chat/completions", json={"messages": partial, "add_generation_prompt": False,
                                                       "continue_final_message": True, "max_tokens": 4})
    assert response.status_code == 200, response.text
    refused = http.post("/v1/chat/completions", json={"messages": partial, "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(http):
    template = "{{ messages[0]['content'] }}|{{ reasoning_effort }}|{{ flavour }}"

    def rendered(**fields):
        ids = http.post("/tokenize", json={"messages": MSGS, "chat_template": template, **fields}).json()["tokens"]
        return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]

    assert rendered(chat_template_kwargs={"flavour": "tart", "reasoning_effort": "low"}) == \
        "Tell me of Mr. Darcy.|low|tart"
    out = http.post("/v1/chat/completions", json={"messages": MSGS, "chat_template": template, "max_tokens": 2,
                                                  "reasoning_effort": "high", "chat_template_kwargs": {"flavour": "x"}})
    assert out.status_code == 200 and out.json()["usage"]["prompt_tokens"] == \
        http.post("/tokenize", json={"prompt": "Tell me of Mr. Darcy.|high|x", "add_special_tokens": False}).json()["count"]


def test_add_special_tokens_is_the_tokenizers_choice_for_a_prompt(http):
    with_special = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    without = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert without == with_special[len(with_special) - len(without):]  # the built-in tokenizer adds none
    assert complete(http, add_special_tokens=False)["usage"]["prompt_tokens"] == len(without)


def test_responses_reasoning_effort_is_accepted_and_a_neutral_truncation_too(http):
    body = {"input": "Tell me of Mr. Darcy.", "max_output_tokens": 2, "reasoning": {"effort": "low"},
            "truncation": "disabled", "include": [], "background": False}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text


def test_responses_reasoning_effort_reaches_the_template():
    from moeferry.server.responses import ResponsesRequest

    body = ResponsesRequest.model_validate({"input": "x", "reasoning": {"effort": "high"}})
    assert body.template_options == {"template_kwargs": {"reasoning_effort": "high"}}
    assert ResponsesRequest.model_validate({"input": "x"}).template_options == {}
