// Routed experts on the host CPU: the host kernel of kernels/fused_moe (host.py builds and
// loads it; reference.py is its oracle).
//
// One call computes, for every route r = t * K + k whose expert id ids[r] is in [0, E):
//     gate    = x[t] . w13[e, i] + b13[e, i],  up = x[t] . w13[e, I + i] + b13[e, I + i]
//     act[r]  = bf16( activation(gate, up) )                                   i < I
//     out[r]  = bf16( weights[r] * (act[r] . w2[e, n] + b2[e, n]) )           n < H
// and writes out[r] = 0 for every other route (ids[r] < 0: a route another channel computes).
// activation: silu(gate) * up, or gpt-oss's clamped SwiGLU: g = min(gate, limit), u =
// clamp(up, -limit, limit), (u + 1) * (g / (1 + exp(-g * alpha))). The biases (b13 [E, 2I],
// gate's then up's, and b2 [E, H], bf16 or float32) are optional: without them nothing is added.
// bf16 activations, float32 accumulation: the arithmetic of the Triton kernel
// (kernels/fused_moe/triton.py), which also adds each bias to the float32 accumulator, then
// activates (or weights) and rounds act and the weighted route output to bf16. One epilogue
// (`activate_into`, `weighted_out`) takes the accumulators of every dot path, so the biases and
// the activation round the same way whichever vector path computed the dots.
//
// Weights: bf16, or a quantized format (kernels/fused_moe/__init__.py has the layouts): block
// FP8 (e4m3 bytes, a float32 scale per (bn, bk) block, the gate and up halves of w13 blocked
// each on its own), int4 (int32 words of eight values stored + 8, value i at bits 4i, a float32
// scale per row and bk values) or MXFP4 (E2M1 codes two a byte, low nibble first, an E8M0 byte
// per row and bk = 32 values). A work unit first dequantizes its rows into a thread-local float32
// tile, weight = float(value) * scale: one float32 multiply of the exact value of the code, the
// bits of the reference's dequantize_blocks (reference.py). Then the same dots run with float32
// weight rows. fp8 rows are decoded in registers instead, the same float32 weights fused into the
// dots, no tile (writing and rereading the tile made the fp8 path compute-bound at a third of
// bf16's experts a second): Fp8Avx512Dots on the AVX-512 path, the tile's dots lane for lane
// (the same bits), and Fp8Avx2Dots on a CPU with AVX2 and no AVX-512 path. No quantized weight
// is rounded to bf16: an e4m3 or int4 value times a float32 scale generally has more
// significant bits than bf16 holds.
//
// The int8 path (activations = kActInt8, int4 and MXFP4 banks; reference.py int8_expert_routes is
// its oracle): the weights are read as integers, never dequantized. A row of activations (a
// token's bf16 row for gate and up; a route's bf16 act row for the down projection, quantized
// after all of phase A) is cut into groups of G = block_k values along K, the weights' scale
// groups, each quantized symmetrically: d = max |x| / 127 (float32), q = x / d rounded half to
// even (q = 0 where d = 0), |q| <= 127. A weight is an integer v times its group's float32 scale
// s: int4 v = nibble - 8 and its stored scale; MXFP4 v = 2 * E2M1 value (an integer in [-12, 12])
// and s = 2^(e - 128), half the E8M0 scale. Each group's sum of v q is exact in int32, and a dot
// is, over the groups in order, in float32 with each step rounded (no fused multiply-add):
//     acc = 0;  acc = acc + float(sum_g v q) * (s_g * d_g)
// then the epilogue above (biases, activation, bf16 roundings). The integer sums are the same on
// every vector path, so every path gives the same bits. Against the exact path the outputs move
// by the activations' rounding to 8 bits, at most d / 2 per element: about 1% of an output's
// norm for Gaussian tokens (tests/kernels/test_fused_moe_host.py: INT8_TOLERANCE).
//
// Work: routes are grouped by expert (counting sort); phase A splits (group, block of I rows)
// over the threads, so each gate/up row is read once per call and multiplied against all of
// the group's tokens; after a barrier, phase B splits the H output rows, each thread reading
// its rows of every group's w2. A route's output depends only on its token and its expert,
// never on which other routes share the call: any split of a step's routes between channels
// gives the same per-route bits.
//
// Dot products: AVX512-BF16 (vdpbf16ps, 4 weight rows x up to 4 tokens in registers; float32
// weight tiles: AVX-512 fused multiply-adds) when the CPU has it, checked at run time; otherwise
// a portable float loop the compiler vectorises. The int8 path's integer sums: AVX512-VNNI
// (vpdpbusd) or AVX2 (vpmaddubsw, vpmaddwd), whichever the CPU has (host.py asks
// moe_host_int8_isa), else a portable loop; each up to 4 weight rows in lockstep over up to 2
// tokens, the nibbles as unsigned bytes (v plus an offset, whose sum with q is taken off after).
//
// `moe_host_run` is also a CUDA host function (CUhostFn: void(void*)): a stream (and a
// captured CUDA graph) runs it when the work before it is done; it touches no CUDA API.
//
// The mailbox worker (`moe_host_worker_start`) is the other way to run calls beside a GPU: a
// thread of its own polls a mailbox in pinned memory that GPU kernels write (the sequence
// number of a request and the index of the call to run, kernels/host_mailbox), runs the call,
// then publishes the request's number as done, which a GPU kernel waits for. A captured graph
// then holds kernels only. Mailbox words (int64): [0] the last request posted, [1] its call's
// index into the worker's table, [8] the last request done (its own cache line), [16] set to 1
// when a request names no call. Requests come one at a time: the GPU posts the next only after
// it has seen the last one done.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <thread>
#include <omp.h>
// GCC 12's AVX-512 headers seed some vectors with a self-initialised `__Y = __Y`, which -Wall
// reports as uninitialised wherever the intrinsics are inlined: not a fault of this file.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include "../host_mailbox/poll.h"

