// int8 codes with a scale per group of 32 (GGML's Q8_0: the lm_head) times bfloat16 rows on
// AVX512-BF16, from the codes stored 16 output rows x 2 inputs interleaved:
//   pairs [V / 16, K / 2, 16, 2] int8, pair_scales [V / 16, K / 32, 16] float32
// so that one vdpbf16ps multiplies a pair of inputs by the pair of codes of 16 output rows. The
// codes (-128..127) and the products are exact in bfloat16; per group of 32 inputs a lane sums its
// 16 pairs in order, then total += scale * that sum. Every row count runs this one order (tiles of
// up to 6 rows over codes converted once per group and block), so a row's logits are the same bits
// whatever rows are beside it. Row-major codes need a scale multiply per 32 products whatever the
// instruction, as many instructions as float FMAs; this layout needs one per 16 vdpbf16ps.

#include <vector>

#include "kernels.h"

namespace kvserve {

bool int8_pairs_usable() { return KVSERVE_HAS_AVX512_BF16; }

#if KVSERVE_HAS_AVX512_BF16
namespace {

constexpr int kPairVecs = 4;  // 16-row vectors per block: 64 output rows
constexpr int kPairTileRows = 6;

// 16 rows' codes of one pair of inputs (32 bytes) as 32 bfloat16 (exact).
inline __m512bh pair_codes_bf16(const int8_t* p) {
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 high =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(high, low);
}

// R rows x NT vectors for one group: x bfloat16 bits [R, k] at the group's first input, codes
// [16 pairs, kPairVecs] bf16 from the tile's first vector, scale the group's 16-row scales.
template <int NT, int R>
inline void pair_tile(const uint16_t* x, int64_t k, const __m512bh* codes, const __m512* scale, __m512* total,
                      int64_t ldt) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NT; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int p = 0; p < 16; ++p) {
    __m512bh b[NT];
    for (int v = 0; v < NT; ++v) b[v] = codes[p * kPairVecs + v];
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k + 2 * p, sizeof(pair));
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int v = 0; v < NT; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NT; ++v) total[r * ldt + v] = _mm512_fmadd_ps(scale[v], acc[r][v], total[r * ldt + v]);
  }
}

template <int NT>
void pair_block(const uint16_t* x, int64_t m, int64_t k, const int8_t* pairs, const float* scales, float* out,
                int64_t v_total, int64_t v0, std::vector<__m512bh>& codes, std::vector<__m512>& total) {
  const int64_t groups = k / 32, half = k / 2;
  codes.resize(16 * kPairVecs);
  total.assign(m * kPairVecs, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m512 scale[kPairVecs];
    for (int v = 0; v < NT; ++v) {
      const int8_t* vec_pairs = pairs + (v0 / 16 + v) * half * 32;  // this vector's [K / 2, 16, 2]
      for (int p = 0; p < 16; ++p) codes[p * kPairVecs + v] = pair_codes_bf16(vec_pairs + (g * 16 + p) * 32);
      scale[v] = _mm512_loadu_ps(scales + ((v0 / 16 + v) * groups + g) * 16);
    }
    for (int64_t r = 0; r < m; r += kPairTileRows) {
      const uint16_t* xr = x + r * k + g * 32;
      __m512* t = total.data() + r * kPairVecs;
      switch (std::min<int64_t>(kPairTileRows, m - r)) {
#define KVSERVE_ROWS(R)                                              \
  case R:                                                            \
    pair_tile<NT, R>(xr, k, codes.data(), scale, t, kPairVecs); \
    break;
        KVSERVE_ROWS(1) KVSERVE_ROWS(2) KVSERVE_ROWS(3) KVSERVE_ROWS(4) KVSERVE_ROWS(5) KVSERVE_ROWS(6)
#undef KVSERVE_ROWS
        default:
          TORCH_CHECK(false, "int8_pairs_matmul: bad row tile");
      }
    }
  }
  const int64_t cols = std::min<int64_t>(NT * 16, v_total - v0);
  for (int64_t r = 0; r < m; ++r) {
    float lanes[kPairVecs * 16];
    std::memcpy(lanes, total.data() + r * kPairVecs, sizeof(lanes));
    std::memcpy(out + r * v_total + v0, lanes, cols * sizeof(float));
  }
}

}  // namespace

at::Tensor int8_pairs_matmul(at::Tensor x, at::Tensor pairs, at::Tensor pair_scales, int64_t v) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) % 32 == 0,
              "int8_pairs_matmul: bfloat16 x [M, K] with K a multiple of 32");
  TORCH_CHECK(pairs.dim() == 4 && pairs.size(1) * 2 == x.size(1) && pairs.size(2) == 16 && pairs.size(3) == 2 &&
                  pairs.size(0) * 16 >= v && pairs.is_contiguous() && pair_scales.is_contiguous(),
              "int8_pairs_matmul: pairs [V / 16, K / 2, 16, 2]");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), vectors = pairs.size(0);
  at::Tensor out = at::empty({m, v}, x.options().dtype(at::kFloat));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int8_t* pp = pairs.data_ptr<int8_t>();
  const float* sp = pair_scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (vectors + kPairVecs - 1) / kPairVecs;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> codes;
    std::vector<__m512> total;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t v0 = b * kPairVecs * 16;
      switch (std::min<int64_t>(kPairVecs, vectors - b * kPairVecs)) {
        case 1: pair_block<1>(xp, m, k, pp, sp, op, v, v0, codes, total); break;
        case 2: pair_block<2>(xp, m, k, pp, sp, op, v, v0, codes, total); break;
        case 3: pair_block<3>(xp, m, k, pp, sp, op, v, v0, codes, total); break;
        default: pair_block<4>(xp, m, k, pp, sp, op, v, v0, codes, total); break;
      }
    }
  });
  return out;
}
#else
at::Tensor int8_pairs_matmul(at::Tensor, at::Tensor, at::Tensor, int64_t) {
  TORCH_CHECK(false, "int8_pairs_matmul needs AVX512-BF16");
}
#endif

}  // namespace kvserve
