"""The built-in model's recipe: the trainable model is transformers' Qwen3-MoE (same logits from
the exported checkpoint), the corpus split and chat samples keep their promises, and the
train stage runs end to end on a CPU."""

import json
import pathlib
import random

import pytest
import torch

from moeferry.training.corpus import paragraphs, split, word_list
from moeferry.training.export import write_checkpoint
from moeferry.training.model import TrainableQwen3Moe
from moeferry.training.train import Architecture, Recipe, chat_sample, lr_at, train

DATA = pathlib.Path(__file__).parent.parent / "data"
TINY = Architecture(vocab_size=300, hidden_size=64, num_hidden_layers=2, head_dim=16, num_experts=8,
                    moe_intermediate_size=16)


def test_the_exported_checkpoint_computes_the_trainable_models_logits_in_transformers(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = TrainableQwen3Moe(TINY).eval()
    model.reset_parameters(0.2)  # large weights: routing and attention far from uniform
    write_checkpoint(model.hf_state_dict(), TINY, str(tmp_path))
    hf = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():  # the checkpoint holds bfloat16: compare on the same weights
            p.copy_(p.bfloat16().float())
        ids = torch.randint(0, TINY.vocab_size, (2, 19))
        ours, _ = model(ids)
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_the_checkpoint_config_names_experts_and_rope_under_both_spellings(tmp_path):
    write_checkpoint(TrainableQwen3Moe(TINY).hf_state_dict(), TINY, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_experts"] == config["num_local_experts"] == TINY.num_experts
    assert config["rope_theta"] == TINY.rope_theta and config["tie_word_embeddings"] is True


def test_paragraphs_join_wrapped_lines_and_drop_italic_underscores():
    lines = ["CHAPTER I", "", "", "It is a _truth_ universally", "acknowledged.", "", "Next one."]
    assert paragraphs(lines) == ["CHAPTER I", "It is a truth universally acknowledged.", "Next one."]


def test_the_held_out_part_is_each_novels_end_and_never_trained_on():
    novels = {"a": [f"para a{i}" if i % 2 == 0 else "" for i in range(200)],
              "b": [f"para b{i}" if i % 2 == 0 else "" for i in range(100)]}
    train_part, held_out = split(novels)
    for t, h in zip(train_part, held_out):
        assert h and not set(t) & set(h)
        assert t + h == sorted(t + h, key=lambda p: int(p[6:]))  # the held-out paragraphs come last
    assert word_list(["It's Emma's. emma"]) == ["emma", "emma's", "it's"]


def test_a_chat_sample_splits_a_paragraph_between_user_and_assistant():
    paragraph = "Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty-one years. She was happy."
    for seed in range(20):
        sample = chat_sample(paragraph, random.Random(seed))
        user = sample.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        reply = sample.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
        assert f"{user} {reply}" == paragraph
        assert sample.endswith("<|im_end|>\n")
    assert chat_sample("Too short.", random.Random(0)) is None


def test_the_learning_rate_warms_up_then_decays_to_its_floor():
    r = Recipe(steps=100, warmup=10, lr=1.0, min_lr_fraction=0.1)
    assert lr_at(0, r) == pytest.approx(0.1) and lr_at(9, r) == pytest.approx(1.0)
    assert lr_at(99, r) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(s, r) >= lr_at(s + 1, r) for s in range(10, 99))


@pytest.mark.slow
def test_training_on_a_cpu_lowers_the_held_out_loss_and_writes_a_loadable_checkpoint(tmp_path):
    from moeferry.default_model import BUILTIN_MODEL_DIR
    from moeferry.llm import LLM
    from moeferry.sampling import SamplingParams
    from safetensors.torch import load_file

    text = (DATA / "austen_heldout.txt").read_text()
    novels = text.split("\n\n")
    (tmp_path / "train.txt").write_text("\n\n".join(novels[:-1]) + "\n")
    (tmp_path / "valid.txt").write_text(novels[-1] + "\n")
    arch = Architecture(hidden_size=64, num_hidden_layers=2, head_dim=16, num_experts=8, moe_intermediate_size=16)
    recipe = Recipe(steps=30, batch=4, seq_len=64, warmup=5, eval_every=10, lr=1e-2)
    summary = train(str(tmp_path), f"{BUILTIN_MODEL_DIR}/tokenizer.json", str(tmp_path / "out"), arch, recipe,
                    device="cpu", log=lambda *_: None)
    losses = [h["valid_loss"] for h in summary["history"]]
    assert losses[-1] < losses[0] < 8.4  # ln(4096) = 8.3: it learned something in 30 steps
    write_checkpoint(load_file(str(tmp_path / "out" / "weights.safetensors")), arch, str(tmp_path / "ckpt"),
                     BUILTIN_MODEL_DIR)
    out = LLM(str(tmp_path / "ckpt")).generate("It is", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
