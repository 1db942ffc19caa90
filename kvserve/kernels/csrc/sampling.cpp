// Greedy sampling: each row's first index of its largest value, as torch.argmax, but vectorized
// (row_peak) and over rows in parallel where torch.argmax's CPU kernel runs scalar. NaN counts as
// the largest, as there: a row holding one takes the scalar loop.
// Structured output: a grammar's token bitmask applied to its own row's logits.
// Random sampling (sample_rows): the exponential race argmax_v p_v / E_v in one pass per row, p_v the
// softmax at the row's temperature, unnormalized (exp((l_v - max) / T): the argmax needs no sum).

#include "kernels.h"

#include <algorithm>
#include <limits>

namespace kvserve {

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

namespace {

// Chris Wellons' lowbias32: a 32-bit mix whose every output bit depends on every input bit.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// A row's two 32-bit keys from its 64-bit seed: splitmix64's finalizer, its halves.
inline void row_keys(uint64_t z, uint32_t& key0, uint32_t& key1) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  key0 = static_cast<uint32_t>(z);
  key1 = static_cast<uint32_t>(z >> 32);
}

// The float below 1: the top step's centre, 1 - 2^-25, rounds to 1 in float (and -log(1) = 0 made that
// token's score infinite, drawn whatever its probability: one draw in 2^24 / vocab).
constexpr float kBelowOne = 0x1.fffffep-1f;

// Token v's uniform in (0, 1) under a row's keys: two rounds of mix32 over (v + key0) ^ key1, its top 24
// bits centred in their step (the top step held below 1), so never 0 or 1.
inline float uniform_of(uint32_t v, uint32_t key0, uint32_t key1) {
  return std::min((static_cast<float>(mix32(mix32(v + key0) ^ key1) >> 8) + 0.5f) * 0x1p-24f, kBelowOne);
}

#if KVSERVE_HAS_AVX2_FMA
inline __m256i mix32x8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x846ca68bU)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// log of 8 positive normal floats: Cephes' logf (mantissa in [sqrt(1/2), sqrt(2)), a degree-8 polynomial).
inline __m256 log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
  __m256 m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)), _mm256_set1_epi32(0x3F800000)));
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  e = _mm256_sub_epi32(e, _mm256_castps_si256(big));  // + 1 where halved (the mask is -1)
  const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.f)), z = _mm256_mul_ps(f, f);
  __m256 y = _mm256_set1_ps(7.0376836292e-2f);
  for (const float c : {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f, -1.6668057665e-1f,
                        2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f}) {
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(c));
  }
  y = _mm256_mul_ps(_mm256_mul_ps(y, f), z);
  const __m256 ef = _mm256_cvtepi32_ps(e);
  y = _mm256_fmadd_ps(ef, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
  return _mm256_fmadd_ps(ef, _mm256_set1_ps(0.693359375f), _mm256_add_ps(f, y));
}
#endif

}  // namespace

at::Tensor sample_rows(at::Tensor logits, const at::Tensor& rows, const at::Tensor& inv_temperatures,
                       const at::Tensor& seeds) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "sample_rows: float32 [B, V] logits");
  const int64_t draws = rows.numel();
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "sample_rows: int64 [R] row indices");
  TORCH_CHECK(inv_temperatures.dim() == 1 && inv_temperatures.scalar_type() == at::kFloat &&
                  inv_temperatures.numel() == draws && seeds.dim() == 1 && seeds.scalar_type() == at::kLong &&
                  seeds.numel() == draws,
              "sample_rows: float32 [R] inverse temperatures and int64 [R] seeds, one per row index");
  logits = logits.contiguous();
  const at::Tensor rows_c = rows.contiguous(), inv_c = inv_temperatures.contiguous(), seeds_c = seeds.contiguous();
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "sample_rows: 1 to 2^31 - 1 tokens a row");
  const int64_t* row_ids = rows_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < draws; ++i) TORCH_CHECK(0 <= row_ids[i] && row_ids[i] < logits.size(0), "row out of range");
  at::Tensor out = at::empty({draws}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* inv_t = inv_c.data_ptr<float>();
  const int64_t* seed = seeds_c.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, draws, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + row_ids[r] * vocab;
      bool nan = false;
      const float peak = row_peak(row, vocab, &nan);
      if (nan || peak == -INFINITY) {  // no distribution: torch's softmax gives NaN and argmax the first
        o[r] = 0;
        continue;
      }
      uint32_t key0, key1;
      row_keys(static_cast<uint64_t>(seed[r]), key0, key1);
      float best = -1.f;
      int64_t index = 0, v = 0;
#if KVSERVE_HAS_AVX2_FMA
      const __m256 inv8 = _mm256_set1_ps(inv_t[r]);
      __m256 best8 = _mm256_set1_ps(-1.f);
      __m256i index8 = _mm256_setzero_si256(), ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      for (; v + 8 <= vocab; v += 8) {
        const __m256i h = mix32x8(_mm256_xor_si256(mix32x8(_mm256_add_epi32(ids, _mm256_set1_epi32(key0))),
                                                   _mm256_set1_epi32(static_cast<int32_t>(key1))));
        const __m256 u = _mm256_min_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)),
                                                       _mm256_set1_ps(0x1p-24f), _mm256_set1_ps(0x1p-25f)),
                                       _mm256_set1_ps(kBelowOne));
        const __m256 p = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + v), _mm256_set1_ps(peak)), inv8));
        const __m256 score = _mm256_div_ps(p, _mm256_sub_ps(_mm256_setzero_ps(), log8(u)));
        const __m256 better = _mm256_cmp_ps(score, best8, _CMP_GT_OQ);  // strictly: the first index keeps a tie
        best8 = _mm256_blendv_ps(best8, score, better);
        index8 = _mm256_blendv_epi8(index8, ids, _mm256_castps_si256(better));
        ids = _mm256_add_epi32(ids, _mm256_set1_epi32(8));
      }
      float lanes[8];
      int32_t lane_ids[8];
      _mm256_storeu_ps(lanes, best8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lane_ids), index8);
      for (int i = 0; i < 8; ++i) {
        if (lanes[i] > best || (lanes[i] == best && lane_ids[i] < index)) {
          best = lanes[i];
          index = lane_ids[i];
        }
      }
#endif
      for (; v < vocab; ++v) {
        const float u = uniform_of(static_cast<uint32_t>(v), key0, key1);
        const float score = std::exp((row[v] - peak) * inv_t[r]) / -std::log(u);
        if (score > best) {
          best = score;
          index = v;
        }
      }
      o[r] = index;
    }
  });
  return out;
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "apply_token_bitmask: contiguous float32 [B, V] logits");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask: contiguous int32 [R, W] bitmask");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: int64 [R] row indices, one per bitmask row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), num_rows = rows.size(0);
  float* x = logits.data_ptr<float>();
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_rows; ++i) TORCH_CHECK(0 <= row_ids[i] && row_ids[i] < logits.size(0), "row out of range");
  const float forbidden = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = x + row_ids[i] * vocab;
      const uint32_t* mask = masks + i * words;
      for (int64_t word = 0; word * 32 < vocab; ++word) {
        const uint32_t bits = word < words ? mask[word] : 0u;
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t last = std::min<int64_t>(32, vocab - word * 32);
        for (int64_t bit = 0; bit < last; ++bit) {
          if (!((bits >> bit) & 1u)) row[word * 32 + bit] = forbidden;
        }
      }
    }
  });
}

}  // namespace kvserve
