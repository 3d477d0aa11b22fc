"""llama.cpp on the gpt-oss-20b shape, the peer of bench_gpt_oss's mxfp4 section: a GGUF of
random weights in gpt-oss's layout (24 layers, 32 experts of 2880 rows with biases, top-4, 64
query heads of 64 over 8 KV heads with sinks, a 128-token window on every other layer), its
experts MXFP4 blocks written as they are (no bf16 copy, no quantize step), the rest bf16 as the
release keeps its attention; then llama-bench, decode (tg) and prefill (pp), with the experts of
`--n-cpu-moe` layers on the CPU.

    python -m benchmarks.llamacpp_gpt_oss --llama-cpp DIR [--n-cpu-moe 24 18 12 6 0]

DIR is a llama.cpp source tree with llama-bench built under DIR/build/bin (CUDA for sm_90 on
the GPU machine; its gguf-py writes the file). --n-cpu-moe 24 18 12 6 0 puts 0/25/50/75/100% of
the experts on the GPU. --tiny writes a 2-layer model of the same layout (a CPU build loads it:
tests of the writer). Prints one line per --n-cpu-moe with llama-bench's tokens/s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

GPT_OSS_20B = dict(layers=24, hidden=2880, inter=2880, experts=32, top_k=4, heads=64, kv_heads=8, head_dim=64,
                   vocab=201088, window=128, rope_theta=150000.0, eps=1e-5)
TINY = dict(GPT_OSS_20B, layers=2, hidden=128, inter=64, experts=8, heads=4, kv_heads=2, head_dim=32, vocab=1000,
            window=16)
MXFP4_BLOCK, MXFP4_BYTES = 32, 17  # values a block; bytes a block: an E8M0 scale, 16 bytes of E2M1 pairs


def mxfp4_blocks(rng: np.random.Generator, rows: tuple[int, ...], cols: int) -> np.ndarray:
    """Random MXFP4 blocks [*rows, cols / 32 * 17] uint8: each block's scale 2^-6..2^-4 (E8M0
    bytes 121..123: no NaN), its codes uniform."""
    blocks = rng.integers(0, 256, size=(*rows, cols // MXFP4_BLOCK, MXFP4_BYTES), dtype=np.uint8)
    blocks[..., 0] = rng.integers(121, 124, size=blocks.shape[:-1], dtype=np.uint8)
    return blocks.reshape(*rows, cols // MXFP4_BLOCK * MXFP4_BYTES)


def write_gguf(path: str, shape: dict, gguf) -> None:
    """The model of `shape` as a GGUF at `path` (gguf: llama.cpp's gguf-py)."""
    s, rng = shape, np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_block_count(s["layers"]); w.add_context_length(131072); w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["inter"]); w.add_expert_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"]); w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"]); w.add_value_length(s["head_dim"]); w.add_rope_dimension_count(s["head_dim"])
    w.add_rope_freq_base(s["rope_theta"]); w.add_layer_norm_rms_eps(s["eps"]); w.add_sliding_window(s["window"])
    w.add_expert_count(s["experts"]); w.add_expert_used_count(s["top_k"])
    w.add_vocab_size(s["vocab"]); w.add_tokenizer_model("no_vocab")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    bf16_type, mxfp4_type = gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.MXFP4

    def bf16(*dims):
        values = (rng.standard_normal(dims, dtype=np.float32) * 0.02).view(np.uint32)
        return (values >> 16).astype(np.uint16)  # truncated to bf16 bits

    def f32(*dims, scale=0.0):
        return (rng.standard_normal(dims, dtype=np.float32) * scale) if scale else np.ones(dims, dtype=np.float32)

    def add(name, array, dtype=None):
        if dtype is None:
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, array, raw_shape=array.shape, raw_dtype=dtype)

    h, i, e, q, kv = s["hidden"], s["inter"], s["experts"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    add("token_embd.weight", bf16(s["vocab"], h), bf16_type)
    add("output_norm.weight", f32(h))
    add("output.weight", bf16(s["vocab"], h), bf16_type)
    for layer in range(s["layers"]):
        p = f"blk.{layer}."
        add(p + "attn_norm.weight", f32(h)); add(p + "post_attention_norm.weight", f32(h))
        add(p + "attn_q.weight", bf16(q, h), bf16_type); add(p + "attn_q.bias", f32(q, scale=0.02))
        add(p + "attn_k.weight", bf16(kv, h), bf16_type); add(p + "attn_k.bias", f32(kv, scale=0.02))
        add(p + "attn_v.weight", bf16(kv, h), bf16_type); add(p + "attn_v.bias", f32(kv, scale=0.02))
        add(p + "attn_output.weight", bf16(h, q), bf16_type); add(p + "attn_output.bias", f32(h, scale=0.02))
        add(p + "attn_sinks.weight", f32(s["heads"], scale=1.0))
        add(p + "ffn_gate_inp.weight", f32(e, h, scale=0.02)); add(p + "ffn_gate_inp.bias", f32(e, scale=0.02))
        add(p + "ffn_gate_exps.weight", mxfp4_blocks(rng, (e, i), h), mxfp4_type)
        add(p + "ffn_up_exps.weight", mxfp4_blocks(rng, (e, i), h), mxfp4_type)
        add(p + "ffn_down_exps.weight", mxfp4_blocks(rng, (e, h), i), mxfp4_type)
        add(p + "ffn_gate_exps.bias", f32(e, i, scale=0.02)); add(p + "ffn_up_exps.bias", f32(e, i, scale=0.02))
        add(p + "ffn_down_exps.bias", f32(e, h, scale=0.02))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def llama_bench(binary: str, path: str, n_cpu_moe: int, threads: int, gpu: bool) -> str:
    """One llama-bench run (-p 512 -n 64 -r 2, the peer tables' settings): 'pp=... tg=...' tokens/s."""
    cmd = [binary, "-m", path, "-p", "512", "-n", "64", "-r", "2", "-t", str(threads), "-o", "json",
           "-ngl", "99" if gpu else "0", "-ncmoe", str(n_cpu_moe)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    try:
        rows = json.loads(run.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"llama-bench failed: {run.stdout[-300:]} {run.stderr[-800:]}") from None
    return " ".join(f"{'pp' if row['n_prompt'] else 'tg'}={row['avg_ts']:.1f}" for row in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", required=True, help="a llama.cpp source tree with llama-bench under build/bin")
    p.add_argument("--n-cpu-moe", type=int, nargs="+", default=[24, 18, 12, 6, 0])
    p.add_argument("--gguf", default="/tmp/gpt-oss-20b-shape-mxfp4.gguf", help="written once, then reused")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of the same layout")
    p.add_argument("--cpu", action="store_true", help="no layers offloaded to a GPU (-ngl 0)")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(args.llama_cpp, "gguf-py"))
    import gguf

    binary = os.path.join(args.llama_cpp, "build", "bin", "llama-bench")
    if not os.path.exists(binary):
        p.error(f"no llama-bench at {binary}: build llama.cpp first")
    if not os.path.exists(args.gguf):
        start = time.perf_counter()
        write_gguf(args.gguf, TINY if args.tiny else GPT_OSS_20B, gguf)
        print(f"gguf written in {time.perf_counter() - start:.0f} s, {os.path.getsize(args.gguf) / 1e9:.1f} GB",
              flush=True)
    for n in args.n_cpu_moe:
        print(f"MXFP4 --n-cpu-moe {n}:", llama_bench(binary, args.gguf, n, os.cpu_count(), not args.cpu), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
