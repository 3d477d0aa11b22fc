"""Each way a checkpoint can be wrong gives a message naming the file or tensor at fault."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError
from tests.support.fixtures import family_configs, make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    name, config = family_configs()[0]
    path = str(tmp_path_factory.mktemp("ckpt"))
    make_checkpoint(config, path, shards=True)
    return path


def _copy(ckpt, tmp_path):
    import shutil

    dst = str(tmp_path / "m")
    shutil.copytree(ckpt, dst)
    return dst


def test_sharded_checkpoint_loads(ckpt):
    assert len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")]) > 1
    out = LLM(ckpt, dtype="float32", device="cpu").generate([1, 2, 3], SamplingParams(ignore_eos=True))[0]
    assert len(out.token_ids) == 16


def test_missing_shard(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(d, shard))
    with pytest.raises(ConfigError, match=f"shard '{shard}'.*missing"):
        LLM(d, device="cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(str(tmp_path), device="cpu")


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_unknown_model_type(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["model_type"] = "llama4_text"
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match="model_type 'llama4_text' is not supported"):
        LLM(d, device="cpu")


def _edit_shard(d, name, edit):
    """Apply `edit` to the tensors dict of the shard that holds `name`; returns the shard's name."""
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    file = os.path.join(d, index["weight_map"][name])
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return os.path.basename(file)


def _edit_tensor(d, name, fn):
    return _edit_shard(d, name, lambda tensors: tensors.__setitem__(name, fn(tensors[name])))


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"])
def test_wrong_shape(ckpt, tmp_path, name):
    d = _copy(ckpt, tmp_path)
    shard = _edit_tensor(d, name, lambda t: t[:, :-1].contiguous())
    with pytest.raises(ConfigError, match=rf"{shard}: tensor '{name}' has shape"):
        LLM(d, device="cpu")


def test_wrong_dtype(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    name = "model.norm.weight"
    _edit_tensor(d, name, lambda t: t.to(torch.int32))
    with pytest.raises(ConfigError, match=f"tensor '{name}' has dtype torch.int32"):
        LLM(d, device="cpu")


def test_missing_tensor(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    name = "model.layers.2.post_attention_layernorm.weight"
    _edit_shard(d, name, lambda tensors: tensors.pop(name))
    with pytest.raises(ConfigError, match="lacks 1 tensor.*post_attention_layernorm"):
        LLM(d, device="cpu")


def test_dummy_load_needs_only_a_config(ckpt, tmp_path):
    d = str(tmp_path / "cfg")
    os.makedirs(d)
    import shutil

    shutil.copy(os.path.join(ckpt, "config.json"), d)
    llm = LLM(d, load_format="dummy", device="cpu", hf_overrides={"num_hidden_layers": 2})
    assert llm.engine.mc.num_layers == 2
    assert len(llm.generate([4, 5, 6], SamplingParams(ignore_eos=True))[0].token_ids) == 16


def test_unknown_engine_option():
    with pytest.raises(ConfigError, match="unknown engine option.*no_such_flag"):
        LLM(None, no_such_flag=1)


def test_hf_overrides_cut_a_real_checkpoint(ckpt):
    llm = LLM(ckpt, dtype="float32", device="cpu", hf_overrides={"num_hidden_layers": 2})
    assert len(llm.engine.runner.model.model.layers) == 2
    assert len(llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_a_broken_index_names_its_file(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    open(os.path.join(d, "model.safetensors.index.json"), "w").write('{"weight_map": ')
    with pytest.raises(ConfigError, match=r"model\.safetensors\.index\.json: not a safetensors index"):
        LLM(d, device="cpu")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_an_unreadable_shard_names_its_file(ckpt, tmp_path, damage):
    d = _copy(ckpt, tmp_path)
    shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
    path = os.path.join(d, shard)
    data = open(path, "rb").read()
    open(path, "wb").write({"truncated": data[: len(data) - 100], "garbage": os.urandom(2048), "empty": b""}[damage])
    with pytest.raises(ConfigError, match=rf"{shard}: not a readable safetensors file \(.+\)$"):
        LLM(d, device="cpu")


def test_an_expert_past_the_configured_count_names_the_tensor(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    _edit_shard(d, name, lambda tensors: tensors.__setitem__("model.layers.0.mlp.experts.99.down_proj.weight",
                                                             tensors[name].clone()))
    with pytest.raises(ConfigError, match=r"tensor 'model.layers.0.mlp.experts.99.down_proj.weight' is expert 99, "
                                          r"but the model has 8 experts per layer"):
        LLM(d, device="cpu")


@pytest.mark.parametrize("field,value,says", [
    ("num_experts_per_tok", 9, r"num_experts_per_tok must be in \[1, 8\]"),
    ("num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("hidden_size", 0, "hidden_size must be a positive integer"),
])
def test_a_config_the_engine_cannot_run_is_refused_naming_the_field(ckpt, tmp_path, field, value, says):
    d = _copy(ckpt, tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump({**cfg, field: value}, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match=rf"config\.json: {says}"):
        LLM(d, device="cpu", load_format="dummy")


def test_invalid_config_json_names_the_file(tmp_path):
    open(tmp_path / "config.json", "w").write("{not json")
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON"):
        LLM(str(tmp_path), device="cpu")
