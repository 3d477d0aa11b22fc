"""Train the built-in model: a small Qwen3-MoE on the Austen corpus (moeferry/training/corpus.py)
with the built-in tokenizer, seeded, on one GPU in minutes (on a CPU only as a smoke test).

The token stream is the training novels (paragraphs separated by a blank line, novels by
``<|endoftext|>``) followed by chat-formatted samples made from the same paragraphs (the user
gives a paragraph's opening, the assistant continues it), so the model also answers through
its chat template and ends its turn with ``<|im_end|>``. Batches are random windows of that
stream. The weights kept are those with the lowest held-out loss seen.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import time

import torch
import torch.nn.functional as F

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"  # the built-in tokenizer's (ChatML)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The model's shape, under Qwen3MoeConfig's attribute names."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_experts: int = 32
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Optimisation settings; ``steps`` of ``batch`` windows of ``seq_len`` tokens."""

    seed: int = 0
    steps: int = 600
    batch: int = 32
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_fraction: float = 0.1
    warmup: int = 60
    weight_decay: float = 0.1
    aux_loss_coef: float = 0.01
    chat_fraction: float = 0.25
    eval_every: int = 50
    max_seconds: float | None = None  # a guard for lent machines: stop early (logged) past this


def _sentences(paragraph: str) -> list[str]:
    return re.split(r'(?<=[.!?])\s+(?=["A-Z])', paragraph)


def chat_sample(paragraph: str, rng: random.Random) -> str | None:
    """A paragraph as one chat exchange: the user gives its first sentence (or first few
    words), the assistant the rest. None for paragraphs too short to split."""
    sentences = _sentences(paragraph)
    if len(sentences) >= 2 and rng.random() < 0.5:
        user, reply = sentences[0], " ".join(sentences[1:])
    else:
        words = paragraph.split()
        if len(words) < 12:
            return None
        cut = rng.randint(3, 10)
        user, reply = " ".join(words[:cut]), " ".join(words[cut:])
    return (f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{reply}{IM_END}\n")


def token_stream(text: str, tokenizer, recipe: Recipe | None, rng: random.Random | None) -> torch.Tensor:
    """The corpus file's novels as one int64 token stream; with a recipe, chat samples of
    ``recipe.chat_fraction`` of its paragraphs follow."""
    novels = [n.splitlines() for n in text.strip("\n").split("\n\n")]
    pieces = ["\n\n".join(paras) + ENDOFTEXT for paras in novels]
    if recipe is not None:
        for paras in novels:
            for p in paras:
                sample = chat_sample(p, rng) if rng.random() < recipe.chat_fraction else None
                if sample:
                    pieces.append(sample + ENDOFTEXT)
    ids = [i for enc in tokenizer.encode_batch(pieces) for i in enc.ids]
    return torch.tensor(ids, dtype=torch.int64)


def lr_at(step: int, r: Recipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    progress = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (r.min_lr_fraction + (1 - r.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, seq_len: int, device, batch: int = 16) -> float:
    """Mean next-token loss over non-overlapping windows of the held-out stream (each window
    starts without context, so this slightly overstates the loss of running text)."""
    n = (len(stream) - 1) // seq_len
    windows = stream[: n * seq_len + 1]
    total, count = 0.0, 0
    for start in range(0, n, batch):
        rows = range(start, min(n, start + batch))
        x = torch.stack([windows[r * seq_len:(r + 1) * seq_len] for r in rows]).to(device)
        y = torch.stack([windows[r * seq_len + 1:(r + 1) * seq_len + 1] for r in rows]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, _ = model(x)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total / count


def _optimizer(model, r: Recipe):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": r.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=r.lr, betas=(0.9, 0.95), fused=next(model.parameters()).is_cuda)


def train(corpus_dir: str, tokenizer_file: str, out_dir: str, arch: Architecture = Architecture(),
          recipe: Recipe = Recipe(), device: str = "cuda", log=print) -> dict:
    """Train, keep the weights of the lowest held-out loss, and write ``weights.safetensors``
    (transformers' names, bfloat16 as the checkpoint stores them) and ``train_log.json`` into ``out_dir``."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    from moeferry.training.model import TrainableQwen3Moe

    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    dev = torch.device(device)
    tokenizer = Tokenizer.from_file(tokenizer_file)
    with open(os.path.join(corpus_dir, "train.txt")) as f:
        train_ids = token_stream(f.read(), tokenizer, recipe, rng)
    with open(os.path.join(corpus_dir, "valid.txt")) as f:
        valid_ids = token_stream(f.read(), tokenizer, None, None)
    model = TrainableQwen3Moe(arch).to(dev)
    params = sum(p.numel() for p in model.parameters())
    log(f"{params / 1e6:.2f} M parameters; {len(train_ids) / 1e6:.2f} M training tokens, "
        f"{len(valid_ids) / 1e3:.1f} k held-out tokens")
    opt = _optimizer(model, recipe)
    gen = torch.Generator().manual_seed(recipe.seed)
    best, history, started = (float("inf"), None, -1), [], time.time()
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        starts = torch.randint(0, len(train_ids) - recipe.seq_len - 1, (recipe.batch,), generator=gen)
        window = torch.stack([train_ids[s:s + recipe.seq_len + 1] for s in starts.tolist()]).to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits, balance = model(window[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
        (loss + recipe.aux_loss_coef * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out_of_time = recipe.max_seconds is not None and time.time() - started > recipe.max_seconds
        if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps or out_of_time:
            model.eval()
            valid = held_out_loss(model, valid_ids, recipe.seq_len, dev)
            model.train()
            history.append({"step": step + 1, "train_loss": round(loss.item(), 4), "balance": round(balance.item(), 4),
                            "valid_loss": round(valid, 4), "seconds": round(time.time() - started, 1)})
            log(json.dumps(history[-1]))
            if valid < best[0]:
                best = (valid, {k: v.to(torch.bfloat16).cpu().clone() for k, v in model.hf_state_dict().items()},
                        step + 1)
        if out_of_time:
            log(f"stopped at step {step + 1} of {recipe.steps}: past max_seconds={recipe.max_seconds}")
            break
    os.makedirs(out_dir, exist_ok=True)
    weights = {k: v.contiguous() for k, v in best[1].items() if k != "lm_head.weight"}  # tied: not stored
    save_file(weights, os.path.join(out_dir, "weights.safetensors"))
    summary = {"architecture": dataclasses.asdict(arch), "recipe": dataclasses.asdict(recipe), "parameters": params,
               "train_tokens": len(train_ids), "valid_tokens": len(valid_ids), "best_step": best[2],
               "valid_loss": round(best[0], 4), "valid_perplexity": round(math.exp(best[0]), 2),
               "steps_run": step + 1,
               "seconds": round(time.time() - started, 1), "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "torch": torch.__version__, "history": history}
    with open(os.path.join(out_dir, "train_log.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary
