"""The built-in models' chat template: without tools (and tool messages) it renders every
conversation exactly as the plain ChatML template it replaced, so no such prompt changed; a
tool message renders as Qwen's <tool_response> in a user turn, tools given or not; with tools,
the hermes block that the hermes parser reads back (a call rendered, then parsed, is the call)."""

import json

import pytest

from moeferry.default_model import BUILTIN_MODEL_DIR
from moeferry.tokenizer.tokenizer import load_tokenizer
from moeferry.tools.hermes import HermesParser
from moeferry.tools.stream import OutputStream

PLAIN_CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again\nwith lines"}],
    [{"role": "developer", "content": ""}, {"role": "user", "content": "{{ not jinja }} <tool_call>"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUILTIN_MODEL_DIR)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_the_template_renders_plain_chatml(tokenizer, messages, generation_prompt):
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                          chat_template=PLAIN_CHATML)
    assert ours == plain


def test_a_tool_message_renders_as_a_tool_response_in_a_user_turn(tokenizer):
    messages = [{"role": "assistant", "content": "first"}, {"role": "tool", "content": "result"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == \
        "<|im_start|>assistant\nfirst<|im_end|>\n<|im_start|>user\n<tool_response>\nresult\n</tool_response><|im_end|>\n"


def test_a_rendered_call_parses_back_into_the_same_call(tokenizer):
    call = {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    answer = text.split("<|im_start|>assistant")[-1].removesuffix("<|im_end|>\n")
    message = OutputStream(HermesParser()).message(answer)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [(call["name"], call["arguments"])]
