// A whole decode step of a Llama-family model on the CPU, in one call from Python.
//
// In eager PyTorch a decode step of a 30-layer model is ~1,200 small operator calls, each paying
// microseconds of Python and dispatcher overhead: more than the matmuls themselves on a small
// model. Here the layer loop runs in C++: the matmuls are those the Python path uses (int4_mm or
// a GEMM over the dequantized weight for int4, ATen's kernels for int8 and float), and the glue
// between them (RMSNorm with the residual add, RoPE, the KV-cache write, paged attention, SiLU*up)
// is fused loops over the batch.
//
// Attention reads each sequence's keys through its own block table up to its own length: the
// cost of a sequence is its own context, whatever the other sequences in the batch hold.
//
// Numerics follow the Python path (kvserve/models/llama.py): activations are stored in the
// compute dtype (bfloat16 or float32) between operations, arithmetic is done in float32.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

at::Tensor int4_mm(at::Tensor x, at::Tensor packed, at::Tensor scales_mins, int64_t n, int64_t group_size,
                   int64_t block_n, bool int8_activations);
at::Tensor dequantize_int4(at::Tensor packed, at::Tensor scales_mins, int64_t n, int64_t k, int64_t group_size,
                           int64_t block_n, at::ScalarType dtype);

namespace {

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
#if defined(__AVX512F__)
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
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<IVec>(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
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
#if defined(__AVX512F__)
  return reinterpret_cast<Vec>(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(__AVX2__)
  return reinterpret_cast<Vec>(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  float lanes[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) lanes[i] = to_float(p[i]);
  return load_floats(lanes);
#endif
}
inline Vec load_floats(const c10::Half* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<Vec>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// r[i] = the sum of v[i]'s lanes, for kLanes vectors at once (decode attention's scores of kLanes
// keys): pairs of vectors are interleaved and added, halving the count each time, instead of kLanes
// separate reductions.
inline Vec sum_lanes_each(const Vec* v) {
#if defined(__AVX512F__)
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
#if defined(__AVX512F__)
  return reinterpret_cast<Vec>(
      _mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(c)));
#elif defined(__AVX2__) && defined(__FMA__)
  return reinterpret_cast<Vec>(
      _mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}
// a in every lane (a broadcast: Vec{} + a would cost an add, and turn -0 into +0).
inline Vec splat(float a) {
#if defined(__AVX512F__)
  return reinterpret_cast<Vec>(_mm512_set1_ps(a));
#elif defined(__AVX__)
  return reinterpret_cast<Vec>(_mm256_set1_ps(a));
#else
  Vec v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = a;
  return v;
#endif
}

// out[i] = the sum of v[i]'s lanes for kLanes vectors, by one fixed tree per lane whatever else is
// summed beside it (sum_lanes_each where the CPU has it, else sum_lanes).
inline void reduce_lanes_each(const Vec* v, float* out) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const Vec sums = sum_lanes_each(v);
  std::memcpy(out, &sums, sizeof(sums));
#else
  for (int64_t i = 0; i < kLanes; ++i) out[i] = sum_lanes(v[i]);
#endif
}

// The largest of s[0, n), eight at a time with AVX2; with `nan`, whether any of them is NaN (the
// maximum is then meaningless: the vector max keeps NaN or drops it by operand order).
inline float row_peak(const float* s, int64_t n, bool* nan = nullptr) {
  int64_t i = 0;
  float peak = -INFINITY;
  bool unordered = false;
#if defined(__AVX2__)
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

// s[i] = exp(s[i] - max(s)) for i < n (softmax's numerators); returns their sum. With AVX2, eight
// at a time through exp8: Cephes' expf, a degree-6 polynomial after the reduction by ln 2. Against
// std::exp at every 1e-4 from -87.3 to 0, at most 1 unit in the last place apart; below about
// -87.3, where expf's results are subnormal (under 1.2e-38 of the largest term), it gives 0.
// Else std::exp one at a time.
#if defined(__AVX2__) && defined(__FMA__)
inline float hsum8(__m256 v) {  // fixed order: the same for every row
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

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

inline float exp_sum(float* s, int64_t n) {
  const float peak = row_peak(s, n);
  float total = 0.f;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 sum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(peak)));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  total = hsum8(sum);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - peak);
    total += s[i];
  }
  return total;
}

#if defined(__AVX2__) && defined(__FMA__)
// out[r * ldo + c] = x[r] . panel column c, for R rows of x and the first `cols` (<= 16) columns of a
// panel of k rows of 16 floats, ldp apart: a GEMM's register tile. Its 12 accumulators, 2 panel
// vectors and the broadcast x value fit in AVX2's 16 registers. The lm_head's panels and prefill
// attention's keys (transposed) and values are such panels.
template <int R>
inline void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t k, float* out,
                       int64_t ldo, int64_t cols) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_loadu_ps(panel + i * ldp), w1 = _mm256_loadu_ps(panel + i * ldp + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (cols == 16) {
      _mm256_storeu_ps(out + r * ldo, acc[r][0]);
      _mm256_storeu_ps(out + r * ldo + 8, acc[r][1]);
    } else {
      float lanes[16];
      _mm256_storeu_ps(lanes, acc[r][0]);
      _mm256_storeu_ps(lanes + 8, acc[r][1]);
      std::memcpy(out + r * ldo, lanes, cols * sizeof(float));
    }
  }
}

// panel_tile for up to 6 rows (rows known at run time).
inline void panel_tile_rows(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t k,
                            float* out, int64_t ldo, int64_t cols) {
  switch (rows) {
#define KVSERVE_ROWS(R)                                           \
  case R:                                                         \
    return panel_tile<R>(x, ldx, panel, ldp, k, out, ldo, cols);
    KVSERVE_ROWS(1) KVSERVE_ROWS(2) KVSERVE_ROWS(3) KVSERVE_ROWS(4) KVSERVE_ROWS(5) KVSERVE_ROWS(6)
#undef KVSERVE_ROWS
    default:
      TORCH_CHECK(false, "panel_tile: bad row tile");
  }
}
#endif

struct Linear {
  int64_t kind;  // 0 float (weight [N, K]), 1 int4 packed (+ scales_mins), 2 int8 (+ scales)
  at::Tensor weight, scales, bias;
};

// How an int4 layer multiplies (int4_block_n: the packing's rows per block, 0 if unknown): up to
// few_rows rows int4_mm (below), more rows a float GEMM over the dequantized weight; with an
// unknown layout, PyTorch's int4 kernel.
struct Int4Policy {
  int64_t few_rows, int4_block_n;
  bool int8_activations;
};

at::Tensor linear(const at::Tensor& x, const Linear& l, int64_t group_size, const Int4Policy& policy) {
  at::Tensor out;
  const int64_t n = l.weight.size(0);  // every kind stores [N, ...]
  if (l.kind == 1 && policy.int4_block_n > 0 && n % policy.int4_block_n == 0) {
    if (x.size(0) <= policy.few_rows || policy.int8_activations) {
      out = int4_mm(x, l.weight, l.scales, n, group_size, policy.int4_block_n, policy.int8_activations);
    } else {
      out = at::mm(x, dequantize_int4(l.weight, l.scales, n, x.size(1), group_size, policy.int4_block_n,
                                      x.scalar_type()));
    }
  } else if (l.kind == 1) {
    // PyTorch's kernel computes (code - 8) * scale + zero: zero = min + 8 * scale (Int4Linear's
    // kernel_scales_and_zeros).
    const at::Tensor scales = l.scales.select(1, 0).to(at::kFloat), mins = l.scales.select(1, 1).to(at::kFloat);
    out = at::_weight_int4pack_mm_for_cpu(x, l.weight, group_size,
                                          at::stack({scales, mins + 8 * scales}, -1).to(x.scalar_type()));
  } else if (l.kind == 2) {
    out = at::_weight_int8pack_mm(x, l.weight, l.scales);
  } else {
    out = at::linear(x, l.weight);
  }
  if (l.bias.defined()) out.add_(l.bias);
  return out;
}

// residual += delta (rounded to T, as a T + T add does), then out = w * T(rms_norm(residual)).
template <typename T>
void add_rms_norm(T* residual, const T* delta, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = residual + r * dim;
      float sum = 0.f;
      if (delta != nullptr) {
        const T* d = delta + r * dim;
        for (int64_t i = 0; i < dim; ++i) x[i] = from_float<T>(to_float(x[i]) + to_float(d[i]));
      }
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) {
        float v = to_float(x[i]);
        sum += v * v;
      }
      float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        float normed = to_float(from_float<T>(to_float(x[i]) * inv));
        o[i] = from_float<T>(to_float(weight[i]) * normed);
      }
    }
  });
}

// Rotate q and k (the first num_heads + num_kv_heads heads of each qkv row) in place, then write
// k and v into the caches at each token's slot.
template <typename T, typename C>  // C: the KV cache's element type
void rope_and_cache(T* qkv, const T* cos, const T* sin_signed, const int64_t* slots, C* k_cache, C* v_cache,
                    int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t kv_row = num_kv_heads * head_dim;
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * head_dim;
      const T* s = sin_signed + t * head_dim;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        T* x = qkv + t * row + h * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) {
          float rolled = to_float(x[i < half ? i + half : i - half]);
          // x * cos (rounded, as the Python path's first multiply), + rolled * sin_signed
          tmp[i] = to_float(from_float<T>(to_float(x[i]) * to_float(c[i]))) + rolled * to_float(s[i]);
        }
        for (int64_t i = 0; i < head_dim; ++i) x[i] = from_float<T>(tmp[i]);
      }
      const T* k = qkv + t * row + num_heads * head_dim;
      if constexpr (std::is_same_v<T, C>) {
        std::memcpy(k_cache + slots[t] * kv_row, k, kv_row * sizeof(T));
        std::memcpy(v_cache + slots[t] * kv_row, k + kv_row, kv_row * sizeof(T));
      } else {  // rounded to the cache's type, as the Python path's copy into it does
        for (int64_t i = 0; i < kv_row; ++i) {
          k_cache[slots[t] * kv_row + i] = from_float<C>(to_float(k[i]));
          v_cache[slots[t] * kv_row + i] = from_float<C>(to_float(k[kv_row + i]));
        }
      }
    }
  });
}

// out[b, h] = softmax(q[b, h] . K[b]^T * scale) V[b] over row b's own seq_lens[b] keys, through its
// own block table (a row is a decode token or one token of a prompt). Each (row, kv head) is one task. Its positions' cache rows are listed once (walking the
// block table a block at a time). Where head_dim is a multiple of the vector width, keys' dot
// products run side by side (independent chains, one load of q for all): eight at a time on AVX2,
// their sums reduced together into one vector of scores, else four. The softmax's exponentials go
// eight at a time (exp_sum), and the query heads' weighted sums of values are built in registers,
// kDimVecs vectors of dimensions at a time, rather than in memory one key at a time. For 64
// sequences of 25-152 tokens of the bundled model, eight keys and exp8 took the step without the
// lm_head from 79-81 to 74-79 ms (two builds alternating in one process, 4 runs). What is left is
// mostly reading the float32 cache: about 1.5 KB per token per layer, some 260 MB per step at 64
// streams.
template <typename T, typename C>  // C: the KV cache's element type
void decode_attention(const T* qkv, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                      const int64_t* seq_lens, T* out, int64_t num_seqs, int64_t max_blocks, int64_t block_size,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale) {
  constexpr int kDimVecs = kLanes < 64 ? 64 / kLanes : 1, kKeys = 4;  // 64 dimensions at a time
  constexpr int kHeadsPerPass = kLanes == 16 ? 4 : 1;  // query heads summed over the values together
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t kv_row = num_kv_heads * head_dim;
  const bool vectors = head_dim % kLanes == 0;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, q(group * head_dim);
    std::vector<int64_t> slots;
    for (int64_t task = begin; task < end; ++task) {
      // Rows taken from both ends in turn (0, n-1, 1, n-2, ...): parallel_for gives each thread a
      // contiguous range of tasks, and a prompt's rows attend over 1 to n keys, so each range then
      // holds as many long rows as short ones.
      const int64_t i = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t b = i % 2 == 0 ? i / 2 : num_seqs - 1 - i / 2;
      const int64_t len = seq_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      const C* keys = k_cache + kvh * head_dim;
      const C* values = v_cache + kvh * head_dim;
      slots.resize(len);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t first = table[start / block_size] * block_size;
        for (int64_t j = start; j < std::min(start + block_size, len); ++j) slots[j] = first + j - start;
      }
      scores.resize(group * len);
      for (int64_t i = 0; i < group * head_dim; ++i) q[i] = to_float(qkv[b * row + kvh * group * head_dim + i]);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q.data() + g * head_dim;
        float* sg = scores.data() + g * len;
        int64_t j = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
        // kLanes keys at a time (8 on AVX2, 16 on AVX-512): their sums reduced together into one
        // vector of scores (sum_lanes_each). On AVX-512, four keys at a time with a scalar sum of each
        // key's 16 lanes took about 23% of a 64-stream decode step of the bundled model (bfloat16
        // cache, int8 activations); with this and the values' shared loads below, 18% of a step that
        // took 0.9 of the time (perf, same machine).
        for (; vectors && j + kLanes <= len; j += kLanes) {
          Vec acc[kLanes];
          const C* key[kLanes];
          for (int i = 0; i < kLanes; ++i) {
            acc[i] = Vec{};
            key[i] = keys + slots[j + i] * kv_row;
          }
          for (int64_t d = 0; d < head_dim; d += kLanes) {
            const Vec qv = load_floats(qg + d);
            for (int i = 0; i < kLanes; ++i) acc[i] = fused_multiply_add(qv, load_floats(key[i] + d), acc[i]);
          }
          const Vec scaled = sum_lanes_each(acc) * scale;
          std::memcpy(sg + j, &scaled, sizeof(scaled));
        }
#endif
        for (; vectors && j + kKeys <= len; j += kKeys) {
          Vec acc[kKeys] = {};
          for (int64_t d = 0; d < head_dim; d += kLanes) {
            const Vec qv = load_floats(qg + d);
            for (int i = 0; i < kKeys; ++i) acc[i] += qv * load_floats(keys + slots[j + i] * kv_row + d);
          }
          for (int i = 0; i < kKeys; ++i) sg[j + i] = sum_lanes(acc[i]) * scale;
        }
        for (; j < len; ++j) {
          const C* key = keys + slots[j] * kv_row;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < head_dim; ++i) dot += qg[i] * to_float(key[i]);
          sg[j] = dot * scale;
        }
        const float inv = 1.f / exp_sum(sg, len);
        for (j = 0; j < len; ++j) sg[j] *= inv;
      }
      T* o = out + b * num_heads * head_dim + kvh * group * head_dim;
      // kHeadsPerPass query heads at a time share each value vector's load and widening (on AVX-512
      // their 4 x 4 accumulators fit its 32 registers; AVX2's 16 hold one head's 8).
      for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
        const int64_t heads = std::min<int64_t>(kHeadsPerPass, group - g0);
        int64_t d0 = 0;
        for (; d0 + kDimVecs * kLanes <= head_dim; d0 += kDimVecs * kLanes) {
          Vec acc[kHeadsPerPass][kDimVecs] = {};
          for (int64_t j = 0; j < len; ++j) {
            const C* value = values + slots[j] * kv_row + d0;
            Vec vv[kDimVecs];
            for (int v = 0; v < kDimVecs; ++v) vv[v] = load_floats(value + v * kLanes);
            for (int h = 0; h < kHeadsPerPass; ++h) {
              if (h < heads) {
                const float p = scores[(g0 + h) * len + j];
                for (int v = 0; v < kDimVecs; ++v) acc[h][v] += p * vv[v];
              }
            }
          }
          for (int64_t h = 0; h < heads; ++h) {
            float lanes[kDimVecs * kLanes];
            std::memcpy(lanes, acc[h], sizeof(lanes));
            for (int64_t i = 0; i < kDimVecs * kLanes; ++i) o[(g0 + h) * head_dim + d0 + i] = from_float<T>(lanes[i]);
          }
        }
        for (int64_t g = g0; g < g0 + heads && d0 < head_dim; ++g) {
          // the dimensions left over (head_dim not a multiple of kDimVecs vectors)
          const float* sg = scores.data() + g * len;
          std::vector<float> acc(head_dim - d0, 0.f);
          for (int64_t j = 0; j < len; ++j) {
            const C* value = values + slots[j] * kv_row + d0;
            for (int64_t i = 0; i < head_dim - d0; ++i) acc[i] += sg[j] * to_float(value[i]);
          }
          for (int64_t i = 0; i < head_dim - d0; ++i) o[g * head_dim + d0 + i] = from_float<T>(acc[i]);
        }
      }
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight bfloat16 values widened to float32 (exact), and float32 rounded to bfloat16 as c10::BFloat16
// rounds (to nearest even; NaN to 0x7FC0), kept in a float whose low 16 bits are zero.
inline __m256 load8_bf16(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 round8_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                                           _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                          _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
inline void store8_bf16(c10::BFloat16* p, __m256 rounded) {  // rounded: round8_bf16's output
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif

// out = T(silu(gate)) * up, rounded like F.silu(gate) * up. With AVX2, eight at a time through exp8
// (std::exp one at a time was 6% of a 512-token prefill in float32, and in bfloat16 6.5% of a
// 64-stream decode step, where it took 5.6 ms of 86).
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, float>) {
        for (; i + 8 <= inter; i += 8) {
          const __m256 x = _mm256_loadu_ps(g + i);
          const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(-x)));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
      } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (; i + 8 <= inter; i += 8) {
          const __m256 x = load8_bf16(g + i);
          const __m256 silu = round8_bf16(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(-x))));
          store8_bf16(o + i, round8_bf16(_mm256_mul_ps(silu, load8_bf16(u + i))));
        }
      }
#endif
      for (; i < inter; ++i) {
        float x = to_float(g[i]);
        float s = to_float(from_float<T>(x / (1.f + std::exp(-x))));
        o[i] = from_float<T>(s * to_float(u[i]));
      }
    }
  });
}

// Causal attention of fresh prompts (no earlier context): rows [starts[s], starts[s + 1]) of qkv are
// sequence s's tokens, its keys and values their own.
//
// With AVX2 (and head_dim a multiple of 16), as a blocked GEMM that skips the keys past the diagonal.
// Each task is 32 positions of one sequence times the query heads of one KV head, their rows ordered
// position-major, so a tile of 6 rows spans two positions. Keys transposed into panels of 16 (K^T,
// once per layer) give the tile's scores up to its last position; each row's softmax runs over its
// own keys (exp_sum) with the rest zeroed; the tile's outputs are then the probabilities times the
// values up to its last position, 16 dimensions at a time. Both products are panel_tile's, so the
// causal half of the work is about all that is done. Tasks run longest first, taken by whichever
// thread is free. For a 512-token prompt of the bundled model (9 heads, 3 KV heads, head_dim 64)
// this took 2.07-2.09 ms against 3.74-3.75 ms for the chunked SDPA below and 4.46-4.53 for one SDPA
// call (a standalone copy, timed in turn).
//
// Elsewhere PyTorch's flash kernel, in query chunks of kPrefillChunk, each over the keys up to its
// own last token (a mask for the diagonal block): it does not skip the keys past the diagonal.
#if defined(__AVX2__) && defined(__FMA__)
template <typename T>
void causal_attention_avx2(const T* qkv, T* out, const std::vector<int64_t>& starts, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, float scale) {
  constexpr int64_t kPositions = 32, kTileRows = 6, kPanel = 16;
  const int64_t group = num_heads / num_kv_heads, dim = head_dim, kv_dim = num_kv_heads * head_dim;
  const int64_t row_len = num_heads * head_dim + 2 * kv_dim, rows_per_task = group * kPositions;
  const int64_t num_seqs = static_cast<int64_t>(starts.size()) - 1;
  // Per sequence and KV head: keys as panels [position / 16][dim][16] (zero past the end), values
  // as [position][dim], in float32.
  std::vector<int64_t> panel_base(num_seqs + 1, 0), value_base(num_seqs + 1, 0);
  struct Task {
    int64_t seq, first, head, cost;
  };
  std::vector<Task> tasks;
  int64_t widest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = starts[s + 1] - starts[s], padded = (len + kPanel - 1) / kPanel * kPanel;
    panel_base[s + 1] = panel_base[s] + num_kv_heads * padded * dim;
    value_base[s + 1] = value_base[s] + num_kv_heads * len * dim;
    widest = std::max(widest, padded);
    for (int64_t first = 0; first < len; first += kPositions) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        tasks.push_back({s, first, h, std::min(kPositions, len - first) * (first + kPositions)});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::vector<float> keys(panel_base[num_seqs], 0.f), values(value_base[num_seqs]);
  at::parallel_for(0, starts.back(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = std::upper_bound(starts.begin(), starts.end(), t) - starts.begin() - 1;
      const int64_t pos = t - starts[s], len = starts[s + 1] - starts[s];
      const int64_t padded = (len + kPanel - 1) / kPanel * kPanel;
      const T* k = qkv + t * row_len + num_heads * head_dim;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        float* panel = keys.data() + panel_base[s] + (h * padded + pos / kPanel * kPanel) * dim + pos % kPanel;
        float* value = values.data() + value_base[s] + (h * len + pos) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          panel[d * kPanel] = to_float(k[h * dim + d]);
          value[d] = to_float(k[kv_dim + h * dim + d]);
        }
      }
    }
  });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> q(rows_per_task * dim), scores(rows_per_task * widest), o(rows_per_task * dim);
    std::vector<float> inverse_sum(rows_per_task);
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      const Task& task = tasks[i];
      const int64_t len = starts[task.seq + 1] - starts[task.seq], padded = (len + kPanel - 1) / kPanel * kPanel;
      const int64_t positions = std::min(kPositions, len - task.first), rows = positions * group;
      const T* first_row = qkv + (starts[task.seq] + task.first) * row_len;
      for (int64_t r = 0; r < rows; ++r) {  // row r: position r / group, query head task.head * group + r % group
        const T* src = first_row + r / group * row_len + (task.head * group + r % group) * dim;
        for (int64_t d = 0; d < dim; ++d) q[r * dim + d] = to_float(src[d]) * scale;
      }
      const float* k_panels = keys.data() + panel_base[task.seq] + task.head * padded * dim;
      const float* v_rows = values.data() + value_base[task.seq] + task.head * len * dim;
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
        const int64_t tile_rows = std::min(kTileRows, rows - r0);
        const int64_t last = task.first + (r0 + tile_rows - 1) / group;  // the tile's last position
        float* s = scores.data() + r0 * widest;
        for (int64_t p = 0; p <= last / kPanel; ++p) {
          panel_tile_rows(tile_rows, q.data() + r0 * dim, dim, k_panels + p * kPanel * dim, kPanel, dim,
                          s + p * kPanel, widest, kPanel);
        }
        for (int64_t r = r0; r < r0 + tile_rows; ++r) {
          const int64_t pos = task.first + r / group;
          float* row = scores.data() + r * widest;
          inverse_sum[r] = 1.f / exp_sum(row, pos + 1);
          std::fill(row + pos + 1, row + last + 1, 0.f);
        }
        for (int64_t c = 0; c < dim; c += kPanel) {
          panel_tile_rows(tile_rows, s, widest, v_rows + c, dim, last + 1, o.data() + r0 * dim + c, dim, kPanel);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = starts[task.seq] + task.first + r / group;
        T* dst = out + token * num_heads * dim + (task.head * group + r % group) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = from_float<T>(o[r * dim + d] * inverse_sum[r]);
      }
    }
  });
}
#endif

