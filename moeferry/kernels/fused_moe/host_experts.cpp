// Routed experts on the host CPU: the host kernel of kernels/fused_moe (host.py builds and
// loads it; reference.py is its oracle).
//
// One call computes, for every route r = t * K + k whose expert id ids[r] is in [0, E):
//     act[r]  = bf16( silu(x[t] . w13[e, i]) * (x[t] . w13[e, I + i]) )      i < I
//     out[r]  = bf16( weights[r] * (act[r] . w2[e, n]) )                      n < H
// and writes out[r] = 0 for every other route (ids[r] < 0: a route another channel computes).
// bf16 weights and activations, float32 accumulation: the arithmetic of the Triton kernel
// (kernels/fused_moe/triton.py), which also rounds act and the weighted route output to bf16.
//
// Work: routes are grouped by expert (counting sort); phase A splits (group, block of I rows)
// over the threads, so each gate/up row is read once per call and multiplied against all of
// the group's tokens; after a barrier, phase B splits the H output rows, each thread reading
// its rows of every group's w2. A route's output depends only on its token and its expert,
// never on which other routes share the call: any split of a step's routes between channels
// gives the same per-route bits.
//
// Dot products: AVX512-BF16 (vdpbf16ps, 4 weight rows x up to 4 tokens in registers) when the
// CPU has it, checked at run time; otherwise a portable float loop the compiler vectorises.
//
// `moe_host_run` is also a CUDA host function (CUhostFn: void(void*)): a stream (and a
// captured CUDA graph) runs it when the work before it is done; it touches no CUDA API.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <omp.h>
#include <immintrin.h>

extern "C" {

// One call's arguments; host.py builds it with ctypes (the field order is the contract).
struct MoEHostCall {
  const uint16_t* x;        // [T, H] bf16
  const int32_t* ids;       // [T, K] expert ids; < 0: not this call's route
  const float* weights;     // [T, K] route weights
  uint16_t* out;            // [T, K, H] bf16, written whole
  const uint16_t* w13;      // [E, 2I, H] bf16, gate rows then up rows
  const uint16_t* w2;       // [E, H, I] bf16
  uint16_t* act;            // scratch [T * K, I] bf16
  int64_t T, K, H, I, E;
  int32_t threads;
  int32_t use_avx512;       // 1: AVX512-BF16 dots (host.py sets it from moe_host_has_avx512_bf16)
};

}  // extern "C"

