"""GPU benchmarks, one module per table of RESULTS.md, each run from the repository root as
``python -m benchmarks.NAME [--results benchmarks/RESULTS.md]`` (``--help`` lists a module's
flags; without a CUDA GPU it says so and exits 0). ``python -m benchmarks`` lists them. The
benchmarks live in a source checkout beside tests/, whose fixtures they import; the installed
package does not ship them."""

# What each benchmarks/bench_<name>.py measures (its docstring says how).
BENCHMARKS = {
    "admission": "the slot cache's admission kernel: microseconds per call at decode widths, all hits and about "
                 "10% misses, with and without the statistics counters",
    "copy": "miss copies: the gather kernel's bandwidth from pinned host memory to expert slots, against torch's "
            "pinned host-to-device copy_",
    "decode": "decode tokens/s of a dummy Qwen3-30B-A3B-shaped model under gpu, offload (several cache sizes) and "
              "uva, beside each step's bandwidth floor",
    "sampling": "sampled against greedy decode steps, and the sampler kernel alone: microseconds per call",
    "fused_moe": "one MoE layer's grouped GEMM at Qwen3-30B-A3B shapes: time per layer and achieved bandwidth",
    "attention": "paged decode attention, the Triton kernel against the torch reference: time per call and "
                 "bandwidth over batch sizes and contexts",
    "linear": "decode-sized linear layers, the skinny Triton kernel against cuBLAS: time per call beside the floor",
    "ttft": "time to first token against prompt length under offload, for each --moe-prefill-demand-tokens",
    "prefill": "prefill tokens/s of offload at 25-100% of the experts resident beside gpu and each row's floor, and "
               "multi-turn chat TTFT with and without prefix caching",
    "uva": "uva's naive and sorted expert reads: output tokens/s at 1 to 16 requests, beside offload's",
    "serve": "through the HTTP API: decode tokens/s at 1, 4 and 16 streaming clients and TTFT, with and without "
             "CUDA graphs",
    "parity": "bf16 on the GPU against transformers in float32: the largest logit error and greedy tokens agreeing",
    "deepseek": "DeepSeek-V3 shapes: decode tokens/s of a dummy model cut to a few layers under gpu and offload "
                "(25%, 100% resident), and the MLA decode attention kernel against its HBM floor",
    "gpt_oss": "gpt-oss-20b shapes: decode tokens/s of a dummy model cut to --layers under gpu, offload and hybrid "
               "at --cache-fracs resident, bf16 or MXFP4 experts (llama.cpp's side: benchmarks/llamacpp_gpt_oss.py)",
    "quant": "offload decode tokens/s per expert format (bf16, fp8, int4, mxfp4) at 25-100% of the experts resident",
    "quant_accuracy": "per expert format: perplexity of the built-in model on held-out text and the largest logit error",
    "structured": "decode tokens/s with a JSON-schema grammar constraining every request against without",
    "hybrid": "the host channel: the host expert kernel's GB/s against torch, and decode tokens/s of cpu, offload, "
              "hybrid and gpu at 0-100% of the experts on the GPU beside both channels' floors",
    "routing": "expert-cache policies on the built-in model's trained routing at 25/50/75% caches, each simulated "
               "from a recorded trace and measured on the offload engine: decode hit rates and tok/s",
    "host_kernel": "the host expert kernel alone on the CPU (no GPU needed): GB/s and experts a second per weight "
                   "format (bf16, fp8, int4, mxfp4), the exact path against the int8 path",
    "multi_gpu": "decode tokens/s on one GPU and on two (--tensor-parallel-size 2, the experts split) under offload "
                 "at 25% and 50% of the experts resident, uniform or qwen3 routing",
    "overlap": "a decode layer's GPU work alone and beside expert copies on another stream: the gather kernel at "
               "several grid sizes and the copy engine, each side's speed",
    "profile": "where a decode step's device time goes: kernels by name, copy and compute time and their overlap, "
               "per strategy, lookahead and statistics setting (torch.profiler)",
    "predictor": "next-layer expert prediction (layer l+1's router on an earlier hidden state): recall of the true "
                 "top-k and wasted prefetch on the built-in model and every family's tiny checkpoint (CPU)",
}


def listing(columns: int = 100) -> str:
    """The benchmarks and what each measures, one wrapped entry per module."""
    import textwrap

    width = max(map(len, BENCHMARKS)) + 4
    intro = textwrap.fill("python -m benchmarks.NAME [flags], from the repository root; each needs a GPU (without "
                          "one it says so and exits 0) and prints its table; --results benchmarks/RESULTS.md "
                          "replaces its section there.", columns)
    rows = [textwrap.fill(what, columns, initial_indent=f"  {name:<{width - 2}}", subsequent_indent=" " * width,
                          break_on_hyphens=False) for name, what in BENCHMARKS.items()]
    return intro + "\n\n" + "\n".join(rows)