constexpr int64_t kPrefillChunk = 128;
template <typename T>
void prefill_attention(const at::Tensor& qkv, at::Tensor& out, const std::vector<int64_t>& starts, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, double scale) {
#if defined(__AVX2__) && defined(__FMA__)
  if (head_dim % 16 == 0 && num_heads % num_kv_heads == 0) {
    causal_attention_avx2<T>(qkv.data_ptr<T>(), out.data_ptr<T>(), starts, num_heads, num_kv_heads, head_dim,
                             static_cast<float>(scale));
    return;
  }
#endif
  const int64_t qd = num_heads * head_dim, kd = num_kv_heads * head_dim;
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    const int64_t begin = starts[s], len = starts[s + 1] - starts[s];
    const at::Tensor rows = qkv.narrow(0, begin, len);
    const at::Tensor k = rows.narrow(1, qd, kd).view({len, num_kv_heads, head_dim}).transpose(0, 1).unsqueeze(0);
    const at::Tensor v = rows.narrow(1, qd + kd, kd).view({len, num_kv_heads, head_dim}).transpose(0, 1).unsqueeze(0);
    for (int64_t c = 0; c < len; c += kPrefillChunk) {
      const int64_t end = std::min(c + kPrefillChunk, len);
      const at::Tensor q = rows.narrow(0, c, end - c).narrow(1, 0, qd).view({end - c, num_heads, head_dim});
      const at::Tensor mask = at::ones({end - c, end}, qkv.options().dtype(at::kBool)).tril(c);
      const at::Tensor o = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.narrow(2, 0, end),
                                                            v.narrow(2, 0, end), mask, 0.0, false, scale,
                                                            num_heads != num_kv_heads);  // [1, H, chunk, D]
      out.narrow(0, begin + c, end - c).view({end - c, num_heads, head_dim}).copy_(o[0].transpose(0, 1));
    }
  }
}

template <typename T, typename C>
at::Tensor forward_impl(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin_signed,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        const std::vector<at::Tensor>& norms, const std::vector<Linear>& linears,
                        const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
                        double scale, int64_t group_size, const Int4Policy& policy,
                        const std::vector<int64_t>& prefill_starts) {
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  const int64_t block_size = k_caches[0].size(1);
  at::Tensor residual = x.contiguous().clone();
  at::Tensor normed = at::empty_like(residual);
  at::Tensor attn = at::empty({tokens, num_heads * head_dim}, x.options());
  at::Tensor act = at::empty({tokens, intermediate}, x.options());
  at::Tensor delta;  // the previous sub-layer's output, added to the residual by the next norm
  for (int64_t l = 0; l < num_layers; ++l) {
    add_rms_norm<T>(residual.data_ptr<T>(), delta.defined() ? delta.data_ptr<T>() : nullptr,
                    norms[2 * l].data_ptr<T>(), normed.data_ptr<T>(), tokens, hidden, static_cast<float>(eps));
    at::Tensor qkv = linear(normed, linears[4 * l], group_size, policy).contiguous();
    rope_and_cache<T, C>(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin_signed.data_ptr<T>(),
                         slot_mapping.data_ptr<int64_t>(), k_caches[l].data_ptr<C>(), v_caches[l].data_ptr<C>(),
                         tokens, num_heads, num_kv_heads, head_dim);
    if (prefill_starts.empty()) {
      decode_attention<T, C>(qkv.data_ptr<T>(), k_caches[l].data_ptr<C>(), v_caches[l].data_ptr<C>(),
                             block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), attn.data_ptr<T>(),
                             tokens, block_tables.size(1), block_size, num_heads, num_kv_heads, head_dim,
                             static_cast<float>(scale));
    } else {
      prefill_attention<T>(qkv, attn, prefill_starts, num_heads, num_kv_heads, head_dim, scale);
    }
    delta = linear(attn, linears[4 * l + 1], group_size, policy).contiguous();
    add_rms_norm<T>(residual.data_ptr<T>(), delta.data_ptr<T>(), norms[2 * l + 1].data_ptr<T>(),
                    normed.data_ptr<T>(), tokens, hidden, static_cast<float>(eps));
    at::Tensor gate_up = linear(normed, linears[4 * l + 2], group_size, policy).contiguous();
    silu_mul<T>(gate_up.data_ptr<T>(), act.data_ptr<T>(), tokens, intermediate);
    delta = linear(act, linears[4 * l + 3], group_size, policy).contiguous();
  }
  add_rms_norm<T>(residual.data_ptr<T>(), delta.data_ptr<T>(), norms[2 * num_layers].data_ptr<T>(),
                  normed.data_ptr<T>(), tokens, hidden, static_cast<float>(eps));
  return normed;
}

}  // namespace

// One step through every layer and the final norm, for B tokens of any sequences (decode tokens,
// prompts, chunks): row b is a token at its position with its sequence's block table, attending to
// its first seq_lens[b] keys (its own included), whose K/V are written before attention reads them.
// x: [B, hidden] embeddings; cos, sin_signed: [B, head_dim]; slot_mapping, seq_lens: [B] int64;
// block_tables: [B, max_blocks] int64; norms: 2 per layer + the final one; linears: 4 per layer
// (qkv, o, gate_up, down) as (kind, weight, scales, bias) with undefined tensors where unused;
// k_caches, v_caches: one per layer, all float32, bfloat16 or float16 (the KV cache dtype, which may
// differ from the compute dtype: keys and values are rounded to it when written).
// With prefill_starts (S + 1 row offsets), the rows are instead the whole prompts of S fresh
// sequences (no earlier context; block_tables and seq_lens unused): a prefill step, whose
// attention is prefill_attention's.
at::Tensor decode_forward(at::Tensor x, at::Tensor cos, at::Tensor sin_signed, at::Tensor slot_mapping,
                          at::Tensor block_tables, at::Tensor seq_lens, std::vector<at::Tensor> norms,
                          std::vector<int64_t> kinds, std::vector<at::Tensor> weights,
                          std::vector<std::optional<at::Tensor>> scales, std::vector<std::optional<at::Tensor>> biases,
                          std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale,
                          int64_t group_size, int64_t int4_few_rows, int64_t int4_block_n,
                          bool int8_activations, std::vector<int64_t> prefill_starts) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [B, hidden] tensor");
  TORCH_CHECK(k_caches.size() * 4 == kinds.size() && norms.size() == 2 * k_caches.size() + 1, "bad layer lists");
  TORCH_CHECK(prefill_starts.empty() || (prefill_starts.front() == 0 && prefill_starts.back() == x.size(0)),
              "prefill_starts must run from 0 to the number of rows");
  std::vector<Linear> linears;
  for (size_t i = 0; i < kinds.size(); ++i) {
    linears.push_back({kinds[i], weights[i], scales[i].has_value() ? *scales[i] : at::Tensor(),
                       biases[i].has_value() ? *biases[i] : at::Tensor()});
  }
  c10::InferenceMode guard;
  const Int4Policy policy{int4_few_rows, int4_block_n, int8_activations};
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "decode_forward runs in float32 or bfloat16");
  const at::ScalarType cache = k_caches[0].scalar_type();
  for (size_t l = 0; l < k_caches.size(); ++l) {
    TORCH_CHECK(k_caches[l].scalar_type() == cache && v_caches[l].scalar_type() == cache &&
                    k_caches[l].is_contiguous() && v_caches[l].is_contiguous(),
                "the KV caches must be contiguous and of one dtype");
  }
  TORCH_CHECK(cache == at::kFloat || cache == at::kBFloat16 || cache == at::kHalf,
              "the KV cache is float32, bfloat16 or float16");
  auto run = [&](auto compute, auto stored) {  // the compute type and the cache's element type
    return forward_impl<decltype(compute), decltype(stored)>(
        x, cos, sin_signed, slot_mapping, block_tables, seq_lens, norms, linears, k_caches, v_caches, num_heads,
        num_kv_heads, head_dim, intermediate, eps, scale, group_size, policy, prefill_starts);
  };
  auto with_cache = [&](auto compute) {
    if (cache == at::kFloat) return run(compute, float{});
    if (cache == at::kBFloat16) return run(compute, c10::BFloat16{});
    return run(compute, c10::Half{});
  };
  return x.scalar_type() == at::kBFloat16 ? with_cache(c10::BFloat16{}) : with_cache(float{});
}

// ----- dequantization, for matmuls over many rows (prefill, large batches) ----------------------
// The weight-only kernels re-read the weights for every row; a bf16 GEMM reuses them. For many
// rows it is faster to dequantize a layer's weight into a temporary and call the GEMM.

