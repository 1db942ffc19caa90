// What every kernel family shares: the CPU-feature macros (the only place that tests the
// compiler's __AVX...__ macros), scalar conversions, the Vec types and the vector helpers that
// several families use. Everything here is inline; a helper one family alone uses lives in its file.
#pragma once

// The tensor type and the operators used, each from its own header: torch/extension.h (pybind11
// and the C++ frontend) compiles five times as long in every file that includes it, ATen/ATen.h
// (every operator) twice as long. bindings.cpp alone includes pybind11 (torch/python.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// ----- CPU features of the build (-march=native), each 0 or 1 -----------------------------------
#ifdef __AVX__
#define KVSERVE_HAS_AVX 1
#else
#define KVSERVE_HAS_AVX 0
#endif
#ifdef __AVX2__
#define KVSERVE_HAS_AVX2 1
#else
#define KVSERVE_HAS_AVX2 0
#endif
#if KVSERVE_HAS_AVX2 && defined(__FMA__)
#define KVSERVE_HAS_AVX2_FMA 1
#else
#define KVSERVE_HAS_AVX2_FMA 0
#endif
#ifdef __F16C__
#define KVSERVE_HAS_F16C 1
#else
#define KVSERVE_HAS_F16C 0
#endif
#ifdef __AVX512F__
#define KVSERVE_HAS_AVX512 1
#else
#define KVSERVE_HAS_AVX512 0
#endif
// Vec's fused_multiply_add and sum_lanes_each are vector instructions (AVX-512 has FMA).
#if KVSERVE_HAS_AVX512 || KVSERVE_HAS_AVX2_FMA
#define KVSERVE_HAS_VEC_FMA 1
#else
#define KVSERVE_HAS_VEC_FMA 0
#endif
// int4 weights times int8 activations: AVX2's byte multiply-add, F16C for float16 scales.
#if KVSERVE_HAS_AVX2_FMA && defined(__F16C__)
#define KVSERVE_HAS_INT8_ACTIVATIONS 1
#else
#define KVSERVE_HAS_INT8_ACTIVATIONS 0
#endif
// AVX512-VNNI's vpdpbusd: four byte products summed into an int32 lane per instruction.
#if KVSERVE_HAS_AVX512 && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVSERVE_HAS_VNNI512 1
#else
#define KVSERVE_HAS_VNNI512 0
#endif
// AVX512-BF16's vdpbf16ps: two bfloat16 products summed into a float32 lane per instruction.
#if KVSERVE_HAS_AVX512 && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KVSERVE_HAS_AVX512_BF16 1
#else
#define KVSERVE_HAS_AVX512_BF16 0
#endif
// AMX tiles with bfloat16 products (Sapphire Rapids and later).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVSERVE_HAS_AMX_BF16 1
#else
#define KVSERVE_HAS_AMX_BF16 0
#endif
// AMX tiles with int8 products (TDPBSUD: signed bytes by unsigned bytes, summed in int32).
#if KVSERVE_HAS_AMX_BF16 && defined(__AMX_INT8__)
#define KVSERVE_HAS_AMX_INT8 1
#else
#define KVSERVE_HAS_AMX_INT8 0
#endif

#if KVSERVE_HAS_AVX
#include <immintrin.h>
#endif

namespace kvserve {

// ----- work over the threads ----------------------------------------------------------------
// fn(task) for every task in [0, count) of a matmul over `rows` rows. From kClaimedRows rows each
// thread claims the next tasks not yet taken, so a thread that the VM slows or starts late takes fewer,
// where at::parallel_for's fixed halves leave the other waiting at the barrier (at 64 rows the worker
// waited 16% of a step, the engine thread 8%). Claims of count / (32 x threads) tasks keep the shared
// counter's traffic small for many small tasks (a vocabulary's vectors). Fewer rows (a layer then takes
// microseconds, and each claim moves the counter's cache line between cores) keep at::parallel_for's
// halves. fn's result must not depend on the thread: each task writes its own outputs.
constexpr int64_t kClaimedRows = 4;
template <typename F>
inline void parallel_tasks(int64_t count, int64_t rows, const F& fn) {
  if (count <= 0) return;
  if (rows < kClaimedRows) {
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) fn(task);
    });
    return;
  }
  const int64_t threads = std::min<int64_t>(count, at::get_num_threads());
  const int64_t claim = std::max<int64_t>(1, count / (32 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {  // inline, the whole range, when nested
    for (int64_t first = next.fetch_add(claim, std::memory_order_relaxed); first < count;
         first = next.fetch_add(claim, std::memory_order_relaxed)) {
      for (int64_t task = first; task < std::min(count, first + claim); ++task) fn(task);
    }
  });
}