extern "C" {

// One call's arguments; host.py builds it with ctypes (the field order is the contract).
struct MoEHostCall {
  const uint16_t* x;        // [T, H] bf16
  const int32_t* ids;       // [T, K] expert ids; < 0: not this call's route
  const float* weights;     // [T, K] route weights
  uint16_t* out;            // [T, K, H] bf16, written whole
  const void* w13;          // [E, 2I, H] bf16, gate rows then up rows (quantized: see format)
  const void* w2;           // [E, H, I] bf16 (quantized: see format)
  uint16_t* act;            // scratch [T * K, I] bf16
  int64_t T, K, H, I, E;
  int32_t threads;
  int32_t use_avx512;       // 1: AVX512-BF16 dots (host.py sets it from moe_host_has_avx512_bf16)
  int32_t format;           // MoEHostFormat
  int32_t block_n, block_k; // quantized: a scale per (block_n rows, block_k columns) block
  const void* w13_scale;    // [E, 2 ceil(I / bn), ceil(H / bk)] float32 (mxfp4: uint8 E8M0)
  const void* w2_scale;     // [E, ceil(H / bn), ceil(I / bk)]
  const void* w13_bias;     // [E, 2I] the gate rows' biases, then the up rows'; null: no biases
  const void* w2_bias;      // [E, H]; null exactly when w13_bias is
  int32_t bias_format;      // MoEHostBiasFormat of both bias banks
  int32_t activation;       // MoEHostActivation
  float alpha, limit;       // kClampedSwiglu's constants
  int32_t schedule;         // MoEHostSchedule: how the work units are dealt to the threads
  int32_t activations;      // MoEHostActivations: the tokens' precision in the dots of int4 and mxfp4 banks
  int32_t int8_isa;         // MoEHostInt8Isa: the integer dots' vector path (host.py sets it from moe_host_int8_isa)
};

// How the weight banks are stored (host.py: FORMATS).
enum MoEHostFormat { kBf16 = 0, kFp8 = 1, kInt4 = 2, kMxfp4 = 3 };

// How the bias banks are stored (host.py: BIAS_FORMATS).
enum MoEHostBiasFormat { kBiasBf16 = 0, kBiasF32 = 1 };

// How a route's gate and up rows combine (kernels/fused_moe: Activation).
enum MoEHostActivation { kSilu = 0, kClampedSwiglu = 1 };

// How a phase's work units are dealt to the threads (host.py: SCHEDULES): in equal blocks
// fixed in advance, or one at a time to whichever thread is free, so that a thread the OS
// preempts holds up only the unit it is on instead of its whole block.
enum MoEHostSchedule { kStatic = 0, kDynamic = 1 };

// The tokens' (and the activated intermediate's) precision in the dots of int4 and MXFP4 banks
// (host.py: ACTIVATIONS): bf16 against float32 weights (the exact path), or int8 per group
// against the weights' integer values (the int8 path; bf16 and fp8 banks have no integer
// weights and take the exact path whatever it says).
enum MoEHostActivations { kActBf16 = 0, kActInt8 = 1 };

// The int8 path's integer dots: portable, AVX2 (vpmaddubsw) or AVX512-VNNI (vpdpbusd).
enum MoEHostInt8Isa { kInt8Portable = 0, kInt8Avx2 = 1, kInt8Vnni = 2 };

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

// Bias j of expert e from a bias bank [E, width], stored in the call's bias_format.
inline float bias_value(const MoEHostCall& c, const void* bank, int64_t width, int64_t e, int64_t j) {
  const int64_t at = e * width + j;
  return c.bias_format == kBiasF32 ? static_cast<const float*>(bank)[at]
                                   : bf16_to_f32(static_cast<const uint16_t*>(bank)[at]);
}

// act element i of a route of expert e from its gate and up dots: the biases join the float32
// accumulators (only where there are some: adding 0 would turn a -0 dot into +0), then the
// activation in the Triton kernel's operation order (triton.py: _activate), rounded once.
inline uint16_t activate_into(const MoEHostCall& c, int64_t e, int64_t i, float gate, float up) {
  if (c.w13_bias != nullptr) {
    gate += bias_value(c, c.w13_bias, 2 * c.I, e, i);
    up += bias_value(c, c.w13_bias, 2 * c.I, e, c.I + i);
  }
  if (c.activation == kClampedSwiglu) {
    gate = std::min(gate, c.limit);
    up = std::min(std::max(up, -c.limit), c.limit);
    return f32_to_bf16((up + 1.0f) * (gate / (1.0f + std::exp(-gate * c.alpha))));
  }
  return f32_to_bf16(gate / (1.0f + std::exp(-gate)) * up);
}

// Output element n of a route of expert e from its down dot: bias, then the route weight, rounded once.
inline uint16_t weighted_out(const MoEHostCall& c, int64_t e, int64_t n, float weight, float down) {
  if (c.w2_bias != nullptr) down += bias_value(c, c.w2_bias, c.H, e, n);
  return f32_to_bf16(weight * down);
}

// A weight as float: bf16 rows (the banks) or float32 rows (a dequantized tile).
inline float weight_f32(uint16_t w) { return bf16_to_f32(w); }
inline float weight_f32(float w) { return w; }

// acc[r * NT + t] = w[r] . x[t] over L elements, portable float arithmetic.
template <typename W>
void dots_portable(const W* const* w, int R, const uint16_t* const* x, int NT, int64_t L, float* acc) {
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < NT; ++t) {
      const W* wr = w[r];
      const uint16_t* xt = x[t];
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < L; ++k) s += weight_f32(wr[k]) * bf16_to_f32(xt[k]);
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

#define AVX512_F32 __attribute__((target("avx512f,avx512bw,avx512vl")))

AVX512_F32 inline __m512 bf16x16_to_f32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Float32 weight rows against bf16 tokens: 16 lanes of fused multiply-adds; L % 16 tail masked.
template <int R, int NT>
AVX512_F32 void dots_avx512_f32_tile(const float* const* w, const uint16_t* const* x, int64_t L, float* acc) {
  __m512 a[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) a[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < L; k += 16) {
    __mmask16 m = L - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (L - k)) - 1);
    __m512 xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, x[t] + k));
    for (int r = 0; r < R; ++r) {
      __m512 wv = _mm512_maskz_loadu_ps(m, w[r] + k);
      for (int t = 0; t < NT; ++t) a[r][t] = _mm512_fmadd_ps(wv, xv[t], a[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r * NT + t] = _mm512_reduce_add_ps(a[r][t]);
}

template <int R>
AVX512_F32 void dots_avx512_f32_rows(const float* const* w, const uint16_t* const* x, int NT, int64_t L, float* acc) {
  switch (NT) {
    case 1: dots_avx512_f32_tile<R, 1>(w, x, L, acc); break;
    case 2: dots_avx512_f32_tile<R, 2>(w, x, L, acc); break;
    case 3: dots_avx512_f32_tile<R, 3>(w, x, L, acc); break;
    default: dots_avx512_f32_tile<R, 4>(w, x, L, acc); break;
  }
}

AVX512_F32 void dots_avx512_f32(const float* const* w, int R, const uint16_t* const* x, int NT, int64_t L,
                                float* acc) {
  switch (R) {
    case 1: dots_avx512_f32_rows<1>(w, x, NT, L, acc); break;
    case 2: dots_avx512_f32_rows<2>(w, x, NT, L, acc); break;
    case 3: dots_avx512_f32_rows<3>(w, x, NT, L, acc); break;
    default: dots_avx512_f32_rows<4>(w, x, NT, L, acc); break;
  }
}

inline void dots(bool avx512, const float* const* w, int R, const uint16_t* const* x, int NT, int64_t L,
                 float* acc) {
  if (avx512)
    dots_avx512_f32(w, R, x, NT, L, acc);
  else
    dots_portable(w, R, x, NT, L, acc);
}

inline float bits_to_f32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Exact float values of the stored codes, built from their bits without branches or tables (the
// loops below vectorise); tests compare every code with the reference's conversion.
// float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7f a NaN.
inline float fp8_value(uint8_t b) {
  const uint32_t em = b & 0x7fu;
  uint32_t bits = (em << 20) + (120u << 23);  // 2^(e - 7) (1 + m / 8)
  const float subnormal = static_cast<float>(b & 7u) * 0.001953125f;  // m / 8 * 2^-6 = m * 2^-9
  uint32_t subnormal_bits;
  std::memcpy(&subnormal_bits, &subnormal, 4);
  bits = (em >> 3) == 0 ? subnormal_bits : bits;
  bits = em == 0x7fu ? 0x7fc00000u : bits;
  return bits_to_f32(bits | (static_cast<uint32_t>(b & 0x80u) << 24));
}

// fp8_value of every byte: a table lookup per weight is cheaper than the bit arithmetic, which
// the compiler does not vectorise well from bytes.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = fp8_value(static_cast<uint8_t>(b));
  }
};
const Fp8Table kFp8Values;

// int4: the nibble n stores n - 8.
inline float int4_value(uint32_t n) { return static_cast<float>(static_cast<int32_t>(n) - 8); }