template <typename S, typename T>
void dequantize_int4_impl(const uint8_t* packed, const S* scales_mins, T* out, int64_t n, int64_t k,
                          int64_t group_size, int64_t block_n) {
  // Layout of aten::_convert_weight_to_int4pack_for_cpu: blocks of block_n output rows (64 where
  // PyTorch's kernel runs AVX-512, 32 on AVX2); in a block, byte (k * block_n / 2 + i) holds row i
  // (low nibble) and row i + block_n / 2 (high nibble) at input k. The block size is found at run
  // time by checking against the op itself (kvserve/layers/quantized.py); no match disables this.
  // Writes the transposed weight [K, N], so every store and every byte load is contiguous.
  const int64_t half = block_n / 2;
  at::parallel_for(0, k / group_size, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(n), min(n);
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t j = 0; j < n; ++j) {
        scale[j] = to_float(scales_mins[2 * g * n + j]);
        min[j] = to_float(scales_mins[(2 * g + 1) * n + j]);
      }
      for (int64_t c = g * group_size; c < (g + 1) * group_size; ++c) {
        T* o = out + c * n;
        for (int64_t nb = 0; nb < n / block_n; ++nb) {
          const uint8_t* bytes = packed + nb * half * k + c * half;
          const float* sc = scale.data() + nb * block_n;
          const float* mn = min.data() + nb * block_n;
          T* ob = o + nb * block_n;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            ob[i] = weight_from_float<T>(static_cast<float>(bytes[i] & 0xF) * sc[i] + mn[i]);
            ob[i + half] = weight_from_float<T>(static_cast<float>(bytes[i] >> 4) * sc[i + half] + mn[i + half]);
          }
        }
      }
    }
  });
}

// Runs f(S*) with the data of an Int4Linear's scales_mins [K / g, 2, N], float16 or float32.
template <typename F>
void with_scales_mins(const at::Tensor& scales_mins, F&& f) {
  if (scales_mins.scalar_type() == at::kHalf) {
    f(scales_mins.data_ptr<c10::Half>());
  } else {
    TORCH_CHECK(scales_mins.scalar_type() == at::kFloat, "int4 scales and mins are float16 or float32");
    f(scales_mins.data_ptr<float>());
  }
}

// The transposed weight of an Int4Linear, [K, N], in `dtype` (float32 or bfloat16).
at::Tensor dequantize_int4(at::Tensor packed, at::Tensor scales_mins, int64_t n, int64_t k, int64_t group_size,
                           int64_t block_n, at::ScalarType dtype) {
  TORCH_CHECK(n % block_n == 0 && k % group_size == 0, "dequantize_int4 takes whole blocks of rows");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize_int4 makes float32 or bfloat16");
  at::Tensor out = at::empty({k, n}, packed.options().dtype(dtype));
  with_scales_mins(scales_mins, [&](auto* sm) {
    if (dtype == at::kBFloat16) {
      dequantize_int4_impl(packed.data_ptr<uint8_t>(), sm, out.data_ptr<c10::BFloat16>(), n, k, group_size, block_n);
    } else {
      dequantize_int4_impl(packed.data_ptr<uint8_t>(), sm, out.data_ptr<float>(), n, k, group_size, block_n);
    }
  });
  return out;
}

// ----- int8 with a scale per group of 32 (GGML's Q8_0 layout): the tied lm_head -------------------
// out[m, v] = sum_k x[m, k] * codes[v, k] * scales[v, k / 32], float32 out.
constexpr int64_t kAmxMinRows = 4;  // where the AMX tiles (below) overtake the float kernel

// One row of k codes times its scales (one per 32 codes), as T.
template <typename T>
inline void dequantize_int8_row(const int8_t* codes, const float* scales, int64_t k, T* out) {
  for (int64_t g = 0; g < k / 32; ++g) {
    const float scale = scales[g];
#pragma omp simd
    for (int64_t j = 0; j < 32; ++j) out[g * 32 + j] = weight_from_float<T>(scale * codes[g * 32 + j]);
  }
}

// The same product with one arithmetic for every row whatever the number of rows (batch
// invariance): out[r, c] is one chain of multiply-adds over k, kLanes inputs at a time in order
// (each code widened and scaled in registers, w = scale * code), its lanes then summed by
// reduce_lanes_each's tree. A tile is R rows x 4 code rows, its accumulators reduced together, and
// each code vector widened once per tile of rows.
constexpr int kLmRows = kLanes / 4;  // rows per tile: 4 on AVX-512, 2 on AVX2

// Code row `row`'s scales (one per 32 codes), or nullptr for float weights, which have none.
inline const float* scales_of_row(const float* scales, int64_t row, int64_t groups) {
  return scales == nullptr ? nullptr : scales + row * groups;
}

// kLanes weights of a code row from input i: scale * code, the one rounding every path shares;
// float32 or bfloat16 weights (a float lm_head, no scales) as they are.
template <typename W>
inline Vec widened_codes(const W* code_row, const float* scale_row, int64_t i) {
  if constexpr (std::is_same_v<W, int8_t>) {
    return splat(scale_row[i / 32]) * __builtin_convertvector(widen_bytes(code_row + i), Vec);
  } else {
    return load_floats(code_row + i);
  }
}

// R rows of x times C = 4 code rows, widened here, or read from `panel` ([C, k] floats
// widened_codes wrote, where many tiles of rows share the code rows). The loops over rows and code
// rows are unrolled so that the accumulators stay in registers (and the 2 C row pointers in
// general registers).
constexpr int kLmCols = 4;
template <int R, bool kFromPanel, typename W>
inline void int8_group_tile(const float* x, int64_t k, const W* codes, const float* scales, const float* panel,
                            float* out, int64_t ldo, int64_t cols) {
  constexpr int C = kLmCols;
  const int64_t groups = k / 32;
  const W* code_rows[C];
  const float* scale_rows[C];
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {  // past the last code row: the last one again, not written out
    code_rows[c] = codes + std::min<int64_t>(c, cols - 1) * k;
    scale_rows[c] = scales_of_row(scales, std::min<int64_t>(c, cols - 1), groups);
  }
  Vec acc[kLanes];  // R * C used; the rest stay zero for the reduction
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) acc[i] = Vec{};
  for (int64_t i = 0; i < k; i += kLanes) {
    Vec xv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      xv[r] = load_floats(x + r * k + i);
    }
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      Vec w;
      if constexpr (kFromPanel) {
        w = load_floats(panel + c * k + i);
#if defined(__x86_64__) && (defined(__AVX512F__) || defined(__AVX__))
        asm("" : "+v"(w));  // one load into a register: GCC would otherwise load it again for every row
#endif
      } else {
        w = widened_codes(code_rows[c], scale_rows[c], i);
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r * C + c] = fused_multiply_add(xv[r], w, acc[r * C + c]);
    }
  }
  float sums[kLanes];
  reduce_lanes_each(acc, sums);
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo, sums + r * C, cols * sizeof(float));
}

// Rows [0, m) of x times code rows [0, cols) in tiles of R rows (fewer for the last rows) x
// kLmCols code rows; the code rows outermost, widened once into `panel` where several tiles of
// rows read them.
template <int R, typename W>
inline void int8_group_rows(int64_t m, const float* x, int64_t k, const W* codes, const float* scales,
                            float* out, int64_t ldo, int64_t cols, std::vector<float>& panel) {
  const int64_t groups = k / 32, whole = m / R * R;
  constexpr int C = kLmCols;
  for (int64_t c = 0; whole > 0 && c < cols; c += C) {
    const int64_t tile_cols = std::min<int64_t>(C, cols - c);
    const float* shared = nullptr;
    if (whole > R) {
      panel.resize(C * k);
      for (int64_t j = 0; j < C; ++j) {
        const int64_t row = c + std::min<int64_t>(j, tile_cols - 1);
        for (int64_t i = 0; i < k; i += kLanes) {
          const Vec w = widened_codes(codes + row * k, scales_of_row(scales, row, groups), i);
          std::memcpy(panel.data() + j * k + i, &w, sizeof(w));
        }
      }
      shared = panel.data();
    }
    const float* tile_scales = scales_of_row(scales, c, groups);
    for (int64_t r = 0; r < whole; r += R) {
      if (shared != nullptr) {
        int8_group_tile<R, true>(x + r * k, k, codes + c * k, tile_scales, shared, out + r * ldo + c, ldo, tile_cols);
      } else {
        int8_group_tile<R, false>(x + r * k, k, codes + c * k, tile_scales, shared, out + r * ldo + c, ldo, tile_cols);
      }
    }
  }
  if constexpr (R > 1) {
    if (whole < m) {
      int8_group_rows<R / 2>(m - whole, x + whole * k, k, codes, scales, out + whole * ldo, ldo, cols, panel);
    }
  }
}

// scales: one per 32 codes for int8 codes, nullptr for float32 / bfloat16 weights.
template <typename W>
void int8_group_matmul_rows(const float* xf, const W* codes, const float* scales, float* out, int64_t m, int64_t k,
                            int64_t v) {
  const int64_t groups = k / 32;
  constexpr int64_t kVocabBlock = 4 * kLanes;  // code rows per task: 36 KB of codes for 576 inputs on AVX-512
  at::parallel_for(0, (v + kVocabBlock - 1) / kVocabBlock, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t c = b * kVocabBlock;
      int8_group_rows<kLmRows>(m, xf, k, codes + c * k, scales_of_row(scales, c, groups), out + c, v,
                               std::min(kVocabBlock, v - c), panel);
    }
  });
}

