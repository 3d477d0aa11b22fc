"""vLLM's command line serves unchanged: the model is positional, vLLM's flag names are aliases
with vLLM's meaning (converted where moeferry's own flag means something else), --help lists
each alias beside its own name, and an unknown flag names the closest known one."""

import json
import re

import pytest
import torch

from moeferry.cli import build_parser, engine_config_from_args, main
from moeferry.config import ConfigError, EngineConfig

VLLM_LINE = ["serve", "Qwen/Qwen3-30B-A3B", "--gpu-memory-utilization", "0.8", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "512", "--enforce-eager", "--num-gpu-blocks-override", "100",
             "--cpu-offload-gb", "10", "--generation-config", "vllm", "--override-generation-config",
             '{"temperature": 0.5}', "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--tokenizer", "Qwen/Qwen3-30B-A3B", "--revision", "abc123", "--reasoning-parser", "qwen3",
             "--trust-remote-code", "--kv-cache-dtype", "auto", "--max-model-len", "8192", "--dtype", "bfloat16",
             "--served-model-name", "qwen", "--api-key", "k", "--port", "8001", "--seed", "3"]


def test_a_vllm_serve_line_parses_to_the_options_it_means():
    args = build_parser().parse_args(VLLM_LINE)
    ec = engine_config_from_args(args)
    assert ec.model == "Qwen/Qwen3-30B-A3B" and ec.revision == "abc123" and ec.tokenizer == "Qwen/Qwen3-30B-A3B"
    assert ec.gpu_memory_utilization == 0.8 and ec.max_running_requests == 4 and ec.max_prefill_tokens == 512
    assert ec.disable_cuda_graph is True and ec.num_tokens == 100 * ec.page_size
    assert ec.cpu_offload_gb == 10 and ec.generation_config == "vllm"
    assert ec.override_generation_config == {"temperature": 0.5}
    assert ec.trust_remote_code is True and ec.kv_cache_dtype == "auto" and ec.max_model_len == 8192
    assert args.reasoning_parser == "qwen3" and args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    checked = ec.replace(device="cpu").check()
    assert checked.moe_strategy == "offload", "--cpu-offload-gb moves experts to the host: offload"


def test_help_lists_each_vllm_alias_beside_its_own_flag():
    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    text = " ".join(serve.format_help().split())
    for own, alias in [("--max-running-requests", "--max-num-seqs"), ("--max-prefill-tokens", "--max-num-batched-tokens"),
                       ("--disable-cuda-graph", "--enforce-eager")]:
        assert re.search(re.escape(own) + r"( [A-Z_]+)?, " + re.escape(alias), text), (own, alias)
    # a converted alias follows its option, saying what it converts to
    at = text.index("--num-tokens NUM_TOKENS")
    assert text.index("--num-gpu-blocks-override") > at and "pages of --page-size tokens" in text
    for flag in ("--gpu-memory-utilization", "--cpu-offload-gb", "--generation-config", "--override-generation-config",
                 "--tokenizer", "--revision", "--reasoning-parser", "--trust-remote-code", "--kv-cache-dtype",
                 "--enable-auto-tool-choice"):
        assert flag in text


def test_an_unknown_flag_names_the_closest_one_and_prints_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--gpu-memory-utilisation", "0.5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: moeferry serve")
    assert "unrecognized arguments: --gpu-memory-utilisation; did you mean --gpu-memory-utilization?" in err


def test_the_model_given_twice_differently_is_refused(capsys):
    assert main(["serve", "a-model", "--model", "another-model"]) == 2
    assert "the model is given twice" in capsys.readouterr().err


def test_a_converted_alias_and_its_own_flag_together_are_refused(capsys):
    assert main(["serve", "--num-gpu-blocks-override", "4", "--num-tokens", "64"]) == 2
    assert "--num-gpu-blocks-override and --num-tokens both set num_tokens" in capsys.readouterr().err


@pytest.mark.parametrize("options,message", [
    ({"cpu_offload_gb": 4.0, "moe_cache_gb": 2.0}, "each size the expert cache"),
    ({"gpu_memory_utilization": 0.5, "memory_ratio": 0.5}, "--gpu-memory-utilization and --memory-ratio"),
    ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization must be in (0, 1]"),
    ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype 'fp8' is unknown"),
    ({"generation_config": "/no/such/dir"}, "give auto, vllm or a directory"),
    ({"cpu_offload_gb": 4.0, "moe_strategy": "uva"}, "--cpu-offload-gb is read only by --moe-strategy offload"),
])
def test_vllm_options_in_conflict_or_out_of_range_are_one_line_errors(options, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        EngineConfig(device="cpu", **options).check()


def test_cpu_offload_gb_leaves_that_many_gib_of_experts_on_the_host():
    from moeferry.engine.planner import expert_slots
    from moeferry.moe.banks import ExpertNeeds

    needs = ExpertNeeds(expert_bytes=2**28, total_experts=100, layer_experts=10, wants_slots=True)  # 4 per GiB
    ec = EngineConfig(device="cpu", cpu_offload_gb=5.1).check()
    assert expert_slots(ec, needs, room_bytes=None) == 100 - 21  # 5.1 GiB is 20.4 experts: 21 go to the host


def test_gpu_memory_utilization_is_a_share_of_the_whole_gpu(monkeypatch):
    from moeferry.engine import planner

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))  # 20 GiB of weights
    ec = EngineConfig(device="cpu", gpu_memory_utilization=0.5, vram_reserve_mb=0)
    free, budget = planner._device_budget(ec, torch.device("cuda"))
    assert free == 60 * gib and budget == 20 * gib  # half of 80 GiB, less the 20 already held


def test_generation_config_sources_and_overrides(tmp_path):
    from moeferry.sampling import GenerationDefaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8}))
    assert GenerationDefaults.load(str(tmp_path)).sampling == {"temperature": 0.7, "top_p": 0.8}
    assert GenerationDefaults.load(str(tmp_path), "vllm").sampling == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 20}))
    assert GenerationDefaults.load(str(tmp_path), str(other), {"temperature": 0.1}).sampling == \
        {"top_k": 20, "temperature": 0.1}
    with pytest.raises(ConfigError, match="max_new_tokens not among"):
        GenerationDefaults.load(str(tmp_path), "auto", {"max_new_tokens": 5})
    with pytest.raises(ConfigError, match="temperature"):
        GenerationDefaults.load(str(tmp_path), "auto", {"temperature": -1})


def test_the_api_key_comes_from_the_flag_else_moeferry_api_key_else_vllm_api_key():
    from moeferry.server.app import ServerConfig

    args = build_parser().parse_args(["serve"])
    assert ServerConfig.from_args(args, environ={}).api_key is None
    assert ServerConfig.from_args(args, environ={"VLLM_API_KEY": "v"}).api_key == "v"
    assert ServerConfig.from_args(args, environ={"VLLM_API_KEY": "v", "MOEFERRY_API_KEY": "m"}).api_key == "m"
    args = build_parser().parse_args(["serve", "--api-key", "f"])
    assert ServerConfig.from_args(args, environ={"MOEFERRY_API_KEY": "m"}).api_key == "f"


def test_a_revision_is_refused_for_anything_but_a_model_id(tmp_path):
    from moeferry.model_source import resolve_model

    with pytest.raises(ConfigError, match="only a Hugging Face model id has revisions"):
        resolve_model(str(tmp_path), "abc")
    with pytest.raises(ConfigError, match="at revision v2"):
        resolve_model("nobody/no-such-model", "v2")