// FP4 E2M1 (kernels/fused_moe/__init__.py: E2M1_VALUES): sign, 2 exponent bits, 1 mantissa bit.
inline float e2m1_value(uint32_t c) {
  const uint32_t e = (c >> 1) & 3u, m = c & 1u;
  const uint32_t magnitude = e ? ((e + 126u) << 23) | (m << 22) : (m ? 0x3f000000u : 0u);  // e = 0: 0, 0.5
  return bits_to_f32(magnitude | ((c & 8u) << 28));
}

// 2^(s - 127) of an E8M0 byte from the bits, as reference.py's e8m0_to_float (s = 0: 2^-127).
inline float e8m0_to_f32(uint8_t s) { return bits_to_f32(s == 0 ? (1u << 22) : static_cast<uint32_t>(s) << 23); }

// One stored weight matrix of one expert: `rows` x `cols` values, its scale rows and columns.
struct QuantMatrix {
  const uint8_t* weights;  // the expert's first row
  const uint8_t* scales;   // the expert's first scale row
  int64_t cols, row_bytes, scale_cols;
};

// The values of a row of nibbles (int4 words and MXFP4 bytes alike: value k in byte k / 2, the
// low nibble first), unscaled. Values first, then scales: each loop runs over whole rows.
template <float (*value)(uint32_t)>
void nibble_values(const uint8_t* w, int64_t cols, float* dst) {
  for (int64_t j = 0; j < cols / 2; ++j) {
    const uint32_t b = w[j];
    dst[2 * j] = value(b & 15u);
    dst[2 * j + 1] = value(b >> 4);
  }
  if (cols & 1) dst[cols - 1] = value(w[cols / 2] & 15u);
}

// dst[k] = value(row r, column k) * its scale for k < cols, with scale row `scale_row`: one
// float32 multiply of exact values, the reference's rounding.
void dequantize_row(const MoEHostCall& c, const QuantMatrix& m, int64_t r, int64_t scale_row, float* dst) {
  const uint8_t* w = m.weights + r * m.row_bytes;
  const int64_t bk = c.block_k, cols = m.cols;
  if (c.format == kFp8) {
    for (int64_t k = 0; k < cols; ++k) dst[k] = kFp8Values.value[w[k]];
  } else if (c.format == kInt4) {
    nibble_values<int4_value>(w, cols, dst);
  } else {
    nibble_values<e2m1_value>(w, cols, dst);
  }
  const int64_t first = scale_row * m.scale_cols;
  for (int64_t k0 = 0; k0 < cols; k0 += bk) {
    const float scale = c.format == kMxfp4 ? e8m0_to_f32(m.scales[first + k0 / bk])
                                           : reinterpret_cast<const float*>(m.scales)[first + k0 / bk];
    const int64_t k1 = std::min(cols, k0 + bk);
    for (int64_t k = k0; k < k1; ++k) dst[k] *= scale;
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes a stored row of `cols` values takes in this format.
inline int64_t row_bytes(const MoEHostCall& c, int64_t cols) {
  switch (c.format) {
    case kFp8: return cols;
    case kInt4: return 4 * ceil_div(cols, 8);
    default: return ceil_div(cols, 2);
  }
}

// w13 (bank 0) or w2 (bank 1) of expert e as a quantized matrix.
QuantMatrix quant_matrix(const MoEHostCall& c, int bank, int64_t e) {
  const int64_t rows = bank == 0 ? 2 * c.I : c.H, cols = bank == 0 ? c.H : c.I;
  const int64_t scale_rows = bank == 0 ? 2 * ceil_div(c.I, c.block_n) : ceil_div(c.H, c.block_n);
  const int64_t scale_cols = ceil_div(cols, c.block_k), scale_bytes = c.format == kMxfp4 ? 1 : 4;
  const uint8_t* weights = static_cast<const uint8_t*>(bank == 0 ? c.w13 : c.w2);
  const uint8_t* scales = static_cast<const uint8_t*>(bank == 0 ? c.w13_scale : c.w2_scale);
  return {weights + e * rows * row_bytes(c, cols), scales + e * scale_rows * scale_cols * scale_bytes, cols,
          row_bytes(c, cols), scale_cols};
}

// The scale row of matrix row r: w13's gate and up halves are blocked each on its own.
inline int64_t scale_row_of(const MoEHostCall& c, int bank, int64_t r) {
  if (bank == 1 || r < c.I) return r / c.block_n;
  return ceil_div(c.I, c.block_n) + (r - c.I) / c.block_n;
}

void dequantize_rows(const MoEHostCall& c, int bank, int64_t e, int64_t r0, int64_t r1, float* dst) {
  const QuantMatrix m = quant_matrix(c, bank, e);
  for (int64_t r = r0; r < r1; ++r) dequantize_row(c, m, r, scale_row_of(c, bank, r), dst + (r - r0) * m.cols);
}

// The thread's tile of dequantized rows, grown to `floats` and kept between calls.
float* thread_tile(int64_t floats) {
  thread_local std::vector<float> tile;
  if (static_cast<int64_t>(tile.size()) < floats) tile.resize(floats);
  return tile.data();
}

// ---- The int8 path: int4 and MXFP4 banks against int8 activations (see the header) ----

// A quantized row holds its values span by span (`span` values, 32 or 64, one vector step of
// the dots), each span's even-indexed values first, then its odd ones: the order in which the low
// and the high nibbles of the span's span / 2 weight bytes come out, so no shuffle joins them.
inline int64_t dot_position(int64_t k, int64_t span) {
  const int64_t j = k % span;
  return k - j + (j & 1) * (span / 2) + j / 2;
}

// The call's span: 64 where a vector path reads groups of 32 (a span holds two: MXFP4's) or of
// a multiple of 64 values, else 32.
inline int64_t dot_span(const MoEHostCall& c) {
  return c.int8_isa != kInt8Portable && (c.block_k % 64 == 0 || c.block_k == 32) ? 64 : 32;
}

// Rows quantized to int8 per group of `group` values, in the dot layout (zeros past `cols`),
// with each group's scale d and its sum of q times the weights' code offset (NibbleCodes).
struct Int8Rows {
  int64_t cols = 0, group = 1, groups = 0, span = 32, stride = 0;
  int32_t offset = 0;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> offset_sum;

  void reset(int64_t rows, int64_t cols_, int64_t group_, int64_t span_, int32_t offset_) {
    cols = cols_, group = group_, groups = ceil_div(cols, group), span = span_, offset = offset_;
    stride = ceil_div(cols, 64) * 64;
    q.assign(rows * stride, 0);
    scale.assign(rows * groups, 0.0f);
    offset_sum.assign(rows * groups, 0);
  }
  const int8_t* values(int64_t row) const { return q.data() + row * stride; }
  const float* scales(int64_t row) const { return scale.data() + row * groups; }
  const int32_t* offset_sums(int64_t row) const { return offset_sum.data() + row * groups; }
};

// Row `row` of `rows` from bf16 x: per group d = max |x| / 127, q = x / d rounded half to even.
void quantize_row(const uint16_t* x, Int8Rows& rows, int64_t row) {
  int8_t* q = rows.q.data() + row * rows.stride;
  for (int64_t g = 0; g < rows.groups; ++g) {
    const int64_t k0 = g * rows.group, k1 = std::min(rows.cols, k0 + rows.group);
    float amax = 0.0f;
    for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(bf16_to_f32(x[k])));
    const float d = amax / 127.0f;
    int32_t total = 0;
    for (int64_t k = k0; k < k1; ++k) {
      const float v = d > 0.0f ? std::nearbyint(bf16_to_f32(x[k]) / d) : 0.0f;
      const int32_t qk = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
      q[dot_position(k, rows.span)] = static_cast<int8_t>(qk);
      total += qk;
    }
    rows.scale[row * rows.groups + g] = d;
    rows.offset_sum[row * rows.groups + g] = rows.offset * total;
  }
}

// A nibble code as the unsigned byte the integer dots multiply, its value v + offset: int4 codes
// are v + 8 already; an MXFP4 code maps to 2 * E2M1 value + 12 (v = 2 * E2M1 in [-12, 12]).
struct NibbleCodes {
  uint8_t byte[16];
  int32_t offset;
  bool identity;  // byte[n] = n: the vector paths skip the table
};
constexpr NibbleCodes kInt4Codes = {{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, 8, true};
constexpr NibbleCodes kMxfp4Codes = {{12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0}, 12, false};

inline const NibbleCodes& nibble_codes(const MoEHostCall& c) { return c.format == kMxfp4 ? kMxfp4Codes : kInt4Codes; }

// The float32 group scales s of scale row `scale_row` of m in the int8 path into dst[g * stride]:
// int4's stored floats, MXFP4's half E8M0 scales (v being 2 * E2M1).
inline void int8_weight_scales(const MoEHostCall& c, const QuantMatrix& m, int64_t scale_row, float* dst,
                               int64_t stride) {
  const int64_t first = scale_row * m.scale_cols;
  if (c.format == kMxfp4) {
    for (int64_t g = 0; g < m.scale_cols; ++g) dst[g * stride] = e8m0_to_f32(m.scales[first + g]) * 0.5f;
  } else {
    const float* scales = reinterpret_cast<const float*>(m.scales) + first;
    for (int64_t g = 0; g < m.scale_cols; ++g) dst[g * stride] = scales[g];
  }
}

// One int8 dot call's integer part: R <= 4 rows of nibbles against NT <= 4 quantized rows q of
// `x`'s layout; sums[(t * groups + g) * 4 + r] = group g's sum of (v + offset) q.
struct GroupSums {
  const uint8_t* const* w;
  int R;
  const int8_t* const* q;
  int NT;
  const Int8Rows& x;
  int32_t* sums;
};

void group_sums_portable(const NibbleCodes& codes, const GroupSums& s) {
  const Int8Rows& x = s.x;
  for (int t = 0; t < s.NT; ++t)
    for (int64_t g = 0; g < x.groups; ++g)
      for (int r = 0; r < 4; ++r) {  // rows past R: zero sums, as the vector paths leave them
        int32_t total = 0;
        for (int64_t k = g * x.group; r < s.R && k < std::min(x.cols, (g + 1) * x.group); ++k) {
          const uint32_t code = (s.w[r][k / 2] >> (4 * (k & 1))) & 15u;
          total += static_cast<int32_t>(codes.byte[code]) * s.q[t][dot_position(k, x.span)];
        }
        s.sums[(t * x.groups + g) * 4 + r] = total;
      }
}

#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))

// The S / 2 bytes of nibbles at w (`bytes` of them readable; fewer: zero-filled) as S unsigned
// bytes in the dot layout, in S / 32 vectors, each nibble through the code table.
template <int S>
AVX2 inline void nibble_span(const uint8_t* w, int64_t bytes, const NibbleCodes& codes, __m256i table, __m256i* out) {
  if (__builtin_expect(bytes < S / 2, 0)) {  // the row's last span: not past its bytes
    alignas(32) uint8_t tail[32] = {};
    std::memcpy(tail, w, bytes);
    return nibble_span<S>(tail, S / 2, codes, table, out);
  }
  const __m256i low4 = _mm256_set1_epi8(15);
  if (S == 64) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    out[0] = _mm256_and_si256(b, low4);
    out[1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    out[0] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low4);
  }
  if (!codes.identity)
    for (int h = 0; h < S / 32; ++h) out[h] = _mm256_shuffle_epi8(table, out[h]);
}

// How far ahead of a row's reads the vector paths prefetch it: the rows of a dot call are a few
// streams far apart, more than the hardware prefetchers keep ahead of at this compute density,
// and short (1 KiB for an int4 row of 2048 values), so the prefetch reaches into the rows the
// next call reads: their loads, not the dots, are what the int8 path waits on.
constexpr int64_t kPrefetchBytes = 3072;

// The int32 sums of the four lanes of each 128-bit half of a, b, c and d: [a, b, c, d] of the
// low halves, then of the high ones.
AVX2 inline __m256i sum_halves4(__m256i a, __m256i b, __m256i c, __m256i d) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
}