template <typename T>
void int8_group_matmul_impl(const T* x, const int8_t* codes, const float* scales, float* out, int64_t m, int64_t k,
                            int64_t v) {
  std::vector<float> xf(m * k);
  for (int64_t i = 0; i < m * k; ++i) xf[i] = to_float(x[i]);
  int8_group_matmul_rows(xf.data(), codes, scales, out, m, k, v);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
// ----- the lm_head on AMX (bfloat16 inputs) -------------------------------------------------------
// Where the CPU has AMX and x is bfloat16, a tile multiply (TDPBF16PS: a 16 x 32 by 32 x 16 bfloat16
// product summed in float32, per instruction) computes each group of 32 inputs for 16 vocabulary
// rows and 16 rows of x. The int8 codes are exact in bfloat16 (8-bit significands), so are x's
// bfloat16 values, and their products are exact in float32: the group's sum is float32 as in
// int8_group_dot, only summed in another order. Each group's sums are then scaled by the code rows'
// scales into float32 totals, as the float kernels do. Per block of 16 vocabulary rows the codes are
// widened to bfloat16 once (16 rows x 32 inputs per tile, row-major as stored: tile A); x is laid
// out once per call as the pairs of inputs that tile B wants ([block of 16 rows][group][input
// pair][row of the block]).
// The tiles' results are 16 vocabulary rows x 16 rows of x, transposed into out when written.

bool amx_usable() {
  static const bool usable = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // Linux: ask for the tile state
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 and 3 (C: 16 x 16 float32, alternating by group), 1 (A: 16 x 32 bfloat16) and 2 (B: 16
// input pairs x 16 x 2 bfloat16).
inline void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 4; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// total[r] += scale(r) * c[r] for 16 rows of 16 floats.
inline void scale_rows(__m512* total, const float* c, const float* scales, int64_t stride, int64_t rows) {
  for (int r = 0; r < 16; ++r) {
    const __m512 scale = _mm512_set1_ps(r < rows ? scales[r * stride] : 0.f);
    total[r] = _mm512_fmadd_ps(scale, _mm512_load_ps(c + r * 16), total[r]);
  }
}

// Group g of a block: its multiply into C tile 0 or 3 (by g's parity), then the previous group's
// products stored from the other C tile, then those of the group before it scaled into total. A tile
// store waits for its multiply to finish and a load of stored products waits for the store (tens of
// cycles each), so each waits on work issued an iteration earlier.
// (GCC's tile intrinsics paste the tile number into the instruction: literals only, hence a macro.)
#define KVSERVE_AMX_GROUP_STEP(TILE, OTHER)                                                  \
  inline void amx_group_step_##TILE(int64_t g, const __m512i* a, const uint32_t* xb, float(*c)[256], \
                                    __m512* total, const float* scales, int64_t groups, int64_t rows) { \
    _tile_zero(TILE);                                                                        \
    _tile_loadd(1, a + g * 16, 64);                                                          \
    _tile_loadd(2, xb + g * 256, 64);                                                        \
    _tile_dpbf16ps(TILE, 1, 2);                                                              \
    if (g >= 1) _tile_stored(OTHER, c[(g - 1) & 1], 64);                                     \
    if (g >= 2) scale_rows(total, c[g & 1], scales + g - 2, groups, rows);                   \
  }
KVSERVE_AMX_GROUP_STEP(0, 3)
KVSERVE_AMX_GROUP_STEP(3, 0)
#undef KVSERVE_AMX_GROUP_STEP

void int8_group_matmul_amx(const c10::BFloat16* x, const int8_t* codes, const float* scales, float* out, int64_t m,
                           int64_t k, int64_t v) {
  const int64_t groups = k / 32, row_blocks = (m + 15) / 16;
  // xb[((b * groups + g) * 16 + p) * 16 + i]: inputs 2p, 2p + 1 of group g of x's row 16 b + i (zero past m)
  std::vector<uint32_t> xb(row_blocks * groups * 256, 0);
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < k / 2; ++j) xb[((r / 16 * groups + j / 16) * 16 + j % 16) * 16 + r % 16] = pairs[r * k / 2 + j];
  }
  at::parallel_for(0, (v + 15) / 16, 8, [&](int64_t begin, int64_t end) {
    load_tile_config();
    std::vector<__m512i> a(groups * 16);  // [group][16 code rows] of 32 bfloat16
    alignas(64) float c[2][256];          // two groups' products, see amx_group_step
    for (int64_t block = begin; block < end; ++block) {
      const int64_t v0 = block * 16, rows = std::min<int64_t>(16, v - v0);
      for (int64_t r = 0; r < 16; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
          if (r >= rows) {
            a[g * 16 + r] = _mm512_setzero_si512();
            continue;
          }
          const int8_t* src = codes + (v0 + r) * k + g * 32;
          const __m512 low =
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
          const __m512 high =
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
          a[g * 16 + r] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
        }
      }
      const float* block_scales = scales + v0 * groups;
      for (int64_t b = 0; b < row_blocks; ++b) {
        __m512 total[16];
        for (int r = 0; r < 16; ++r) total[r] = _mm512_setzero_ps();
        const uint32_t* xblock = xb.data() + b * groups * 256;
        for (int64_t g = 0; g < groups; ++g) {
          if (g & 1) {
            amx_group_step_3(g, a.data(), xblock, c, total, block_scales, groups, rows);
          } else {
            amx_group_step_0(g, a.data(), xblock, c, total, block_scales, groups, rows);
          }
        }
        // the last group's products, then the last two groups' scaling
        if (groups & 1) {
          _tile_stored(0, c[(groups - 1) & 1], 64);
        } else {
          _tile_stored(3, c[(groups - 1) & 1], 64);
        }
        if (groups >= 2) scale_rows(total, c[groups & 1], block_scales + groups - 2, groups, rows);
        scale_rows(total, c[(groups - 1) & 1], block_scales + groups - 1, groups, rows);
        alignas(64) float t[256];  // [vocabulary row][16 rows of x]
        for (int r = 0; r < 16; ++r) _mm512_store_ps(t + r * 16, total[r]);
        const int64_t xrows = std::min<int64_t>(16, m - b * 16);
        const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(16), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                                           10, 11, 12, 13, 14, 15));
        for (int64_t i = 0; i < xrows; ++i) {
          float* o = out + (b * 16 + i) * v + v0;
          if (rows == 16) {
            _mm512_storeu_ps(o, _mm512_i32gather_ps(column, t + i, 4));  // t[r * 16 + i] for r < 16
          } else {
            for (int64_t r = 0; r < rows; ++r) o[r] = t[r * 16 + i];
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

// With AMX, bfloat16 inputs from amx_min_rows rows go through the tiles: 1 for batch invariance
// (a row's sums then never depend on how many rows came with it), kAmxMinRows where the float
// kernel is faster for fewer rows.
at::Tensor int8_group_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t amx_min_rows) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1) && codes.size(1) % 32 == 0,
              "int8_group_matmul: x [M, K], codes [V, K] with K a multiple of 32");
  x = x.contiguous();
  at::Tensor out = at::empty({x.size(0), codes.size(0)}, x.options().dtype(at::kFloat));
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16 && x.size(0) >= std::max<int64_t>(1, amx_min_rows) && amx_usable()) {
    int8_group_matmul_amx(x.data_ptr<c10::BFloat16>(), codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                          out.data_ptr<float>(), x.size(0), x.size(1), codes.size(0));
    return out;
  }
#endif
  if (x.scalar_type() == at::kBFloat16) {
    int8_group_matmul_impl<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), codes.data_ptr<int8_t>(),
                                          scales.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1),
                                          codes.size(0));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "int8_group_matmul runs in float32 or bfloat16");
    int8_group_matmul_impl<float>(x.data_ptr<float>(), codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                  out.data_ptr<float>(), x.size(0), x.size(1), codes.size(0));
  }
  return out;
}

// x @ weight.T in float32 for a float32 or bfloat16 weight [V, K] (a float lm_head): the logits in
// float32 whatever the compute dtype, with int8_group_matmul's arithmetic for every row.
at::Tensor float32_matmul(at::Tensor x, at::Tensor weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) && weight.size(1) % 32 == 0,
              "float32_matmul: x [M, K], weight [V, K] with K a multiple of 32");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  weight = weight.contiguous();
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options().dtype(at::kFloat));
  if (weight.scalar_type() == at::kBFloat16) {
    int8_group_matmul_rows(xf.data_ptr<float>(), weight.data_ptr<c10::BFloat16>(), nullptr, out.data_ptr<float>(),
                           x.size(0), x.size(1), weight.size(0));
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kFloat, "float32_matmul takes float32 or bfloat16 weights");
    int8_group_matmul_rows(xf.data_ptr<float>(), weight.data_ptr<float>(), nullptr, out.data_ptr<float>(), x.size(0),
                           x.size(1), weight.size(0));
  }
  return out;
}

// rows [begin, end) of codes * scales (a scale per 32 values), as [end - begin, K] in `dtype`.
at::Tensor dequantize_int8_groups(at::Tensor codes, at::Tensor scales, int64_t begin, int64_t end,
                                  at::ScalarType dtype) {
  const int64_t k = codes.size(1), groups = k / 32;
  at::Tensor out = at::empty({end - begin, k}, codes.options().dtype(dtype));
  const int8_t* c = codes.data_ptr<int8_t>() + begin * k;
  const float* s = scales.data_ptr<float>() + begin * groups;
  auto run = [&](auto* o) {
    at::parallel_for(0, end - begin, 64, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) dequantize_int8_row(c + r * k, s + r * groups, k, o + r * k);
    });
  };
  if (dtype == at::kBFloat16) {
    run(out.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(dtype == at::kFloat, "dequantize_int8_groups makes float32 or bfloat16");
    run(out.data_ptr<float>());
  }
  return out;
}

// ----- int4 matmul for a few rows (decode) ---------------------------------------------------
// PyTorch's int4 CPU kernel is fast where it runs AVX-512 but slow on AVX2 (about 2 ms for one
// row of a 3072 x 576 weight here), and it unpacks the weight again for every row. This kernel
// unpacks each 4-bit code once per call and multiplies it into every row of x from registers.
// It uses w = code * scale + min per group, so a group's sum is scale * sum_k x[k] code[k] +
// min * sum_k x[k]: the inner loop converts codes to float and multiply-adds, nothing more.
// GCC/Clang vector extensions keep it portable.

// One input's codes in a block of NV * kLanes output columns, as NV float vectors: byte i holds
// column i in its low nibble and column i + NV * kLanes / 2 in its high nibble.
template <int NV>
inline void unpack_codes(const uint8_t* bytes, Vec* codes) {
  for (int v = 0; v < NV / 2; ++v) {
    const IVec wide = widen_bytes(bytes + v * kLanes);
    codes[v] = __builtin_convertvector(wide & 0xF, Vec);
    codes[v + NV / 2] = __builtin_convertvector(wide >> 4, Vec);
  }
}

// Group g's scale and min ([K / g, 2, N]) for the NV vectors of columns from n0.
template <int NV, typename S>
inline void group_scale_min(const S* scales_mins, int64_t g, int64_t n, int64_t n0, Vec* scale, Vec* min) {
  for (int v = 0; v < NV; ++v) {
    scale[v] = load_floats(scales_mins + 2 * g * n + n0 + v * kLanes);
    min[v] = load_floats(scales_mins + (2 * g + 1) * n + n0 + v * kLanes);
  }
}

// A group's contribution to a row's totals: total + (scale * sum(x * codes) + sum(x) * min). Every
// int4 kernel below ends a group through this, and sums x * codes in two chains (even and odd
// inputs, added at the end), so that a row's result is the same bits whatever rows are beside it.
inline Vec int4_group_total(Vec total, Vec scale, Vec even, Vec odd, float xsum, Vec min) {
  return total + fused_multiply_add(scale, even + odd, splat(xsum) * min);
}

