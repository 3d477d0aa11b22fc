"""--model: a directory, the built-in name, or a Hugging Face model id found in the local
Hugging Face cache (HF_HUB_CACHE or HF_HOME), offline; a missing id is one line saying how to
get it."""

import socket

import pytest

from moeferry import LLM
from moeferry.config import ConfigError
from moeferry.model_source import hub_cache_dir, resolve_model
from tests.support.fixtures import family_configs, make_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub(cache, repo_id: str) -> str:
    """A hub cache holding `repo_id` as huggingface_hub lays it out (refs/main naming the
    snapshot of a tiny qwen3_moe checkpoint); returns the snapshot's directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    make_checkpoint(dict(family_configs())["qwen3_moe"], str(snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return str(snapshot)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model lookup touched the network")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_model_id_in_the_hub_cache_loads_from_its_snapshot_offline(hub, no_network):
    snapshot = fake_hub(hub, "tiny-org/tiny-moe")
    llm = LLM("tiny-org/tiny-moe", device="cpu", dtype="float32", max_model_len=32)
    assert llm.engine.ec.model == snapshot
    assert llm.engine.model_name == "tiny-org/tiny-moe"  # what the server calls it
    assert len(llm.generate([1, 2, 3], None)[0].token_ids) == 16


def test_hf_home_locates_the_cache_when_hf_hub_cache_is_unset(tmp_path, monkeypatch, no_network):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snapshot = fake_hub(tmp_path / "hf" / "hub", "tiny-org/tiny-moe")
    assert hub_cache_dir() == str(tmp_path / "hf" / "hub")
    assert resolve_model("tiny-org/tiny-moe").path == snapshot


def test_a_directory_is_taken_as_it_is_and_named_after_itself(tmp_path):
    d = tmp_path / "my-checkpoint"
    d.mkdir()
    assert resolve_model(str(d)).path == str(d) and resolve_model(str(d)).name == "my-checkpoint"


def test_a_model_id_missing_from_the_cache_says_where_it_looked_and_how_to_get_it(hub, no_network):
    with pytest.raises(ConfigError) as caught:
        resolve_model("Qwen/Qwen3-30B-A3B")
    message = str(caught.value)
    assert "\n" not in message
    assert "not a directory and not in the local Hugging Face cache" in message and str(hub) in message
    assert "`hf download Qwen/Qwen3-30B-A3B`" in message


def test_a_missing_model_id_on_the_command_line_is_one_line(hub, capsys):
    from moeferry.cli import main

    assert main(["generate", "--model", "Qwen/Qwen3-30B-A3B", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeferry generate: error: --model Qwen/Qwen3-30B-A3B: not a directory")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_path_that_is_no_model_id_says_the_directory_does_not_exist(tmp_path):
    with pytest.raises(ConfigError, match="model directory .* does not exist"):
        resolve_model(str(tmp_path / "a" / "b" / "c"))