// Group g's sums of four rows' accumulators into s.sums for token t: each accumulator sums one
// group (the halves added), or two, g in its low half and g + 1 in its high one (groups of 32
// values in spans of 64: a span's low half holds the even and odd values of its first 32).
template <bool kTwoGroups>
AVX2 inline void store_group_sums(__m256i a, __m256i b, __m256i c, __m256i d, int32_t* sums, int64_t groups,
                                  int t, int64_t g) {
  const __m256i halves = sum_halves4(a, b, c, d);
  int32_t* at = sums + (t * groups + g) * 4;
  if (!kTwoGroups) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at),
                     _mm_add_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1)));
    return;
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm256_castsi256_si128(halves));
  if (g + 1 < groups) _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 4), _mm256_extracti128_si256(halves, 1));
}

// Group sums of R rows against P = 1 or 2 tokens from t0, the rows in lockstep: each span of
// weights is decoded once for the P tokens, each token's span loaded once for the R rows.
// vpmaddubsw multiplies unsigned bytes by int8 into int16 pairs (at most 2 x 24 x 127 a pair, two
// pairs summed: no saturation), vpmaddwd widens them into int32.
template <int S, bool kTwoGroups, int R, int P>
AVX2 void group_sums_avx2_tile(const NibbleCodes& codes, const GroupSums& s, int t0) {
  const Int8Rows& x = s.x;
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes.byte)));
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t bytes = ceil_div(x.cols, 2);
  constexpr int64_t kStep = kTwoGroups ? 2 : 1;  // groups an accumulator sums
  for (int64_t g = 0; g < x.groups; g += kStep) {
    __m256i acc[4][P];
    for (int r = 0; r < 4; ++r)
      for (int p = 0; p < P; ++p) acc[r][p] = _mm256_setzero_si256();
    for (int64_t k = g * x.group; k < std::min(x.cols, (g + kStep) * x.group); k += S) {
      __m256i xs[P][S / 32];
      for (int p = 0; p < P; ++p)
        for (int h = 0; h < S / 32; ++h)
          xs[p][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.q[t0 + p] + k + 32 * h));
      for (int r = 0; r < R; ++r) {
        __m256i w[S / 32];
        _mm_prefetch(reinterpret_cast<const char*>(s.w[r] + k / 2 + kPrefetchBytes), _MM_HINT_T0);
        nibble_span<S>(s.w[r] + k / 2, bytes - k / 2, codes, table, w);
        for (int p = 0; p < P; ++p) {
          __m256i pairs = _mm256_maddubs_epi16(w[0], xs[p][0]);
          if (S == 64) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[1], xs[p][1]));
          acc[r][p] = _mm256_add_epi32(acc[r][p], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int p = 0; p < P; ++p)
      store_group_sums<kTwoGroups>(acc[0][p], acc[1][p], acc[2][p], acc[3][p], s.sums, x.groups, t0 + p, g);
  }
}