namespace {

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 cast (NaN kept a quiet NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// acc[r * NT + t] = w[r] . x[t] over L elements, portable float arithmetic.
void dots_portable(const uint16_t* const* w, int R, const uint16_t* const* x, int NT, int64_t L, float* acc) {
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < NT; ++t) {
      const uint16_t* wr = w[r];
      const uint16_t* xt = x[t];
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < L; ++k) s += bf16_to_f32(wr[k]) * bf16_to_f32(xt[k]);
      acc[r * NT + t] = s;
    }
  }
}

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// R weight rows against NT tokens, R * NT accumulators in registers; L % 32 tail masked.
template <int R, int NT>
AVX512_BF16 void dots_avx512_tile(const uint16_t* const* w, const uint16_t* const* x, int64_t L, float* acc) {
  __m512 a[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) a[r][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= L; k += 32) {
    __m512bh xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = (__m512bh)_mm512_loadu_si512((const void*)(x[t] + k));
    for (int r = 0; r < R; ++r) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(w[r] + k));
      for (int t = 0; t < NT; ++t) a[r][t] = _mm512_dpbf16_ps(a[r][t], wv, xv[t]);
    }
  }
  if (k < L) {
    __mmask32 m = (__mmask32)((1ull << (L - k)) - 1);
    __m512bh xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(m, x[t] + k);
    for (int r = 0; r < R; ++r) {
      __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w[r] + k);
      for (int t = 0; t < NT; ++t) a[r][t] = _mm512_dpbf16_ps(a[r][t], wv, xv[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r * NT + t] = _mm512_reduce_add_ps(a[r][t]);
}

template <int R>
AVX512_BF16 void dots_avx512_rows(const uint16_t* const* w, const uint16_t* const* x, int NT, int64_t L, float* acc) {
  switch (NT) {
    case 1: dots_avx512_tile<R, 1>(w, x, L, acc); break;
    case 2: dots_avx512_tile<R, 2>(w, x, L, acc); break;
    case 3: dots_avx512_tile<R, 3>(w, x, L, acc); break;
    default: dots_avx512_tile<R, 4>(w, x, L, acc); break;
  }
}

AVX512_BF16 void dots_avx512(const uint16_t* const* w, int R, const uint16_t* const* x, int NT, int64_t L, float* acc) {
  switch (R) {
    case 1: dots_avx512_rows<1>(w, x, NT, L, acc); break;
    case 2: dots_avx512_rows<2>(w, x, NT, L, acc); break;
    case 3: dots_avx512_rows<3>(w, x, NT, L, acc); break;
    default: dots_avx512_rows<4>(w, x, NT, L, acc); break;
  }
}

// At most 4 rows x 4 tokens per call.
inline void dots(bool avx512, const uint16_t* const* w, int R, const uint16_t* const* x, int NT, int64_t L,
                 float* acc) {
  if (avx512)
    dots_avx512(w, R, x, NT, L, acc);
  else
    dots_portable(w, R, x, NT, L, acc);
}

struct Group {
  int64_t expert, start, count;  // routes order[start .. start + count) go to `expert`
};

constexpr int64_t kRowsA = 8;   // phase A work unit: this many gate rows (and their up rows)
constexpr int64_t kRowsB = 16;  // phase B work unit: this many output rows

// Phase A, one unit: act rows [i0, i1) of every route of group g.
void gate_up_unit(const MoEHostCall& c, const Group& g, const int32_t* order, int64_t i0, int64_t i1, bool avx512) {
  const int64_t H = c.H, I = c.I;
  const uint16_t* bank = c.w13 + g.expert * 2 * I * H;
  for (int64_t t0 = 0; t0 < g.count; t0 += 4) {
    int nt = static_cast<int>(std::min<int64_t>(4, g.count - t0));
    const uint16_t* xs[4];
    for (int t = 0; t < nt; ++t) xs[t] = c.x + (order[g.start + t0 + t] / c.K) * H;
    for (int64_t i = i0; i < i1; i += 2) {
      int pair = static_cast<int>(std::min<int64_t>(2, i1 - i));
      const uint16_t* rows[4];
      for (int p = 0; p < pair; ++p) {
        rows[p] = bank + (i + p) * H;             // gate row
        rows[pair + p] = bank + (I + i + p) * H;  // up row
      }
      float acc[16];
      dots(avx512, rows, 2 * pair, xs, nt, H, acc);
      for (int p = 0; p < pair; ++p)
        for (int t = 0; t < nt; ++t) {
          float gate = acc[p * nt + t], up = acc[(pair + p) * nt + t];
          c.act[order[g.start + t0 + t] * I + i + p] = f32_to_bf16(silu(gate) * up);
        }
    }
  }
}

// Phase B, one unit: output rows [n0, n1) of every route of every group.
void down_unit(const MoEHostCall& c, const std::vector<Group>& groups, const int32_t* order, int64_t n0, int64_t n1,
               bool avx512) {
  const int64_t H = c.H, I = c.I;
  for (const Group& g : groups) {
    const uint16_t* bank = c.w2 + g.expert * H * I;
    for (int64_t t0 = 0; t0 < g.count; t0 += 4) {
      int nt = static_cast<int>(std::min<int64_t>(4, g.count - t0));
      const uint16_t* acts[4];
      for (int t = 0; t < nt; ++t) acts[t] = c.act + order[g.start + t0 + t] * I;
      for (int64_t n = n0; n < n1; n += 4) {
        int nr = static_cast<int>(std::min<int64_t>(4, n1 - n));
        const uint16_t* rows[4];
        for (int r = 0; r < nr; ++r) rows[r] = bank + (n + r) * I;
        float acc[16];
        dots(avx512, rows, nr, acts, nt, I, acc);
        for (int t = 0; t < nt; ++t) {
          int64_t route = order[g.start + t0 + t];
          for (int r = 0; r < nr; ++r) c.out[route * H + n + r] = f32_to_bf16(c.weights[route] * acc[r * nt + t]);
        }
      }
    }
  }
}

// Counting sort of the valid routes by expert: `order` lists them, `groups` the runs.
std::vector<Group> group_routes(const MoEHostCall& c, std::vector<int32_t>& order) {
  const int64_t routes = c.T * c.K;
  std::vector<int64_t> count(c.E + 1, 0);
  for (int64_t r = 0; r < routes; ++r)
    if (c.ids[r] >= 0 && c.ids[r] < c.E) ++count[c.ids[r] + 1];
  for (int64_t e = 0; e < c.E; ++e) count[e + 1] += count[e];
  std::vector<Group> groups;
  for (int64_t e = 0; e < c.E; ++e)
    if (count[e + 1] > count[e]) groups.push_back({e, count[e], count[e + 1] - count[e]});
  order.assign(count[c.E], 0);
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t r = 0; r < routes; ++r)
    if (c.ids[r] >= 0 && c.ids[r] < c.E) order[next[c.ids[r]]++] = static_cast<int32_t>(r);
  return groups;
}

