"""Chat: LLM.chat puts conversations through the chat template with the generation prompt and
answers as generate does; --chat-template FILE replaces the tokenizer's template for LLM.chat,
`generate --chat` and the server's chat endpoint, and a file that is missing or does not
render is one line."""

import httpx
import pytest

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError
from moeferry.sampling import InvalidRequest

HELLO = [{"role": "user", "content": "Hello"}]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def options(model_cache):
    from moeferry.default_model import RANDOM_MODEL_NAME

    return dict(model=RANDOM_MODEL_NAME, device="cpu", dtype="float32", max_model_len=64, max_running_requests=4)


@pytest.fixture(scope="module")
def llm(options):
    return LLM(**options)


@pytest.fixture
def template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    return str(path)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chat_applies_the_template_with_the_generation_prompt_and_answers_as_generate(llm):
    text = llm.tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    out = llm.chat(HELLO, GREEDY)
    assert len(out) == 1 and out[0].prompt_token_ids == ids_of(llm.tokenizer, text)
    assert out[0].token_ids == llm.generate(ids_of(llm.tokenizer, text), GREEDY)[0].token_ids


def test_chat_takes_a_list_of_conversations_each_answered_as_alone(llm):
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    both = llm.chat([HELLO, other], GREEDY)
    assert [o.token_ids for o in both] == [llm.chat(c, GREEDY)[0].token_ids for c in (HELLO, other)]


@pytest.mark.parametrize("messages", [[], [[]]])
def test_an_empty_conversation_is_refused_naming_messages(llm, messages):
    with pytest.raises(InvalidRequest, match="messages must be a conversation") as caught:
        llm.chat(messages)
    assert caught.value.param == "messages"


def test_a_chat_template_file_replaces_the_tokenizers_everywhere(options, llm, template, capsys):
    from moeferry.cli import main
    from tests.server.conftest import running_server

    own = LLM(chat_template=template, **options)
    expected = ids_of(own.tokenizer, "[user]Hello[assistant]")
    answer = own.chat(HELLO, GREEDY)[0]
    assert answer.prompt_token_ids == expected and answer.text != llm.chat(HELLO, GREEDY)[0].text

    assert main(["generate", "--model", options["model"], "--device", "cpu", "--dtype", "float32", "--max-model-len",
                 "64", "--chat-template", template, "--chat", "--prompt", "Hello", "--max-tokens", "6",
                 "--ignore-eos"]) == 0
    assert capsys.readouterr().out == answer.text + "\n"

    with running_server(model=options["model"], chat_template=template, max_model_len=64,
                        max_running_requests=4) as server:
        body = httpx.post(server.url + "/v1/chat/completions", headers=server.headers(), timeout=60,
                          json={"messages": HELLO, "max_tokens": 6, "temperature": 0, "ignore_eos": True}).json()
    assert body["usage"]["prompt_tokens"] == len(expected)
    assert body["choices"][0]["message"]["content"] == answer.text


@pytest.mark.parametrize("text,says", [
    ("{% for m in messages %}{{ m['content'] }}", "the chat template does not render: "),
    ("{{ raise_exception('roles must alternate') }}", "does not render: roles must alternate"),
])
def test_a_chat_template_that_does_not_render_is_one_line_before_the_weights_load(options, tmp_path, text, says,
                                                                                    monkeypatch):
    import moeferry.engine.engine

    monkeypatch.setattr(moeferry.engine.engine, "ModelRunner", lambda *a: pytest.fail("the weights were loaded"))
    path = tmp_path / "bad.jinja"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        LLM(chat_template=str(path), **options)
    message = str(caught.value)
    assert message.startswith(f"--chat-template {path}: ") and says in message and "\n" not in message