// The same with vpdpbusd (four unsigned bytes times four int8 into each int32 lane).
template <int S, bool kTwoGroups, int R, int P>
AVX512_VNNI void group_sums_vnni_tile(const NibbleCodes& codes, const GroupSums& s, int t0) {
  const Int8Rows& x = s.x;
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes.byte)));
  const int64_t bytes = ceil_div(x.cols, 2);
  constexpr int64_t kStep = kTwoGroups ? 2 : 1;  // groups an accumulator sums
  for (int64_t g = 0; g < x.groups; g += kStep) {
    __m256i acc[4][P];
    for (int r = 0; r < 4; ++r)
      for (int p = 0; p < P; ++p) acc[r][p] = _mm256_setzero_si256();
    for (int64_t k = g * x.group; k < std::min(x.cols, (g + kStep) * x.group); k += S) {
      __m256i xs[P][S / 32];
      for (int p = 0; p < P; ++p)
        for (int h = 0; h < S / 32; ++h)
          xs[p][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.q[t0 + p] + k + 32 * h));
      for (int r = 0; r < R; ++r) {
        __m256i w[S / 32];
        _mm_prefetch(reinterpret_cast<const char*>(s.w[r] + k / 2 + kPrefetchBytes), _MM_HINT_T0);
        nibble_span<S>(s.w[r] + k / 2, bytes - k / 2, codes, table, w);
        for (int p = 0; p < P; ++p)
          for (int h = 0; h < S / 32; ++h) acc[r][p] = _mm256_dpbusd_epi32(acc[r][p], w[h], xs[p][h]);
      }
    }
    for (int p = 0; p < P; ++p)
      store_group_sums<kTwoGroups>(acc[0][p], acc[1][p], acc[2][p], acc[3][p], s.sums, x.groups, t0 + p, g);
  }
}

// A tile function by its row count: Tile<R>::run for R = 1 .. 4.
template <template <int> class Tile>
inline void by_rows(int R, const NibbleCodes& codes, const GroupSums& s, int t0) {
  switch (R) {
    case 1: Tile<1>::run(codes, s, t0); break;
    case 2: Tile<2>::run(codes, s, t0); break;
    case 3: Tile<3>::run(codes, s, t0); break;
    default: Tile<4>::run(codes, s, t0); break;
  }
}

// The tile functions of one span, grouping and token count, by row count: Tile<R>::run.
template <int S, bool kTwoGroups, int P>
struct Avx2Tiles {
  template <int R>
  struct Tile {
    static void run(const NibbleCodes& codes, const GroupSums& s, int t0) {
      group_sums_avx2_tile<S, kTwoGroups, R, P>(codes, s, t0);
    }
  };
};

template <int S, bool kTwoGroups, int P>
struct VnniTiles {
  template <int R>
  struct Tile {
    static void run(const NibbleCodes& codes, const GroupSums& s, int t0) {
      group_sums_vnni_tile<S, kTwoGroups, R, P>(codes, s, t0);
    }
  };
};

// The group sums of tokens [t0, t0 + P) on a vector path, by the call's span and group size.
template <template <int, bool, int> class Tiles, int P>
void group_sums_tokens(const NibbleCodes& codes, const GroupSums& s, int t0) {
  if (s.x.span == 32)
    by_rows<Tiles<32, false, P>::template Tile>(s.R, codes, s, t0);
  else if (s.x.group == 32)
    by_rows<Tiles<64, true, P>::template Tile>(s.R, codes, s, t0);
  else
    by_rows<Tiles<64, false, P>::template Tile>(s.R, codes, s, t0);
}

// The group sums on a vector path (groups of a multiple of 32 values), tokens two at a time.
template <template <int, bool, int> class Tiles>
void group_sums_vector(const NibbleCodes& codes, const GroupSums& s) {
  for (int t0 = 0; t0 < s.NT; t0 += 2) {
    if (s.NT - t0 >= 2)
      group_sums_tokens<Tiles, 2>(codes, s, t0);
    else
      group_sums_tokens<Tiles, 1>(codes, s, t0);
  }
}

template <typename T>
T* thread_buffer(int64_t count) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

// acc[r * NT + t] = the int8-path dot of matrix m's rows rows[r] and the quantized rows
// xrows[t] of x: integer group sums, then acc = acc + float(sum) * (s * d) in group order.
void int8_dots(const MoEHostCall& c, int bank, const QuantMatrix& m, const int64_t* rows, int R, const Int8Rows& x,
               const int64_t* xrows, int NT, float* acc) {
  const uint8_t* w[4];
  const int8_t* q[4];
  for (int r = 0; r < R; ++r) w[r] = m.weights + rows[r] * m.row_bytes;
  for (int t = 0; t < NT; ++t) q[t] = x.values(xrows[t]);
  int32_t* sums = thread_buffer<int32_t>(NT * x.groups * 4);
  const GroupSums s{w, R, q, NT, x, sums};
  const NibbleCodes& codes = nibble_codes(c);
  if (x.group % 32 == 0 && c.int8_isa == kInt8Vnni)
    group_sums_vector<VnniTiles>(codes, s);
  else if (x.group % 32 == 0 && c.int8_isa == kInt8Avx2)
    group_sums_vector<Avx2Tiles>(codes, s);
  else
    group_sums_portable(codes, s);
  float* ws = thread_buffer<float>(4 * x.groups);  // [g][r]: the four rows' scales side by side
  for (int r = 0; r < 4; ++r) int8_weight_scales(c, m, scale_row_of(c, bank, rows[std::min(r, R - 1)]), ws + r, 4);
  // the four rows in the lanes of one vector, each lane's operations in the scalar order
  for (int t = 0; t < NT; ++t) {
    const float* d = x.scales(xrows[t]);
    const int32_t* offset_sum = x.offset_sums(xrows[t]);
    const int32_t* sum = sums + t * x.groups * 4;
    __m128 a = _mm_setzero_ps();
    for (int64_t g = 0; g < x.groups; ++g) {
      const __m128i centred = _mm_sub_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sum + g * 4)),
                                            _mm_set1_epi32(offset_sum[g]));
      const __m128 scale = _mm_mul_ps(_mm_loadu_ps(ws + g * 4), _mm_set1_ps(d[g]));
      a = _mm_add_ps(a, _mm_mul_ps(_mm_cvtepi32_ps(centred), scale));
    }
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, a);
    for (int r = 0; r < R; ++r) acc[r * NT + t] = lanes[r];
  }
}

struct Group {
  int64_t expert, start, count;  // routes order[start .. start + count) go to `expert`
};

constexpr int64_t kRowsA = 8;   // phase A work unit: this many gate rows (and their up rows)
constexpr int64_t kRowsB = 16;  // phase B work unit: this many output rows

// Phase A, one unit: act rows [i0, i1) of every route of group g, from the gate rows
// gate[0 .. i1 - i0) and the up rows up[0 ..) (H values each, consecutive).
template <typename W>
void gate_up_rows(const MoEHostCall& c, const Group& g, const int32_t* order, int64_t i0, int64_t i1, const W* gate,
                  const W* up, bool avx512) {
  const int64_t H = c.H, I = c.I;
  for (int64_t t0 = 0; t0 < g.count; t0 += 4) {
    int nt = static_cast<int>(std::min<int64_t>(4, g.count - t0));
    const uint16_t* xs[4];
    for (int t = 0; t < nt; ++t) xs[t] = c.x + (order[g.start + t0 + t] / c.K) * H;
    for (int64_t i = i0; i < i1; i += 2) {
      int pair = static_cast<int>(std::min<int64_t>(2, i1 - i));
      const W* rows[4];
      for (int p = 0; p < pair; ++p) {
        rows[p] = gate + (i - i0 + p) * H;
        rows[pair + p] = up + (i - i0 + p) * H;
      }
      float acc[16];
      dots(avx512, rows, 2 * pair, xs, nt, H, acc);
      for (int p = 0; p < pair; ++p)
        for (int t = 0; t < nt; ++t)
          c.act[order[g.start + t0 + t] * I + i + p] =
              activate_into(c, g.expert, i + p, acc[p * nt + t], acc[(pair + p) * nt + t]);
    }
  }
}