// Rows [0, R) of x times one block of block_n = NV * kLanes output columns; x float [R, ldx],
// xsum [R, ldxs] (the sums of x over each group); out [R, ldo] at the block's first column.
// The two chains per row also keep one row's consecutive multiply-adds from waiting on each other.
template <int NV, int R, typename S, typename O>
inline void int4_block(const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* block,
                       const S* scales_mins, int64_t n, int64_t n0, int64_t k_len, int64_t group_size,
                       O* out, int64_t ldo) {
  constexpr int64_t half = NV * kLanes / 2;  // bytes per input: row i low nibble, row i + half high
  Vec total[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) total[r][v] = Vec{};
  }
  for (int64_t g = 0; g < k_len / group_size; ++g) {
    Vec acc[2][R][NV];
    for (int s = 0; s < 2; ++s) {
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < NV; ++v) acc[s][r][v] = Vec{};
      }
    }
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 2) {
      for (int s = 0; s < 2; ++s) {
        Vec codes[NV];
        unpack_codes<NV>(block + (k + s) * half, codes);
        for (int r = 0; r < R; ++r) {
          const Vec a = splat(x[r * ldx + k + s]);
          for (int v = 0; v < NV; ++v) acc[s][r][v] = fused_multiply_add(a, codes[v], acc[s][r][v]);
        }
      }
    }
    Vec scale[NV], min[NV];
    group_scale_min<NV>(scales_mins, g, n, n0, scale, min);
    for (int r = 0; r < R; ++r) {
      const float xs = xsum[r * ldxs + g];
      for (int v = 0; v < NV; ++v) total[r][v] = int4_group_total(total[r][v], scale[v], acc[0][r][v], acc[1][r][v], xs, min[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float lanes[NV * kLanes];
    std::memcpy(lanes, total[r], sizeof(lanes));
    for (int64_t j = 0; j < NV * kLanes; ++j) out[r * ldo + j] = from_float<O>(lanes[j]);
  }
}

// One group of R rows times NT of a block's NV vectors of columns: codes float [group_size, NV
// vectors] (unpacked once for every tile of rows), from the tile's first vector, as are scale, min
// and total [R, NV vectors]; the same arithmetic as int4_block's.
template <int NV, int NT, int R>
inline void int4_group_tile(const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const Vec* codes,
                            int64_t group_size, const Vec* scale, const Vec* min, Vec* total) {
  Vec acc[2][R][NT];
  for (int s = 0; s < 2; ++s) {
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < NT; ++v) acc[s][r][v] = Vec{};
    }
  }
  for (int64_t k = 0; k < group_size; k += 2) {
    for (int s = 0; s < 2; ++s) {
      Vec b[NT];
      for (int v = 0; v < NT; ++v) b[v] = codes[(k + s) * NV + v];
      for (int r = 0; r < R; ++r) {
        const Vec a = splat(x[r * ldx + k + s]);
        for (int v = 0; v < NT; ++v) acc[s][r][v] = fused_multiply_add(a, b[v], acc[s][r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float xs = xsum[r * ldxs];
    for (int v = 0; v < NT; ++v) {
      total[r * NV + v] = int4_group_total(total[r * NV + v], scale[v], acc[0][r][v], acc[1][r][v], xs, min[v]);
    }
  }
}

// int4_block for more rows than one register tile holds: each group's codes are unpacked once into
// a small buffer (4 KB on AVX2) and every tile of rows multiplies them from there. A tile is R rows
// x 2 vectors of columns in two chains: 6 rows on AVX-512 (24 accumulators of its 32 registers), 3
// on AVX2 (12 of 16), so each code vector is loaded once per tile of rows.
template <int NV, typename S, typename O>
void int4_block_many(const float* x, int64_t m, const float* xsum, const uint8_t* block, const S* scales_mins,
                     int64_t n, int64_t n0, int64_t k_len, int64_t group_size, O* out, std::vector<Vec>& codes,
                     std::vector<Vec>& total) {
  constexpr int64_t half = NV * kLanes / 2;
  constexpr int kTileVecs = NV < 2 ? NV : 2, kTileRows = kLanes == 16 ? 6 : 3;
  const int64_t groups = k_len / group_size;
  codes.resize(group_size * NV);
  total.assign(m * NV, Vec{});
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t k = 0; k < group_size; ++k) unpack_codes<NV>(block + (g * group_size + k) * half, &codes[k * NV]);
    Vec scale[NV], min[NV];
    group_scale_min<NV>(scales_mins, g, n, n0, scale, min);
    for (int64_t r = 0; r < m; r += kTileRows) {
      const float* xr = x + r * k_len + g * group_size;
      const float* xs = xsum + r * groups + g;
      for (int v = 0; v < NV; v += kTileVecs) {
        const Vec* c = codes.data() + v;
        Vec* t = total.data() + r * NV + v;
        switch (std::min<int64_t>(kTileRows, m - r)) {
#define KVSERVE_ROWS(R)                                                                                  \
  case R:                                                                                                \
    int4_group_tile<NV, kTileVecs, R>(xr, k_len, xs, groups, c, group_size, scale + v, min + v, t); \
    break;
          KVSERVE_ROWS(1) KVSERVE_ROWS(2) KVSERVE_ROWS(3) KVSERVE_ROWS(4) KVSERVE_ROWS(5) KVSERVE_ROWS(6)
#undef KVSERVE_ROWS
          default:
            TORCH_CHECK(false, "int4_mm: bad row tile");
        }
      }
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    float lanes[NV * kLanes];
    std::memcpy(lanes, total.data() + r * NV, sizeof(lanes));
    for (int64_t j = 0; j < NV * kLanes; ++j) out[r * n + n0 + j] = from_float<O>(lanes[j]);
  }
}

template <int NV, typename S, typename O>
void int4_mm_impl(const float* x, const float* xsum, int64_t m, int64_t k_len, const uint8_t* packed,
                  const S* scales_mins, int64_t n, int64_t group_size, O* out) {
  constexpr int64_t block_n = NV * kLanes;
  // rows per register tile: about 24 accumulators (two chains) on AVX-512, 12 on AVX2
  constexpr int kRows = std::max(1, (kLanes == 16 ? 12 : 6) / NV);
  const int64_t groups = k_len / group_size;
  at::parallel_for(0, n / block_n, 1, [&](int64_t begin, int64_t end) {
    std::vector<Vec> codes, total;
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = packed + b * (block_n / 2) * k_len;
      if (m > kRows) {
        int4_block_many<NV>(x, m, xsum, block, scales_mins, n, b * block_n, k_len, group_size, out, codes, total);
        continue;
      }
      O* o = out + b * block_n;
      switch (m) {
#define KVSERVE_ROWS(R)                                                                                              \
  case R:                                                                                                            \
    int4_block<NV, R>(x, k_len, xsum, groups, block, scales_mins, n, b * block_n, k_len, group_size, o, n); \
    break;
        KVSERVE_ROWS(1) KVSERVE_ROWS(2) KVSERVE_ROWS(3) KVSERVE_ROWS(4) KVSERVE_ROWS(5) KVSERVE_ROWS(6)
#undef KVSERVE_ROWS
        default:
          TORCH_CHECK(false, "int4_mm: bad row tile");
      }
    }
  });
}

// ----- int4 weights times int8 activations (AVX2) -----------------------------------------------
// The float kernels above spend an FMA per weight per row: near the CPU's float peak for many rows
// and bound on unpacking the codes for one. Here, as llama.cpp does, each row's inputs are
// quantized per group of 32 to int8 (x ~ d * q, d = max|x| / 127, q rounded to nearest even), and
// AVX2's byte multiply-add (vpmaddubsw: 32 code x input products, summed in pairs, per instruction)
// computes each group's sum over code * q exactly in integers. Per group and column:
//   out += (scale * d) * sum_k(code * q) + min * sum_k(x)
// with sum_k(x) the float sum of the group's inputs, so only the products with the codes carry the
// inputs' rounding. The integer sums are exact and the float steps per row are the same for one
// row and for many, so a row's result does not depend on the rows batched with it.
constexpr int64_t kQ8Group = 32;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr bool kInt8Activations = true;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One group of 32 inputs: q (int8), d (the scale) and s (the float sum).
inline void quantize_group(const float* x, int8_t* q, float* d, float* s) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
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
  *s = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
}

// Two consecutive inputs' code bytes for 16 columns of a block, side by side per column (lane 0:
// columns c*16 .. +7, lane 1: +8 .. +15), still two nibbles per byte (see unpack_codes).
inline __m256i code_pairs(const uint8_t* row, int64_t half, int64_t c) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + half + c * 16));
  return _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
}

inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }

// out += (scale * d) * float(isum) + s * min, the per-group float step (the same for every kernel).
inline __m256 group_step(__m256 total, __m256i isum, __m256 scale, __m256 min, float d, float s) {
  total = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(d)), _mm256_cvtepi32_ps(isum), total);
  return _mm256_fmadd_ps(_mm256_set1_ps(s), min, total);
}

// One row times one block of NV * 8 columns (NV / 4 chunks of 16 code bytes per input). A pair of
// inputs gives 16 products per column-lane of int16; 8 pairs stay below int16's range
// (8 * 2 * 15 * 127 = 30480), then they are widened into int32 sums.
template <int NV, typename S, typename O>
inline void q8_block_one(const int8_t* xq, const float* xd, const float* xs, const uint8_t* block,
                         const S* scales_mins, int64_t n, int64_t n0, int64_t k_len, O* out) {
  constexpr int64_t half = NV * 4, chunks = NV / 4;
  __m256 total[NV];
  for (int v = 0; v < NV; ++v) total[v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < k_len / kQ8Group; ++g) {
    __m256i isum[NV];
    for (int v = 0; v < NV; ++v) isum[v] = _mm256_setzero_si256();
    for (int64_t k0 = g * kQ8Group; k0 < (g + 1) * kQ8Group; k0 += 16) {
      __m256i acc[2 * chunks];  // [low chunks..., high chunks...]
      for (int a = 0; a < 2 * chunks; ++a) acc[a] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k0 + 16; k += 2) {
        int16_t pair;
        std::memcpy(&pair, xq + k, 2);
        const __m256i xb = _mm256_set1_epi16(pair);
        for (int64_t c = 0; c < chunks; ++c) {
          const __m256i p = code_pairs(block + k * half, half, c);
          acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(low_nibbles(p), xb));
          acc[chunks + c] = _mm256_add_epi16(acc[chunks + c], _mm256_maddubs_epi16(high_nibbles(p), xb));
        }
      }
      for (int a = 0; a < 2 * chunks; ++a) {  // acc a holds the columns of vectors 2a and 2a + 1
        isum[2 * a] = _mm256_add_epi32(isum[2 * a], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[a])));
        isum[2 * a + 1] = _mm256_add_epi32(isum[2 * a + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[a], 1)));
      }
    }
    for (int v = 0; v < NV; ++v) {
      const __m256 scale = load8(scales_mins + 2 * g * n + n0 + 8 * v);
      const __m256 min = load8(scales_mins + (2 * g + 1) * n + n0 + 8 * v);
      total[v] = group_step(total[v], isum[v], scale, min, xd[g], xs[g]);
    }
  }
  float lanes[NV * 8];
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(lanes + 8 * v, total[v]);
  for (int64_t j = 0; j < NV * 8; ++j) out[n0 + j] = from_float<O>(lanes[j]);
}

// q8_tile (below) for its main tile, 5 rows x 2 vectors, written out in assembly. GCC (12, -O3)
// keeps 4 of the 10 int16 accumulators on the stack and copies the others between registers every
// step (20 extra instructions per 10 vpmaddubsw), though they, the 2 code vectors, the broadcast
// input and 2 products fit AVX2's 16 registers. Here the accumulators stay in ymm0-9: per quad of inputs, 2
// code loads, 5 broadcasts, 10 vpmaddubsw and 10 vpaddw; then the group's float step (group_step's
// arithmetic in the same order, so the results are the same bit for bit). For the bundled model's
// four projections of a layer, against the intrinsics alternating in one process: 0.83-0.86 /
// 0.83-0.90 / 0.78-0.87 of the time at 16 / 64 / 512 rows.
#define KVSERVE_Q8_ROW(XADDR, A0, A1)                                                        \
  "vpbroadcastd " XADDR ", %%ymm12\n\t"                                                      \
  "vpmaddubsw %%ymm12, %%ymm10, %%ymm13\n\t"                                                 \
  "vpaddw %%ymm13, %%ymm" #A0 ", %%ymm" #A0 "\n\t"                                           \
  "vpmaddubsw %%ymm12, %%ymm11, %%ymm14\n\t"                                                 \
  "vpaddw %%ymm14, %%ymm" #A1 ", %%ymm" #A1 "\n\t"
