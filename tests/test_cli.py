"""The CLI: flags built from EngineConfig parse to the right types; the main job's command runs;
every user mistake ends in one argparse-style line and exit status 2, never a traceback."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from moeferry.cli import build_parser, engine_config_from_args, main


def test_engine_flags_parse_to_their_types():
    args = build_parser().parse_args([
        "generate", "--prompt", "x", "--hf-overrides", '{"num_hidden_layers": 2}', "--moe-strategy", "offload",
        "--moe-cache-slots", "64", "--moe-prefill-demand-tokens", "auto", "--moe-collect-stats",
        "--memory-ratio", "0.5"])
    ec = engine_config_from_args(args)
    assert ec.hf_overrides == {"num_hidden_layers": 2}
    assert ec.moe_cache_slots == 64 and ec.moe_prefill_demand_tokens == "auto"
    assert ec.moe_collect_stats is True and ec.memory_ratio == 0.5



def test_a_flag_on_by_default_has_a_no_form_and_one_off_by_default_has_none():
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["serve"])).enable_prefix_caching is True
    args = parser.parse_args(["serve", "--no-enable-prefix-caching", "--disable-cuda-graph"])
    ec = engine_config_from_args(args)
    assert ec.enable_prefix_caching is False and ec.disable_cuda_graph is True
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--no-disable-cuda-graph"])

def test_generate_on_the_default_model_streams_text(tmp_path):
    env = {"MOEFERRY_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "moeferry.cli", "generate", "--prompt", "Hello", "--max-tokens", "6",
                          "--ignore-eos"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[6 tokens, finish_reason=length]" in out.stderr


def test_a_bad_flag_value_is_a_clear_error(tmp_path):
    env = {"MOEFERRY_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "moeferry.cli", "generate", "--prompt", "Hi", "--moe-strategy", "offload",
                          "--moe-cache-slots", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2
    assert "fewer than one layer's 32" in out.stderr


def test_choices_come_from_the_registries():
    from moeferry.kernels.admission import POLICIES
    from moeferry.moe.strategies import strategy_names

    actions = {a.dest: a for a in subcommands()["serve"]._actions}
    assert tuple(actions["moe_cache_policy"].choices) == tuple(POLICIES)
    assert list(actions["moe_strategy"].choices) == strategy_names()


def subcommands() -> dict:
    return build_parser()._subparsers._group_actions[0].choices


def test_every_engine_option_declares_its_help_and_its_group():
    import dataclasses

    from moeferry.config import EngineConfig

    for f in dataclasses.fields(EngineConfig):
        assert f.metadata.get("help"), f.name
        assert f.metadata.get("group") in {"model", "runtime", "MoE", "memory", "scheduling", "MoE (developer)"}, f.name


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_flag_has_help_and_shows_its_default(command):
    from moeferry.cli import HelpFormatter

    parser = subcommands()[command]
    for action in parser._actions:
        assert action.help, action.dest
        if action.option_strings and action.dest != "help" and not action.required:
            assert "(default: " in HelpFormatter(command)._get_help_string(action), action.dest
    assert "%(default)s" not in parser.format_help()


@pytest.mark.parametrize("command,groups", [("generate", ["prompt", "sampling"]), ("serve", ["server"])])
def test_engine_flags_come_in_groups_after_the_commands_own(command, groups):
    titles = [g.title for g in subcommands()[command]._action_groups][2:]  # after positionals and options
    assert titles == groups + ["model", "runtime", "MoE", "memory", "scheduling", "MoE (developer)"]
    in_group = {a.dest: g.title for g in subcommands()[command]._action_groups for a in g._group_actions}
    assert in_group["max_model_len"] == "scheduling" and in_group["moe_cache_gb"] == "MoE"
    assert in_group["moe_host_dispatch"] == in_group["moe_timeline"] == "MoE (developer)"


def run_cli(argv, capsys) -> str:
    """Run `moeferry argv` in this process; assert exit status 2 and one error line; return it."""
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if " error: " in line]
    assert len(lines) == 1, err
    return lines[0]


# (flags after `generate --prompt hi`, what the one line says) -- each fails before a model loads
BEFORE_LOADING = [
    (["--max-tokens", "0"], "argument --max-tokens: max_tokens must be >= 1"),
    (["--temperature", "-1"], "argument --temperature: temperature must be in [0.0, 100.0]"),
    (["--top-p", "0"], "argument --top-p: top_p must be in (0.0, 1.0]"),
    (["--sampling-seed", str(2**64)], "argument --sampling-seed: seed must be in"),
    (["--max-running-requests", "0"], "--max-running-requests must be >= 1, got 0"),
    (["--max-model-len", "0"], "--max-model-len must be >= 2, got 0"),
    (["--max-model-len", "-5"], "--max-model-len must be >= 2, got -5"),
    (["--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens must be >= 1"),
    (["--memory-ratio", "1.5"], "--memory-ratio must be in (0, 1]"),
    (["--memory-ratio", "nan"], "--memory-ratio must be in (0, 1]"),
    (["--num-tokens", "8"], "--num-tokens 8 is less than one KV page of 16 tokens (--page-size)"),
    (["--moe-cache-gb", "12"], "--moe-cache-gb is read only by --moe-strategy offload or hybrid; under --moe-strategy gpu"),
    (["--moe-strategy", "uva", "--moe-cache-policy", "lru"], "--moe-cache-policy is read only by --moe-strategy "
                                                               "offload or hybrid; under --moe-strategy uva"),
    (["--moe-cache-slots", "64"], "--moe-cache-slots is read only by --moe-strategy offload"),
    (["--moe-collect-stats"], "--moe-collect-stats is read only by --moe-strategy offload or uva or hybrid or cpu"),
    (["--moe-strategy", "offload", "--moe-lrfu-decay", "0.3"], "--moe-lrfu-decay is read only by "
                                                                 "--moe-cache-policy lrfu"),
    (["--moe-strategy", "offload", "--moe-cache-slots", "64", "--moe-cache-gb", "1"], "give one of them"),
    (["--moe-strategy", "offload", "--moe-cache-policy", "bogus"], "argument --moe-cache-policy: invalid choice"),
    (["--moe-prefill-demand-tokens", "lots"], "give a token count or 'auto'"),
    (["--hf-overrides", "[1]"], "argument --hf-overrides: not a JSON object"),
    (["--hf-overrides", "{"], "argument --hf-overrides: not JSON"),
    (["--device", "cuda"], "--device cuda asked for, but torch sees no CUDA GPU"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template /no/such/template.jinja: no such file"),
]


@pytest.mark.parametrize("flags,says", BEFORE_LOADING, ids=[" ".join(f) for f, _ in BEFORE_LOADING])
def test_a_bad_flag_is_one_line_before_anything_loads(flags, says, capsys, monkeypatch):
    import moeferry.llm

    monkeypatch.setattr(moeferry.llm, "LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    line = run_cli(["generate", "--prompt", "hi", *flags], capsys)
    assert line.startswith(("moeferry generate: error: ", "moeferry generate: error: argument")), line
    assert says in line


def test_an_empty_prompt_is_one_line(capsys):
    assert "argument --prompt: the prompt is empty" in run_cli(["generate", "--prompt", ""], capsys)


def test_serve_flags_out_of_range_are_one_line(capsys):
    assert "argument --port: 70000 is out of range" in run_cli(["serve", "--port", "70000"], capsys)
    assert "argument --log-interval" in run_cli(["serve", "--log-interval", "-1"], capsys)


@pytest.fixture(scope="module")
def default_dir(model_cache):
    from moeferry.default_model import ensure_default_model

    return ensure_default_model()


def _variant(default_dir, tmp_path, keep=("config.json",)) -> str:
    out = tmp_path / "m"
    out.mkdir()
    for name in keep:
        shutil.copy(os.path.join(default_dir, name), out / name)
    return str(out)


def test_a_config_only_directory_without_a_tokenizer_is_one_line(default_dir, tmp_path, capsys):
    cfg = _variant(default_dir, tmp_path)  # the README's dummy example, before its tokenizer files were added
    line = run_cli(["generate", "--model", cfg, "--load-format", "dummy", "--hf-overrides", '{"num_hidden_layers": 1}',
                    "--prompt", "hi"], capsys)
    assert "has no tokenizer" in line and cfg in line


def test_chat_without_a_chat_template_is_one_line(default_dir, tmp_path, capsys):
    d = _variant(default_dir, tmp_path, keep=("config.json", "tokenizer.json", "tokenizer_config.json"))
    tok_cfg = json.load(open(os.path.join(d, "tokenizer_config.json")))
    tok_cfg.pop("chat_template", None)
    json.dump(tok_cfg, open(os.path.join(d, "tokenizer_config.json"), "w"))
    line = run_cli(["generate", "--model", d, "--load-format", "dummy", "--hf-overrides", '{"num_hidden_layers": 1}',
                    "--prompt", "hi", "--chat"], capsys)
    assert "argument --chat: this model's tokenizer has no chat template" in line


def test_max_tokens_past_the_context_is_one_line(default_dir, capsys):
    line = run_cli(["generate", "--prompt", "hi", "--max-model-len", "32", "--max-tokens", "100"], capsys)
    assert "argument --max-tokens:" in line and "exceeds the context limit of 32 tokens" in line


@pytest.mark.parametrize("damage", ["invalid config.json", "num_experts_per_tok past the experts",
                                    "truncated weights", "garbage weights", "empty weights"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(default_dir, tmp_path, capsys, damage):
    d = _variant(default_dir, tmp_path, keep=("config.json", "tokenizer.json", "tokenizer_config.json",
                                              "model.safetensors"))
    weights, config = os.path.join(d, "model.safetensors"), os.path.join(d, "config.json")
    if damage == "invalid config.json":
        open(config, "w").write('{"model_type": "qwen3_moe",')
        named = config
    elif damage == "num_experts_per_tok past the experts":
        cfg = json.load(open(config))
        json.dump({**cfg, "num_experts_per_tok": cfg["num_experts"] + 1}, open(config, "w"))
        named = config
    else:
        data = open(weights, "rb").read()
        open(weights, "wb").write({"truncated weights": data[: len(data) // 2], "garbage weights": os.urandom(4096),
                                   "empty weights": b""}[damage])
        named = weights
    line = run_cli(["generate", "--model", d, "--prompt", "hi"], capsys)
    assert named in line