void gate_up_unit(const MoEHostCall& c, const Group& g, const int32_t* order, int64_t i0, int64_t i1, bool avx512) {
  const int64_t H = c.H, I = c.I;
  if (c.format == kBf16) {
    const uint16_t* bank = static_cast<const uint16_t*>(c.w13) + g.expert * 2 * I * H;
    gate_up_rows(c, g, order, i0, i1, bank + i0 * H, bank + (I + i0) * H, avx512);
    return;
  }
  float* tile = thread_tile(2 * kRowsA * H);
  dequantize_rows(c, 0, g.expert, i0, i1, tile);
  dequantize_rows(c, 0, g.expert, I + i0, I + i1, tile + (i1 - i0) * H);
  gate_up_rows<float>(c, g, order, i0, i1, tile, tile + (i1 - i0) * H, avx512);
}

// Phase B, one group: output rows [n0, n1) of its routes from rows[0 .. n1 - n0) (I values each).
template <typename W>
void down_rows(const MoEHostCall& c, const Group& g, const int32_t* order, int64_t n0, int64_t n1, const W* w,
               bool avx512) {
  const int64_t H = c.H, I = c.I;
  for (int64_t t0 = 0; t0 < g.count; t0 += 4) {
    int nt = static_cast<int>(std::min<int64_t>(4, g.count - t0));
    const uint16_t* acts[4];
    for (int t = 0; t < nt; ++t) acts[t] = c.act + order[g.start + t0 + t] * I;
    for (int64_t n = n0; n < n1; n += 4) {
      int nr = static_cast<int>(std::min<int64_t>(4, n1 - n));
      const W* rows[4];
      for (int r = 0; r < nr; ++r) rows[r] = w + (n - n0 + r) * I;
      float acc[16];
      dots(avx512, rows, nr, acts, nt, I, acc);
      for (int t = 0; t < nt; ++t) {
        int64_t route = order[g.start + t0 + t];
        for (int r = 0; r < nr; ++r)
          c.out[route * H + n + r] = weighted_out(c, g.expert, n + r, c.weights[route], acc[r * nt + t]);
      }
    }
  }
}

// Phase B, one unit: output rows [n0, n1) of every route of every group.
void down_unit(const MoEHostCall& c, const std::vector<Group>& groups, const int32_t* order, int64_t n0, int64_t n1,
               bool avx512) {
  const int64_t H = c.H, I = c.I;
  float* tile = c.format == kBf16 ? nullptr : thread_tile(kRowsB * I);
  for (const Group& g : groups) {
    if (c.format == kBf16) {
      down_rows(c, g, order, n0, n1, static_cast<const uint16_t*>(c.w2) + g.expert * H * I + n0 * I, avx512);
    } else {
      dequantize_rows(c, 1, g.expert, n0, n1, tile);
      down_rows<float>(c, g, order, n0, n1, tile, avx512);
    }
  }
}

// Phase A, one unit, on a path that reads the bank's stored rows itself: act rows [i0, i1) of
// every route of group g. dots(bank, m, rows, R, tokens, NT, acc) computes acc[r * NT + t], the
// dot of stored row rows[r] of m and token tokens[t].
template <typename Dots>
void gate_up_unit_stored(const MoEHostCall& c, const Group& g, const int32_t* order, int64_t i0, int64_t i1,
                         Dots dots) {
  const QuantMatrix m = quant_matrix(c, 0, g.expert);
  for (int64_t t0 = 0; t0 < g.count; t0 += 4) {
    const int nt = static_cast<int>(std::min<int64_t>(4, g.count - t0));
    int64_t tokens[4];
    for (int t = 0; t < nt; ++t) tokens[t] = order[g.start + t0 + t] / c.K;
    for (int64_t i = i0; i < i1; i += 2) {
      const int pair = static_cast<int>(std::min<int64_t>(2, i1 - i));
      int64_t rows[4];
      for (int p = 0; p < pair; ++p) {
        rows[p] = i + p;
        rows[pair + p] = c.I + i + p;
      }
      float acc[16];
      dots(0, m, rows, 2 * pair, tokens, nt, acc);
      for (int p = 0; p < pair; ++p)
        for (int t = 0; t < nt; ++t)
          c.act[order[g.start + t0 + t] * c.I + i + p] =
              activate_into(c, g.expert, i + p, acc[p * nt + t], acc[(pair + p) * nt + t]);
    }
  }
}

// Phase B, one unit, likewise: output rows [n0, n1) of every route of every group; dots' tokens
// are routes (their act rows).
template <typename Dots>
void down_unit_stored(const MoEHostCall& c, const std::vector<Group>& groups, const int32_t* order, int64_t n0,
                      int64_t n1, Dots dots) {
  for (const Group& g : groups) {
    const QuantMatrix m = quant_matrix(c, 1, g.expert);
    for (int64_t t0 = 0; t0 < g.count; t0 += 4) {
      const int nt = static_cast<int>(std::min<int64_t>(4, g.count - t0));
      int64_t routes[4];
      for (int t = 0; t < nt; ++t) routes[t] = order[g.start + t0 + t];
      for (int64_t n = n0; n < n1; n += 4) {
        const int nr = static_cast<int>(std::min<int64_t>(4, n1 - n));
        int64_t rows[4];
        for (int r = 0; r < nr; ++r) rows[r] = n + r;
        float acc[16];
        dots(1, m, rows, nr, routes, nt, acc);
        for (int t = 0; t < nt; ++t)
          for (int r = 0; r < nr; ++r)
            c.out[routes[t] * c.H + n + r] =
                weighted_out(c, g.expert, n + r, c.weights[routes[t]], acc[r * nt + t]);
      }
    }
  }
}

// The int8 path's dots against the quantized rows x (tokens' for bank 0, routes' acts for bank 1).
struct Int8Dots {
  const MoEHostCall& c;
  const Int8Rows& x;
  void operator()(int bank, const QuantMatrix& m, const int64_t* rows, int R, const int64_t* xrows, int NT,
                  float* acc) const {
    int8_dots(c, bank, m, rows, R, x, xrows, NT, acc);
  }
};

// ---- fp8 on AVX2 without AVX-512: weights decoded in registers, the exact path's numerics ----
// Each weight is fp8_value(code) * its block's scale, one float32 multiply, then fused
// multiply-adds with the float tokens: the arithmetic over a dequantized tile, without the tile.

// Eight e4m3 codes at w as fp8_value gives them: normal codes from their bits, subnormal ones
// (exponent 0) as m * 2^-9, 0x7f (and 0xff) a quiet NaN, the sign bit moved to float's.
AVX2 inline __m256 fp8x8_values(const uint8_t* w) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
  const __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0.001953125f));
  __m256 v = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em)));
  v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                       _mm256_castsi256_ps(_mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7f))));
  return _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24)));
}

AVX2 inline __m256 bf16x8_to_f32(const uint16_t* x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}