#define KVSERVE_Q8_QUAD(Q)                                                                   \
  "vmovdqa " #Q "*%c[stride](%[c]), %%ymm10\n\t"                                             \
  "vmovdqa " #Q "*%c[stride]+32(%[c]), %%ymm11\n\t"                                          \
  KVSERVE_Q8_ROW(#Q "*4(%[x])", 0, 1)                                                        \
  KVSERVE_Q8_ROW(#Q "*4(%[x],%[ld],1)", 2, 3)                                                \
  KVSERVE_Q8_ROW(#Q "*4(%[x],%[ld],2)", 4, 5)                                                \
  KVSERVE_Q8_ROW(#Q "*4(%[x3])", 6, 7)                                                       \
  KVSERVE_Q8_ROW(#Q "*4(%[x],%[ld],4)", 8, 9)
// Row r's float step: its d and s broadcast, scale * d for both vectors, then per vector
// total = (scale * d) * float(isum) + total; total = s * min + total.
#define KVSERVE_Q8_STEP(DADDR, SADDR, A0, A1, T0)                                            \
  "vbroadcastss " DADDR ", %%ymm12\n\t"                                                      \
  "vbroadcastss " SADDR ", %%ymm13\n\t"                                                      \
  "vmulps (%[scale]), %%ymm12, %%ymm10\n\t"                                                  \
  "vmulps 32(%[scale]), %%ymm12, %%ymm11\n\t"                                                \
  "vpmaddwd %%ymm15, %%ymm" #A0 ", %%ymm" #A0 "\n\t"                                         \
  "vpmaddwd %%ymm15, %%ymm" #A1 ", %%ymm" #A1 "\n\t"                                         \
  "vcvtdq2ps %%ymm" #A0 ", %%ymm" #A0 "\n\t"                                                 \
  "vcvtdq2ps %%ymm" #A1 ", %%ymm" #A1 "\n\t"                                                 \
  "vfmadd213ps " #T0 "(%[total]), %%ymm10, %%ymm" #A0 "\n\t"                                 \
  "vfmadd213ps " #T0 "+32(%[total]), %%ymm11, %%ymm" #A1 "\n\t"                              \
  "vfmadd231ps (%[min]), %%ymm13, %%ymm" #A0 "\n\t"                                          \
  "vfmadd231ps 32(%[min]), %%ymm13, %%ymm" #A1 "\n\t"                                        \
  "vmovups %%ymm" #A0 ", " #T0 "(%[total])\n\t"                                              \
  "vmovups %%ymm" #A1 ", " #T0 "+32(%[total])\n\t"
template <int Stride>
inline void q8_tile_5x2(const int8_t* xq, int64_t k_len, const float* xd, const float* xs, int64_t groups,
                        const __m256i* codes, const __m256* scale, const __m256* min, __m256* total) {
  static_assert(kQ8Group == 32, "8 quads per group");
  const int64_t row_bytes = groups * static_cast<int64_t>(sizeof(float));
  __asm__ volatile(
      "vpxor %%xmm0, %%xmm0, %%xmm0\n\t"
      "vpxor %%xmm1, %%xmm1, %%xmm1\n\t"
      "vpxor %%xmm2, %%xmm2, %%xmm2\n\t"
      "vpxor %%xmm3, %%xmm3, %%xmm3\n\t"
      "vpxor %%xmm4, %%xmm4, %%xmm4\n\t"
      "vpxor %%xmm5, %%xmm5, %%xmm5\n\t"
      "vpxor %%xmm6, %%xmm6, %%xmm6\n\t"
      "vpxor %%xmm7, %%xmm7, %%xmm7\n\t"
      "vpxor %%xmm8, %%xmm8, %%xmm8\n\t"
      "vpxor %%xmm9, %%xmm9, %%xmm9\n\t"
      KVSERVE_Q8_QUAD(0) KVSERVE_Q8_QUAD(1) KVSERVE_Q8_QUAD(2) KVSERVE_Q8_QUAD(3)
      KVSERVE_Q8_QUAD(4) KVSERVE_Q8_QUAD(5) KVSERVE_Q8_QUAD(6) KVSERVE_Q8_QUAD(7)
      "vpcmpeqw %%ymm15, %%ymm15, %%ymm15\n\t"
      "vpsrlw $15, %%ymm15, %%ymm15\n\t"  // 16-bit ones
      KVSERVE_Q8_STEP("(%[xd])", "(%[xs])", 0, 1, 0)
      KVSERVE_Q8_STEP("(%[xd],%[rb],1)", "(%[xs],%[rb],1)", 2, 3, 64)
      KVSERVE_Q8_STEP("(%[xd],%[rb],2)", "(%[xs],%[rb],2)", 4, 5, 128)
      KVSERVE_Q8_STEP("(%[xd3])", "(%[xs3])", 6, 7, 192)
      KVSERVE_Q8_STEP("(%[xd],%[rb],4)", "(%[xs],%[rb],4)", 8, 9, 256)
      :
      : [c] "r"(codes), [x] "r"(xq), [ld] "r"(k_len), [x3] "r"(xq + 3 * k_len), [stride] "i"(Stride),
        [xd] "r"(xd), [xs] "r"(xs), [rb] "r"(row_bytes), [xd3] "r"(xd + 3 * groups), [xs3] "r"(xs + 3 * groups),
        [scale] "r"(scale), [min] "r"(min), [total] "r"(total)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "xmm14", "xmm15", "memory");
}
#undef KVSERVE_Q8_STEP
#undef KVSERVE_Q8_QUAD
#undef KVSERVE_Q8_ROW

// One group of R rows times NT vectors of columns: codes [8 quads][NV] (see q8_block_many) from
// the tile's first vector, as are scale and min; xq at the group's first input of the tile's first
// row; total [R][NT].
template <int R, int NT, int NV>
inline void q8_tile(const int8_t* xq, int64_t k_len, const float* xd, const float* xs, int64_t groups,
                    const __m256i* codes, const __m256* scale, const __m256* min, __m256* total) {
  __m256i acc[R][NT];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_si256();
  }
  for (int q = 0; q < kQ8Group / 4; ++q) {
    __m256i c[NT];
    for (int t = 0; t < NT; ++t) c[t] = codes[q * NV + t];
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, xq + r * k_len + 4 * q, 4);
      const __m256i xb = _mm256_set1_epi32(quad);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_add_epi16(acc[r][t], _mm256_maddubs_epi16(c[t], xb));
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < NT; ++t) {
      total[r * NT + t] = group_step(total[r * NT + t], _mm256_madd_epi16(acc[r][t], ones), scale[t], min[t],
                                     xd[r * groups], xs[r * groups]);
    }
  }
}

// R rows (from row r) times NT vectors of columns (from vector v) over every group, then out.
template <int R, int NT, int NV, typename O>
inline void q8_rows(const int8_t* xq, const float* xd, const float* xs, int64_t r, int v, int64_t k_len,
                    const __m256i* codes, const __m256* scale, const __m256* min, O* out, int64_t n, int64_t n0) {
  const int64_t groups = k_len / kQ8Group;
  __m256 total[R * NT];
  for (int i = 0; i < R * NT; ++i) total[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* xg = xq + r * k_len + g * kQ8Group;
    const float *dg = xd + r * groups + g, *sg = xs + r * groups + g;
    const __m256i* cg = codes + g * (kQ8Group / 4) * NV + v;
    if constexpr (R == 5 && NT == 2) {  // the full tile in assembly
      q8_tile_5x2<NV * 32>(xg, k_len, dg, sg, groups, cg, scale + g * NV + v, min + g * NV + v, total);
    } else {
      q8_tile<R, NT, NV>(xg, k_len, dg, sg, groups, cg, scale + g * NV + v, min + g * NV + v, total);
    }
  }
  for (int i = 0; i < R; ++i) {
    float lanes[NT * 8];
    for (int t = 0; t < NT; ++t) _mm256_storeu_ps(lanes + 8 * t, total[i * NT + t]);
    for (int64_t j = 0; j < NT * 8; ++j) out[(r + i) * n + n0 + 8 * v + j] = from_float<O>(lanes[j]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// With AVX512-VNNI, q8_rows's tile for many rows: vpdpbusd multiplies 64 code bytes by 64 input
// bytes and adds each lane's four products into its int32 sum in one instruction, where AVX2 needs
// vpmaddubsw + vpaddw for half as many (and a vpmaddwd per group). The codes are q8_block_many's
// rearrangement read 16 columns (two of its AVX2 vectors) at a time; the integer sums are exact
// and the float step per group is group_step's arithmetic in the same order, so the results are
// those of the AVX2 kernels bit for bit. R rows x NT vectors of 16 columns: R * NT int32 sums and as
// many float totals, NT code vectors and the broadcast input fit AVX-512's 32 registers for 6 x 2.
template <int R, int NT, int NV, typename O>
inline void q8_rows_vnni(const int8_t* xq, const float* xd, const float* xs, int64_t r, int v, int64_t k_len,
                         const __m256i* codes, const __m256* scale, const __m256* min, O* out, int64_t n,
                         int64_t n0) {
  const int64_t groups = k_len / kQ8Group;
  __m512 total[R][NT];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) total[i][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R][NT];
    for (int i = 0; i < R; ++i)
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_si512();
    const int8_t* xg = xq + r * k_len + g * kQ8Group;
    for (int q = 0; q < kQ8Group / 4; ++q) {
      const __m256i* cq = codes + (g * (kQ8Group / 4) + q) * NV + v;  // v: the AVX2 vector of the tile's first column
      __m512i c[NT];
      for (int t = 0; t < NT; ++t) c[t] = _mm512_loadu_si512(cq + 2 * t);
      for (int i = 0; i < R; ++i) {
        int32_t quad;
        std::memcpy(&quad, xg + i * k_len + 4 * q, 4);
        const __m512i xb = _mm512_set1_epi32(quad);
        for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_dpbusd_epi32(acc[i][t], c[t], xb);
      }
    }
    __m512 sc[NT], mn[NT];
    for (int t = 0; t < NT; ++t) {
      sc[t] = _mm512_loadu_ps(scale + g * NV + v + 2 * t);
      mn[t] = _mm512_loadu_ps(min + g * NV + v + 2 * t);
    }
    for (int i = 0; i < R; ++i) {
      const __m512 d = _mm512_set1_ps(xd[(r + i) * groups + g]), s = _mm512_set1_ps(xs[(r + i) * groups + g]);
      for (int t = 0; t < NT; ++t) {
        total[i][t] = _mm512_fmadd_ps(_mm512_mul_ps(sc[t], d), _mm512_cvtepi32_ps(acc[i][t]), total[i][t]);
        total[i][t] = _mm512_fmadd_ps(s, mn[t], total[i][t]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    float lanes[NT * 16];
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(lanes + 16 * t, total[i][t]);
    for (int64_t j = 0; j < NT * 16; ++j) out[(r + i) * n + n0 + 8 * v + j] = from_float<O>(lanes[j]);
  }
}
#endif

// Many rows times one block of NV * 8 columns. The block's codes are rearranged once into a
// buffer, four consecutive inputs of a column per int32 lane and 8 columns per vector, so that one
// vpmaddubsw + vpmaddwd gives 8 columns' sums over 4 inputs, and its scales and mins widened to
// float; every tile of rows reads them from there, its float totals kept over all groups. A
// column's int16 lane adds 8 quads' pair sums, at most 8 * 2 * 15 * 127 = 30480: within range.
template <int NV, typename S, typename O>
void q8_block_many(const int8_t* xq, const float* xd, const float* xs, int64_t m, const uint8_t* block,
                   const S* scales_mins, int64_t n, int64_t n0, int64_t k_len, O* out, std::vector<__m256i>& codes,
                   std::vector<__m256>& scale_min) {
  constexpr int64_t half = NV * 4, chunks = NV / 4;
  // 5 rows x 2 vectors: 10 int16 accumulators, 2 code vectors, the broadcast inputs and a product fit
  // AVX2's 16 registers (3 x 4 needs 18: the compiler then spills accumulators and reloads codes).
  // Timed on the bundled model's four projections of a layer, one build each, against the float
  // paths in the same process: 0.53 / 0.55 / 0.59 of the float int4_mm's time at 16 / 64 rows and of
  // dequantize + GEMM's at 512, against 0.56-0.60 / 0.60-0.64 / 0.62-0.69 for 3 x 4, 4 x 2, 6 x 2, 2 x 4.
  constexpr int kTileRows = 5, kTileVecs = 2;
  const int64_t groups = k_len / kQ8Group;
  codes.resize(k_len / 4 * NV);
  scale_min.resize(2 * groups * NV);
  __m256 *scale = scale_min.data(), *min = scale_min.data() + groups * NV;
  for (int64_t q = 0; q < k_len / 4; ++q) {
    const uint8_t* rows = block + 4 * q * half;
    __m256i* dst = codes.data() + q * NV;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256i p01 = code_pairs(rows, half, c), p23 = code_pairs(rows + 2 * half, half, c);
      const __m256i lo = _mm256_unpacklo_epi16(p01, p23), hi = _mm256_unpackhi_epi16(p01, p23);
      const __m256i first = _mm256_permute2x128_si256(lo, hi, 0x20);   // columns c*16 + 0..7
      const __m256i second = _mm256_permute2x128_si256(lo, hi, 0x31);  // columns c*16 + 8..15
      dst[2 * c] = low_nibbles(first);
      dst[2 * c + 1] = low_nibbles(second);
      dst[NV / 2 + 2 * c] = high_nibbles(first);
      dst[NV / 2 + 2 * c + 1] = high_nibbles(second);
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    for (int v = 0; v < NV; ++v) {
      scale[g * NV + v] = load8(scales_mins + 2 * g * n + n0 + 8 * v);
      min[g * NV + v] = load8(scales_mins + (2 * g + 1) * n + n0 + 8 * v);
    }
  }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if constexpr (NV % 4 == 0) {
    constexpr int kVnniRows = 6, kVnniVecs = 2;  // vectors of 16 columns
    for (int64_t r = 0; r < m; r += kVnniRows) {
      for (int v = 0; v < NV; v += 2 * kVnniVecs) {
        switch (std::min<int64_t>(kVnniRows, m - r)) {
#define KVSERVE_ROWS(R)                                                                                       \
  case R:                                                                                                     \
    q8_rows_vnni<R, kVnniVecs, NV>(xq, xd, xs, r, v, k_len, codes.data(), scale, min, out, n, n0); \
    break;
          KVSERVE_ROWS(1) KVSERVE_ROWS(2) KVSERVE_ROWS(3) KVSERVE_ROWS(4) KVSERVE_ROWS(5) KVSERVE_ROWS(6)
#undef KVSERVE_ROWS
          default:
            TORCH_CHECK(false, "int4_mm: bad row tile");
        }
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < m; r += kTileRows) {
    for (int v = 0; v < NV; v += kTileVecs) {
      switch (std::min<int64_t>(kTileRows, m - r)) {
#define KVSERVE_ROWS(R)                                                                                   \
  case R:                                                                                                 \
    q8_rows<R, kTileVecs, NV>(xq, xd, xs, r, v, k_len, codes.data(), scale, min, out, n, n0); \
    break;
        KVSERVE_ROWS(1) KVSERVE_ROWS(2) KVSERVE_ROWS(3) KVSERVE_ROWS(4) KVSERVE_ROWS(5)
#undef KVSERVE_ROWS
        default:
          TORCH_CHECK(false, "int4_mm: bad row tile");
      }
    }
  }
}

template <int NV, typename S, typename O>
void q8_mm_impl(const float* x, int64_t m, int64_t k_len, const uint8_t* packed, const S* scales_mins, int64_t n,
                O* out) {
  const int64_t groups = k_len / kQ8Group;
  std::vector<int8_t> xq(m * k_len);
  std::vector<float> xd(m * groups), xs(m * groups);
  at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_group(x + i * kQ8Group, xq.data() + i * kQ8Group, &xd[i], &xs[i]);
  });
  constexpr int64_t block_n = NV * 8;
  at::parallel_for(0, n / block_n, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m256i> codes;
    std::vector<__m256> scale_min;
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = packed + b * (block_n / 2) * k_len;
      if (m == 1) {
        q8_block_one<NV>(xq.data(), xd.data(), xs.data(), block, scales_mins, n, b * block_n, k_len, out);
      } else {
        q8_block_many<NV>(xq.data(), xd.data(), xs.data(), m, block, scales_mins, n, b * block_n, k_len, out, codes,
                          scale_min);
      }
    }
  });
}
#else
constexpr bool kInt8Activations = false;
#endif

// x @ W.T for an Int4Linear's packed weight (blocks of block_n rows, see dequantize_int4_impl) and
// scales_mins [K / g, 2, N]: out [M, N] in x's dtype.
at::Tensor int4_mm(at::Tensor x, at::Tensor packed, at::Tensor scales_mins, int64_t n, int64_t group_size,
                   int64_t block_n, bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % group_size == 0 && n % block_n == 0 && group_size % 2 == 0,
              "int4_mm: x [M, K], whole groups of an even size");
  TORCH_CHECK(block_n % (2 * kLanes) == 0 && block_n / kLanes <= 8, "int4_mm: unsupported block of ", block_n, " rows");
  x = x.contiguous();
  const int64_t m = x.size(0), k_len = x.size(1), groups = k_len / group_size;
  at::Tensor xf = x.to(at::kFloat).contiguous();
  const bool int8 = kInt8Activations && int8_activations && group_size == kQ8Group && (block_n == 32 || block_n == 64);
  at::Tensor xsum;  // [M, K / g], the float kernels' group sums
  if (!int8) {  // summed in order here: a reduction's order in ATen may depend on the tensor's shape
    xsum = at::empty({m, groups}, xf.options());
    const float* xp = xf.data_ptr<float>();
    float* sums = xsum.data_ptr<float>();
    for (int64_t i = 0; i < m * groups; ++i) {
      float total = 0.f;
      for (int64_t j = 0; j < group_size; ++j) total += xp[i * group_size + j];
      sums[i] = total;
    }
  }
  at::Tensor out = at::empty({m, n}, x.options());
  auto run = [&](auto* sz, auto* o) {
    const uint8_t* w = packed.data_ptr<uint8_t>();
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    if (int8) {
      if (block_n == 32) {
        q8_mm_impl<4>(xf.data_ptr<float>(), m, k_len, w, sz, n, o);
      } else {
        q8_mm_impl<8>(xf.data_ptr<float>(), m, k_len, w, sz, n, o);
      }
      return;
    }
#endif
    const float *xp = xf.data_ptr<float>(), *xs = xsum.data_ptr<float>();
    switch (block_n / kLanes) {
      case 2: int4_mm_impl<2>(xp, xs, m, k_len, w, sz, n, group_size, o); break;
      case 4: int4_mm_impl<4>(xp, xs, m, k_len, w, sz, n, group_size, o); break;
      default: int4_mm_impl<8>(xp, xs, m, k_len, w, sz, n, group_size, o); break;
    }
  };
  with_scales_mins(scales_mins, [&](auto* sm) {
    if (x.scalar_type() == at::kBFloat16) {
      run(sm, out.data_ptr<c10::BFloat16>());
    } else {
      TORCH_CHECK(x.scalar_type() == at::kFloat, "int4_mm runs in float32 or bfloat16");
      run(sm, out.data_ptr<float>());
    }
  });
  return out;
}

// ----- greedy sampling ---------------------------------------------------------------------------
// The index of each row's largest value, the first where several tie, as torch.argmax (which takes
// about 3.5 ms for 64 rows of the bundled model's 49152 logits here, scalar, against well under
// one for this). NaN counts as the largest, as there: a row holding one takes the scalar loop.
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "argmax_rows: float32 [B, V] logits");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "argmax_rows: empty rows");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * vocab;
      bool nan = false;
      const float best = row_peak(row, vocab, &nan);
      int64_t index = 0;
      if (nan) {
        while (!std::isnan(row[index])) ++index;
      } else {
        while (row[index] != best) ++index;
      }
      o[r] = index;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize_int8_groups", &dequantize_int8_groups, "rows of an int8-groups weight, [rows, K]");
  m.def("int8_group_matmul", &int8_group_matmul, "x @ (codes * group scales).T in float32, [M, V]");
  m.def("float32_matmul", &float32_matmul, "x @ weight.T in float32 for a float or bfloat16 weight, [M, V]");
  m.def("amx_min_rows", [] { return kAmxMinRows; }, "rows from which the lm_head's AMX tiles are fastest");
  m.def("decode_forward", &decode_forward, "one decode step (or fresh prompts' prefill) of a Llama model");
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value (NaN largest), [B] int64");
  m.def("int8_activations", [] { return kInt8Activations; }, "whether int4_mm can quantize activations to int8");
  m.def(
      "amx",
      [] {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
        return amx_usable();
#else
        return false;
#endif
      },
      "whether this build runs AMX tiles (bfloat16 GEMMs then favour more rows)");
  m.def("int4_mm", &int4_mm, "x @ W.T for an Int4Linear's packed weight, for a few rows");
  m.def("dequantize_int4", &dequantize_int4, "an Int4Linear's transposed weight in its compute dtype, [K, N]");
}