std::atomic<int64_t> g_calls{0}, g_total_ns{0}, g_max_ns{0};

void record_time(int64_t ns) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  g_total_ns.fetch_add(ns, std::memory_order_relaxed);
  int64_t seen = g_max_ns.load(std::memory_order_relaxed);
  while (ns > seen && !g_max_ns.compare_exchange_weak(seen, ns, std::memory_order_relaxed)) {
  }
}

}  // namespace

extern "C" {

// Calls run so far, their total and longest wall time in ns (every call, from any thread):
// the host channel's share of a step, read by its statistics and profile.
void moe_host_timing(int64_t* out) {
  out[0] = g_calls.load();
  out[1] = g_total_ns.load();
  out[2] = g_max_ns.load();
}

int moe_host_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") ? 1 : 0;
}

void moe_host_run(void* arg) {
  const auto start = std::chrono::steady_clock::now();
  const MoEHostCall& c = *static_cast<const MoEHostCall*>(arg);
  std::vector<int32_t> order;
  std::vector<Group> groups = group_routes(c, order);
  const bool avx512 = c.use_avx512 != 0;
  const int64_t units_per_group = (c.I + kRowsA - 1) / kRowsA;
  const int64_t units_a = static_cast<int64_t>(groups.size()) * units_per_group;
  const int64_t units_b = (c.H + kRowsB - 1) / kRowsB;
  const int64_t routes = c.T * c.K;
  if (groups.empty()) {  // no route is the host's: zeros, without waking the threads
    std::memset(c.out, 0, routes * c.H * sizeof(uint16_t));
    record_time(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
    return;
  }
#pragma omp parallel num_threads(c.threads)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < routes; ++r)
      if (c.ids[r] < 0 || c.ids[r] >= c.E) std::memset(c.out + r * c.H, 0, c.H * sizeof(uint16_t));
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units_a; ++u) {
      const Group& g = groups[u / units_per_group];
      int64_t i0 = (u % units_per_group) * kRowsA;
      gate_up_unit(c, g, order.data(), i0, std::min(c.I, i0 + kRowsA), avx512);
    }
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units_b; ++u) {
      int64_t n0 = u * kRowsB;
      down_unit(c, groups, order.data(), n0, std::min(c.H, n0 + kRowsB), avx512);
    }
  }
  record_time(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
}

}  // extern "C"