AVX2 inline float sum_lanes(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// acc[r * P + p] = the dots of R fp8 rows w (scales: each row's block scales along K, a block
// bk values, bk % 8 == 0) with P bf16 tokens x over L values; the last 8 past L zero-filled.
template <int R, int P>
AVX2 void fp8_dots_avx2_tile(const uint8_t* const* w, const float* const* scales, const uint16_t* const* x, int64_t L,
                             int64_t bk, float* acc) {
  __m256 a[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) a[r][p] = _mm256_setzero_ps();
  for (int64_t k = 0; k < L; k += 8) {
    const uint8_t* wk[R];
    __m256 xv[P];
    alignas(32) uint8_t wtail[R][8] = {};
    alignas(32) uint16_t xtail[P][8] = {};
    const bool tail = k + 8 > L;
    for (int r = 0; r < R; ++r) {
      wk[r] = w[r] + k;
      if (tail) wk[r] = static_cast<const uint8_t*>(std::memcpy(wtail[r], wk[r], L - k));
      _mm_prefetch(reinterpret_cast<const char*>(wk[r] + kPrefetchBytes), _MM_HINT_T0);
    }
    for (int p = 0; p < P; ++p)
      xv[p] = bf16x8_to_f32(tail ? static_cast<const uint16_t*>(std::memcpy(xtail[p], x[p] + k, 2 * (L - k))) : x[p] + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_mul_ps(fp8x8_values(wk[r]), _mm256_broadcast_ss(scales[r] + k / bk));
      for (int p = 0; p < P; ++p) a[r][p] = _mm256_fmadd_ps(wv, xv[p], a[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r * P + p] = sum_lanes(a[r][p]);
}

template <int P>
void fp8_dots_avx2_rows(int R, const uint8_t* const* w, const float* const* scales, const uint16_t* const* x, int64_t L,
                        int64_t bk, float* acc) {
  switch (R) {
    case 1: fp8_dots_avx2_tile<1, P>(w, scales, x, L, bk, acc); break;
    case 2: fp8_dots_avx2_tile<2, P>(w, scales, x, L, bk, acc); break;
    case 3: fp8_dots_avx2_tile<3, P>(w, scales, x, L, bk, acc); break;
    default: fp8_dots_avx2_tile<4, P>(w, scales, x, L, bk, acc); break;
  }
}

// The stored bytes and the block scales of rows rows[0 .. R) of fp8 matrix m (bank `bank`).
inline void fp8_rows(const MoEHostCall& c, int bank, const QuantMatrix& m, const int64_t* rows, int R,
                     const uint8_t** w, const float** scales) {
  for (int r = 0; r < R; ++r) {
    w[r] = m.weights + rows[r] * m.row_bytes;
    scales[r] = reinterpret_cast<const float*>(m.scales) + scale_row_of(c, bank, rows[r]) * m.scale_cols;
  }
}

// The bf16 row the fp8 dots read for `token`: bank 0's tokens are rows of x, bank 1's routes
// rows of act.
inline const uint16_t* fp8_dot_input(const MoEHostCall& c, int bank, int64_t token) {
  return bank == 0 ? c.x + token * c.H : c.act + token * c.I;
}

// The fp8 dots on AVX2 (gate_up_unit_stored's and down_unit_stored's Dots).
struct Fp8Avx2Dots {
  const MoEHostCall& c;
  void operator()(int bank, const QuantMatrix& m, const int64_t* rows, int R, const int64_t* tokens, int NT,
                  float* acc) const {
    const uint8_t* w[4];
    const float* scales[4];
    fp8_rows(c, bank, m, rows, R, w, scales);
    for (int t0 = 0; t0 < NT; t0 += 2) {
      const int P = std::min(2, NT - t0);
      const uint16_t* x[2];
      for (int p = 0; p < P; ++p) x[p] = fp8_dot_input(c, bank, tokens[t0 + p]);
      float part[8];
      if (P == 2)
        fp8_dots_avx2_rows<2>(R, w, scales, x, m.cols, c.block_k, part);
      else
        fp8_dots_avx2_rows<1>(R, w, scales, x, m.cols, c.block_k, part);
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) acc[r * NT + t0 + p] = part[r * P + p];
    }
  }
};

// 16 e4m3 bytes as their exact float32 values, as fp8x8_values (NaN codes quiet NaNs).
AVX512_F32 inline __m512 fp8x16_values(__m128i bytes) {
  const __m512i b = _mm512_cvtepu8_epi32(bytes);
  const __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
  __m512 v = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
  v = _mm512_mask_mul_ps(v, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(8), em), _mm512_cvtepi32_ps(em),
                         _mm512_set1_ps(0.001953125f));
  v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7f)),
                         _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

// acc[r * NT + t] = the dots of R fp8 rows w (each row's block scales along K, a block bk
// values, bk % 16 == 0) with NT bf16 tokens x over L values, the weights decoded in registers:
// each weight float(e4m3) * scale as the dequantized tile holds it, then the tile dots'
// operations lane for lane (dots_avx512_f32_tile: 16 lanes of fused multiply-adds, the tail
// masked, the lanes reduced), so the bits are the tile path's without writing the tile.
template <int R, int NT>
AVX512_F32 void fp8_dots_avx512_tile(const uint8_t* const* w, const float* const* scales, const uint16_t* const* x,
                                     int64_t L, int64_t bk, float* acc) {
  __m512 a[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) a[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < L; k += 16) {
    const __mmask16 m = L - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (L - k)) - 1);
    __m512 xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, x[t] + k));
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + k + kPrefetchBytes), _MM_HINT_T0);
      const __m512 values = fp8x16_values(_mm_maskz_loadu_epi8(m, w[r] + k));
      const __m512 wv = _mm512_maskz_mul_ps(m, values, _mm512_set1_ps(scales[r][k / bk]));
      for (int t = 0; t < NT; ++t) a[r][t] = _mm512_fmadd_ps(wv, xv[t], a[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r * NT + t] = _mm512_reduce_add_ps(a[r][t]);
}

template <int R>
void fp8_dots_avx512_rows(int NT, const uint8_t* const* w, const float* const* scales, const uint16_t* const* x,
                          int64_t L, int64_t bk, float* acc) {
  switch (NT) {
    case 1: fp8_dots_avx512_tile<R, 1>(w, scales, x, L, bk, acc); break;
    case 2: fp8_dots_avx512_tile<R, 2>(w, scales, x, L, bk, acc); break;
    case 3: fp8_dots_avx512_tile<R, 3>(w, scales, x, L, bk, acc); break;
    default: fp8_dots_avx512_tile<R, 4>(w, scales, x, L, bk, acc); break;
  }
}

// The fp8 dots on AVX-512 (gate_up_unit_stored's and down_unit_stored's Dots), as Fp8Avx2Dots.
struct Fp8Avx512Dots {
  const MoEHostCall& c;
  void operator()(int bank, const QuantMatrix& m, const int64_t* rows, int R, const int64_t* tokens, int NT,
                  float* acc) const {
    const uint8_t* w[4];
    const float* scales[4];
    const uint16_t* x[4];
    fp8_rows(c, bank, m, rows, R, w, scales);
    for (int t = 0; t < NT; ++t) x[t] = fp8_dot_input(c, bank, tokens[t]);
    switch (R) {
      case 1: fp8_dots_avx512_rows<1>(NT, w, scales, x, m.cols, c.block_k, acc); break;
      case 2: fp8_dots_avx512_rows<2>(NT, w, scales, x, m.cols, c.block_k, acc); break;
      case 3: fp8_dots_avx512_rows<3>(NT, w, scales, x, m.cols, c.block_k, acc); break;
      default: fp8_dots_avx512_rows<4>(NT, w, scales, x, m.cols, c.block_k, acc); break;
    }
  }
};