// ----- scalar conversions (bfloat16 kept as raw bits so loops vectorize) ----------------------
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) { return c10::BFloat16(x); }  // round to nearest even
template <>
inline c10::Half from_float<c10::Half>(float x) { return c10::Half(x); }  // round to nearest even

// Round-to-nearest-even float -> T without a NaN branch, so that loops over weights vectorize
// (weights are finite; activations use from_float, which keeps NaN handling).
template <typename T>
inline T weight_from_float(float x);
template <>
inline float weight_from_float<float>(float x) { return x; }
template <>
inline c10::BFloat16 weight_from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// ----- vectors (GCC/Clang vector extensions: one register each on AVX-512 and AVX2) ------------
#if KVSERVE_HAS_AVX512
constexpr int64_t kLanes = 16;  // floats per vector register
#else
constexpr int64_t kLanes = 8;  // AVX2 (NEON: the compiler splits each vector in two)
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// kLanes bytes widened to int32 lanes: uint8 (the 4-bit codes' bytes) zero-extended, int8 (Q8_0
// codes) sign-extended. The generic conversion compiles to a byte-by-byte loop, hence the intrinsics.
template <typename B>
inline IVec widen_bytes(const B* p) {
  static_assert(std::is_same_v<B, uint8_t> || std::is_same_v<B, int8_t>);
  constexpr bool is_signed = std::is_signed_v<B>;
#if KVSERVE_HAS_AVX512
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<IVec>(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif KVSERVE_HAS_AVX2
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<IVec>(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
  typedef B BytesVec __attribute__((vector_size(kLanes)));
  BytesVec b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, IVec);
#endif
}

// kLanes floats from p: float32 as is, bfloat16 and float16 widened (F16C where the CPU has it).
inline Vec load_floats(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline Vec load_floats(const c10::BFloat16* p) {  // the bits shifted into a float's upper half
#if KVSERVE_HAS_AVX512
  return reinterpret_cast<Vec>(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif KVSERVE_HAS_AVX2
  return reinterpret_cast<Vec>(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  float lanes[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) lanes[i] = to_float(p[i]);
  return load_floats(lanes);
#endif
}
inline Vec load_floats(const c10::Half* p) {
#if KVSERVE_HAS_AVX512
  return reinterpret_cast<Vec>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif KVSERVE_HAS_F16C
  return reinterpret_cast<Vec>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  float lanes[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) lanes[i] = static_cast<float>(p[i]);
  return load_floats(lanes);
#endif
}

// The sum of a vector's lanes, in lane order.
inline float sum_lanes(Vec v) {
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(lanes));
  float total = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) total += lanes[i];
  return total;
}

#if KVSERVE_HAS_VEC_FMA
// r[i] = the sum of v[i]'s lanes, for kLanes vectors at once (decode attention's scores of kLanes
// keys, the lm_head's tiles): pairs of vectors are interleaved and added, halving the count each
// time, instead of kLanes separate reductions.
inline Vec sum_lanes_each(const Vec* v) {
#if KVSERVE_HAS_AVX512
  const __m512* z = reinterpret_cast<const __m512*>(v);
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i) {  // lane L: [2i part, 2i+1 part, 2i part, 2i+1 part]
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(z[2 * i], z[2 * i + 1]), _mm512_unpackhi_ps(z[2 * i], z[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // lane L: vectors 4i .. 4i+3, each summed over its lane L
    const __m512d a = _mm512_castps_pd(s1[2 * i]), b = _mm512_castps_pd(s1[2 * i + 1]);
    s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {  // lanes 0-1: vectors 8i .. 8i+3 (two halves), lanes 2-3: 8i+4 .. 8i+7
    s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return reinterpret_cast<Vec>(_mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                             _mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1))));
#else
  // horizontal adds, then one swap of halves
  const __m256* y = reinterpret_cast<const __m256*>(v);
  const __m256 h01 = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
  const __m256 h45 = _mm256_hadd_ps(_mm256_hadd_ps(y[4], y[5]), _mm256_hadd_ps(y[6], y[7]));
  return reinterpret_cast<Vec>(
      _mm256_add_ps(_mm256_permute2f128_ps(h01, h45, 0x20), _mm256_permute2f128_ps(h01, h45, 0x31)));
#endif
}
#endif

// c + a * b in one rounding where the CPU has FMA (spelled out, so that every kernel that must give
// the same bits as another does not depend on where the compiler contracts a * b + c).
inline Vec fused_multiply_add(Vec a, Vec b, Vec c) {
#if KVSERVE_HAS_AVX512
  return reinterpret_cast<Vec>(
      _mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(c)));
#elif KVSERVE_HAS_AVX2_FMA
  return reinterpret_cast<Vec>(
      _mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

// a in every lane (a broadcast: Vec{} + a would cost an add, and turn -0 into +0).
inline Vec splat(float a) {
#if KVSERVE_HAS_AVX512
  return reinterpret_cast<Vec>(_mm512_set1_ps(a));
#elif KVSERVE_HAS_AVX
  return reinterpret_cast<Vec>(_mm256_set1_ps(a));
#else
  Vec v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = a;
  return v;
#endif
}

// The largest of s[0, n), eight at a time with AVX2; with `nan`, whether any of them is NaN (the
// maximum is then meaningless: the vector max keeps NaN or drops it by operand order).
inline float row_peak(const float* s, int64_t n, bool* nan = nullptr) {
  int64_t i = 0;
  float peak = -INFINITY;
  bool unordered = false;
#if KVSERVE_HAS_AVX2
  __m256 peaks = _mm256_set1_ps(-INFINITY), flags = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(s + i);
    peaks = _mm256_max_ps(peaks, v);
    if (nan) flags = _mm256_or_ps(flags, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, peaks);
  for (float lane : lanes) peak = std::max(peak, lane);
  unordered = _mm256_movemask_ps(flags) != 0;
#endif
  for (; i < n; ++i) {
    unordered |= std::isnan(s[i]);
    peak = std::max(peak, s[i]);
  }
  if (nan) *nan = unordered;
  return peak;
}

#if KVSERVE_HAS_AVX2_FMA
// The sum of 8 lanes in a fixed order: the same for every row.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Eight bfloat16 values widened to float32 (exact).
inline __m256 load8_bf16(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

#if KVSERVE_HAS_AVX512
// Sixteen bfloat16 values widened to float32 (exact).
inline __m512 load16_bf16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

#if KVSERVE_HAS_INT8_ACTIVATIONS
// Eight inputs as float32: float32 as they are, bfloat16 widened (the same values, so the same q, d
// and s from quantize_group).
inline __m256 load8_input(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8_input(const c10::BFloat16* x) { return load8_bf16(x); }

// Activations quantized to int8 per group of 32, as llama.cpp's Q8_0 / Q8_1 (int4_int8.cpp, int8_int8.cpp).
// One group of 32 inputs: q (int8), d (the scale) and s = d * sum(q), the sum of the rounded inputs
// (Q8_1's s): an int4 layer's min term then sees the same inputs as its codes, so the layer computes
// W x' for x' = d * q exactly. With the float sum of x instead, the codes' offset (0..15 about 7.5)
// left the rounding uncancelled: 2.5x the error against W x for random inputs.
#if KVSERVE_HAS_AVX512
inline __m512 load16_input(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16_input(const c10::BFloat16* x) { return load16_bf16(x); }
#endif

template <typename X>
inline void quantize_group(const X* x, int8_t* q, float* d, float* s) {
#if KVSERVE_HAS_AVX512
  // 16 lanes at a time: the same scale (the max is exact in any order), the same rounding and
  // saturation, and the sum of the unsaturated integers, so the same q, d and s as the 8-lane code.
  const __m512 v0 = load16_input(x), v1 = load16_input(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float scale = amax / 127.0f;
  const __m512 inv = _mm512_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
  const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(i0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(i1));
  *d = scale;
  *s = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));  // |sum| <= 32 * 128
#else
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = load8_input(x + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax1 = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float scale = amax1 / 127.0f;
  const __m256 inv = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
  __m256i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // nearest even (MXCSR default)
  // packs interleave the 128-bit lanes: (0-3, 8-11, 16-19, 24-27 | 4-7, ...); the permute restores order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d = scale;
  const __m256i qsum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  *s = scale * hsum8(_mm256_cvtepi32_ps(qsum));  // |sum| <= 32 * 127: exact in float
#endif
}
#endif

// exp of 8 floats: Cephes' expf, a degree-6 polynomial after the reduction by ln 2. Against
// std::exp at every 1e-4 from -87.3 to 0, at most 1 unit in the last place apart; below about
// -87.3, where expf's results are subnormal, it gives 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}
#endif

// ----- dtype dispatch --------------------------------------------------------------------------
// f(T{}) for the compute dtype: float32 or bfloat16.
template <typename F>
inline auto with_compute_type(at::ScalarType dtype, F&& f) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "kvserve's kernels compute in float32 or bfloat16");
  return dtype == at::kBFloat16 ? f(c10::BFloat16{}) : f(float{});
}

// f(C{}) for a KV cache's dtype: float32, bfloat16 or float16.
template <typename F>
inline auto with_cache_type(at::ScalarType dtype, F&& f) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "the KV cache is float32, bfloat16 or float16");
  if (dtype == at::kFloat) return f(float{});
  if (dtype == at::kBFloat16) return f(c10::BFloat16{});
  return f(c10::Half{});
}

}  // namespace kvserve
