"""Probe: host expert GEMV throughput (GB/s of bf16 expert weights) for decode-sized batches.
Candidates: torch F.linear bf16; a C++ AVX512-BF16 (vdpbf16ps) + OpenMP kernel (load_inline)."""
import os, sys, time, torch
import torch.nn.functional as F

H, I, E_STEP = 2048, 768, 8  # Qwen3-30B-A3B expert, 8 routed experts
SRC = r'''
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
// y[T, N] (f32) = x[T, K] (bf16) . w[N, K]^T (bf16); K % 32 == 0, T <= 16
template <int T>
static void gemv_t(const uint16_t* w, const uint16_t* x, float* y, int64_t N, int64_t K) {
  #pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    const uint16_t* wr = w + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(wr + k));
      for (int t = 0; t < T; ++t) {
        __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(x + t * K + k));
        acc[t] = _mm512_dpbf16_ps(acc[t], wv, xv);
      }
    }
    for (int t = 0; t < T; ++t) y[t * N + n] = _mm512_reduce_add_ps(acc[t]);
  }
}
torch::Tensor gemv(torch::Tensor w, torch::Tensor x) {
  int64_t N = w.size(0), K = w.size(1), T = x.size(0);
  auto y = torch::empty({T, N}, torch::dtype(torch::kFloat32));
  auto wp = (const uint16_t*)w.data_ptr(); auto xp = (const uint16_t*)x.data_ptr(); auto yp = y.data_ptr<float>();
  switch (T) {
    case 1: gemv_t<1>(wp, xp, yp, N, K); break; case 2: gemv_t<2>(wp, xp, yp, N, K); break;
    case 4: gemv_t<4>(wp, xp, yp, N, K); break; case 8: gemv_t<8>(wp, xp, yp, N, K); break;
    case 16: gemv_t<16>(wp, xp, yp, N, K); break; default: TORCH_CHECK(false, "T");
  }
  return y;
}
'''

def main():
    print(torch.__version__, torch.backends.cpu.get_cpu_capability(), os.cpu_count(), flush=True)
    os.system("lscpu | grep -E 'Model name|L3|NUMA node0' ; grep -o -m1 'amx_bf16\\|avx512_bf16' /proc/cpuinfo | sort -u")
    ext = None
    try:
        from torch.utils.cpp_extension import load_inline
        t0 = time.time()
        ext = load_inline("hostgemv", cpp_sources=SRC, functions=["gemv"],
                          extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
        print(f"built in {time.time() - t0:.1f}s", flush=True)
    except Exception as exc:
        print("no extension:", repr(exc)[:300])
    g = torch.Generator().manual_seed(0)
    # a pool of experts larger than the L3 cache: each step reads fresh experts
    pool = 64
    w13 = (torch.randn(pool, 2 * I, H, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(pool, H, I, generator=g) * 0.02).bfloat16()
    ebytes = (w13[0].numel() + w2[0].numel()) * 2
    for threads in (4, 8, 16):
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        for T in (1, 4, 16):
            x = (torch.randn(T, H, generator=g)).bfloat16()
            def torch_step(step):
                out = 0
                for j in range(E_STEP):
                    e = (step * E_STEP + j) % pool
                    gu = F.linear(x, w13[e]); gate, up = gu.chunk(2, -1)
                    out = out + F.linear(F.silu(gate) * up, w2[e])
                return out
            def ext_step(step):
                out = 0
                for j in range(E_STEP):
                    e = (step * E_STEP + j) % pool
                    gu = ext.gemv(w13[e], x); gate, up = gu.chunk(2, -1)
                    out = out + ext.gemv(w2[e], (F.silu(gate) * up).bfloat16())
                return out
            for name, fn in (("torch", torch_step), ("avx512bf16", ext_step if ext else None)):
                if fn is None: continue
                for s in range(3): fn(s)
                steps = 40
                t0 = time.perf_counter()
                for s in range(steps): fn(s)
                dt = (time.perf_counter() - t0) / steps
                print(f"threads {threads:2d} T {T:2d} {name:11s} {E_STEP * ebytes / dt / 1e9:6.1f} GB/s  {dt * 1e3:6.2f} ms/layer", flush=True)
    if ext:
        torch.set_num_threads(16)
        x = torch.randn(4, H).bfloat16()
        ref = x.float() @ w13[0].float().T
        print("max err", (ext.gemv(w13[0], x) - ref).abs().max().item(), ref.abs().max().item())
    # memcpy bandwidth of the host for the floor
    a = torch.empty(1 << 30, dtype=torch.uint8); b = torch.empty_like(a); b.copy_(a)
    t0 = time.perf_counter(); [b.copy_(a) for _ in range(5)]; dt = (time.perf_counter() - t0) / 5
    print(f"host copy {2 * (1 << 30) / dt / 1e9:.1f} GB/s (read+write)")

main()