// Whether a call's fp8 banks are read on AVX-512 in registers: the AVX-512 path asked for,
// blocks of a multiple of 16 values along K (else the dequantized tile).
inline bool fp8_avx512_path(const MoEHostCall& c) {
  return c.format == kFp8 && c.use_avx512 != 0 && c.block_k % 16 == 0;
}

// Whether a call's fp8 banks are read on AVX2 in registers: no AVX-512 path asked for, blocks of
// a multiple of 8 values along K.
inline bool fp8_avx2_path(const MoEHostCall& c) {
  return c.format == kFp8 && c.use_avx512 == 0 && c.int8_isa != kInt8Portable && c.block_k % 8 == 0;
}

// Whether a call takes the int8 path: int8 activations asked for, over banks of integer nibbles.
inline bool int8_path(const MoEHostCall& c) {
  return c.activations == kActInt8 && (c.format == kInt4 || c.format == kMxfp4);
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

std::atomic<int64_t> g_calls{0}, g_total_ns{0}, g_max_ns{0}, g_experts{0}, g_working_calls{0}, g_working_ns{0};

// One call that began at `start` and computed `experts` distinct experts, into the counters.
void record_time(std::chrono::steady_clock::time_point start, int64_t experts) {
  const int64_t ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  g_calls.fetch_add(1, std::memory_order_relaxed);
  g_total_ns.fetch_add(ns, std::memory_order_relaxed);
  if (experts > 0) {  // a call that woke the threads and paid the fixed cost
    g_experts.fetch_add(experts, std::memory_order_relaxed);
    g_working_calls.fetch_add(1, std::memory_order_relaxed);
    g_working_ns.fetch_add(ns, std::memory_order_relaxed);
  }
  int64_t seen = g_max_ns.load(std::memory_order_relaxed);
  while (ns > seen && !g_max_ns.compare_exchange_weak(seen, ns, std::memory_order_relaxed)) {
  }
}

}  // namespace

extern "C" {

// Calls run so far, their total and longest wall time in ns, the distinct experts they
// computed, and of the calls that computed any (the others return at once) the count and
// wall time (every call, from any thread): the host channel's share of a step, read by its
// statistics and profile, and its speed as decode finds it (moe/host_experts.py SplitTuner).
void moe_host_timing(int64_t* out) {
  out[0] = g_calls.load();
  out[1] = g_total_ns.load();
  out[2] = g_max_ns.load();
  out[3] = g_experts.load();
  out[4] = g_working_calls.load();
  out[5] = g_working_ns.load();
}

// The best MoEHostInt8Isa this CPU runs.
int moe_host_int8_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
    return kInt8Vnni;
  return __builtin_cpu_supports("avx2") ? kInt8Avx2 : kInt8Portable;
}

int moe_host_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl")
             ? 1
             : 0;
}

// Rows [r0, r1) of expert e's w13 (bank 0) or w2 (bank 1) of a quantized call, dequantized into
// dst [r1 - r0, cols] float32 as the kernel computes with them (tests compare them with the
// reference's dequantize_blocks bit for bit).
void moe_host_dequantize(const void* arg, int32_t bank, int64_t e, int64_t r0, int64_t r1, float* dst) {
  dequantize_rows(*static_cast<const MoEHostCall*>(arg), bank, e, r0, r1, dst);
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
    record_time(start, 0);
    return;
  }
  if (c.schedule == kDynamic)
    omp_set_schedule(omp_sched_dynamic, 1);
  else
    omp_set_schedule(omp_sched_static, 0);
  const bool int8 = int8_path(c), fp8_avx2 = fp8_avx2_path(c), fp8_avx512 = fp8_avx512_path(c);
  Int8Rows tokens, acts;  // the int8 path's quantized x rows (by token) and act rows (by route)
  if (int8) {
    tokens.reset(c.T, c.H, c.block_k, dot_span(c), nibble_codes(c).offset);
    acts.reset(routes, c.I, c.block_k, dot_span(c), nibble_codes(c).offset);
  }
  const int64_t valid = static_cast<int64_t>(order.size());
#pragma omp parallel num_threads(c.threads)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < routes; ++r)
      if (c.ids[r] < 0 || c.ids[r] >= c.E) std::memset(c.out + r * c.H, 0, c.H * sizeof(uint16_t));
    if (int8) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < c.T; ++t) quantize_row(c.x + t * c.H, tokens, t);
    }
#pragma omp for schedule(runtime)
    for (int64_t u = 0; u < units_a; ++u) {
      const Group& g = groups[u / units_per_group];
      int64_t i0 = (u % units_per_group) * kRowsA, i1 = std::min(c.I, i0 + kRowsA);
      if (int8)
        gate_up_unit_stored(c, g, order.data(), i0, i1, Int8Dots{c, tokens});
      else if (fp8_avx512)
        gate_up_unit_stored(c, g, order.data(), i0, i1, Fp8Avx512Dots{c});
      else if (fp8_avx2)
        gate_up_unit_stored(c, g, order.data(), i0, i1, Fp8Avx2Dots{c});
      else
        gate_up_unit(c, g, order.data(), i0, i1, avx512);
    }
    if (int8) {
#pragma omp for schedule(static)
      for (int64_t j = 0; j < valid; ++j) quantize_row(c.act + order[j] * c.I, acts, order[j]);
    }
#pragma omp for schedule(runtime)
    for (int64_t u = 0; u < units_b; ++u) {
      int64_t n0 = u * kRowsB, n1 = std::min(c.H, n0 + kRowsB);
      if (int8)
        down_unit_stored(c, groups, order.data(), n0, n1, Int8Dots{c, acts});
      else if (fp8_avx512)
        down_unit_stored(c, groups, order.data(), n0, n1, Fp8Avx512Dots{c});
      else if (fp8_avx2)
        down_unit_stored(c, groups, order.data(), n0, n1, Fp8Avx2Dots{c});
      else
        down_unit(c, groups, order.data(), n0, n1, avx512);
    }
  }
  record_time(start, static_cast<int64_t>(groups.size()));
}

}  // extern "C"

namespace {

// A mailbox worker: the thread, the mailbox it polls and the table of calls it may run.
struct MailboxWorker {
  int64_t* box;
  MoEHostCall* const* calls;
  int64_t capacity;
  std::atomic<bool> stop{false};
  std::thread thread;
};

// Run each request's call, then publish it done (a request naming no call: kBadCall set).
void worker_loop(MailboxWorker* w) {
  mailbox::poll(w->box, w->stop, [w](int64_t posted) {
    const int64_t index = __atomic_load_n(&w->box[mailbox::kCall], __ATOMIC_ACQUIRE);
    MoEHostCall* call = index >= 0 && index < w->capacity ? w->calls[index] : nullptr;
    if (call != nullptr)
      moe_host_run(call);
    else
      __atomic_store_n(&w->box[mailbox::kBadCall], 1, __ATOMIC_RELEASE);
    __atomic_store_n(&w->box[mailbox::kDone], posted, __ATOMIC_RELEASE);
  });
}

}  // namespace

extern "C" {

// Start a worker over `box` (pinned, at least 17 int64 words) and a table of `capacity` call
// pointers (null: no call yet; entries are filled before a request names them).
void* moe_host_worker_start(int64_t* box, MoEHostCall* const* calls, int64_t capacity) {
  auto* w = new MailboxWorker{box, calls, capacity};
  w->thread = std::thread(worker_loop, w);
  return w;
}

// Stop and join a worker (after its last request is done).
void moe_host_worker_stop(void* handle) {
  auto* w = static_cast<MailboxWorker*>(handle);
  w->stop.store(true);
  w->thread.join();
  delete w;
}

}  // extern "C"
