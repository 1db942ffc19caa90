// int8 codes with a scale per group of 32 (GGML's Q8_0 and Q5_0, and types rounded to it) times int8
// activations on AVX512-VNNI, from the codes stored 16 output rows x 4 inputs interleaved, so that one
// vpdpbusd multiplies the four codes of 16 output rows (its unsigned operand) by four inputs (signed)
// and adds the four products to each row's int32 lane. Per 16-row vector and group of 32 inputs the
// codes are eight such 64-byte vectors (j = 0..7: inputs 4j..4j+3 of the group), held in one of two
// widths:
//   8 bits: quads [V / 16, K / 4, 16, 4] uint8, each code + 128 (as many bytes as row-major codes);
//   5 bits: quads [V / 16, K / 32, 320] uint8 for codes in -16..15 (GGML's Q5_0), each code + 16:
//     bytes 0..255 four 64-byte vectors of nibbles, vector t holding vector 2t's low 4 bits in its
//     low nibble and vector 2t + 1's in its high one; bytes 256..319 eight 64-bit masks, mask j's
//     bit i the fifth bit of vector j's byte i (as many bytes as GGML's blocks hold the codes);
// and quad_scales [V / 16, K / 32, 16] float32, or float16 where the file's scales are (Q8_0, Q5_0).
// Each row's inputs are quantized per group of 32 as int8_group_matmul_int8 quantizes them
// (quantize_group: x ~ d * q); the offset of the codes (128 or 16) adds offset * sum(q) to a group's
// sum, which starts from -offset * sum(q) (one value per input row and group): a group's 32 products
// code * q are summed exactly in integers, the same integer in either width. Per group then
//   total = fma(float(sum), scale * d, total)
// in group order: every row count runs this one order (tiles of rows over each block's codes, read
// once per group for all of a tile's rows), so a row's result is the same bits whatever rows are
// beside it, and the same in either width. Row-major codes take a float step per row, group and
// output row (int8_int8.cpp); this layout takes one per 8 vpdpbusd, 16 outputs at a time
// (bench/kernels.py: 2.5x for one row, 4-5x from 16 rows).

#include <type_traits>
#include <vector>

#include "kernels.h"

namespace kvserve {

bool int8_quads_usable() { return KVSERVE_HAS_VNNI512 && KVSERVE_HAS_INT8_ACTIVATIONS; }

#if KVSERVE_HAS_VNNI512 && KVSERVE_HAS_INT8_ACTIVATIONS
namespace {

constexpr int kQuadTileRows = 8;  // 8 code vectors, 8 int32 and 8 float accumulators of 32 registers
constexpr int64_t kQuadBlock = 4;  // 16-row vectors per task: 64 output rows

// Group g's eight code vectors of one 16-row vector, each byte a code plus its offset.
template <int Bits>
inline void load_codes(const uint8_t* quads, int64_t g, __m512i* codes) {
  if constexpr (Bits == 8) {
    for (int j = 0; j < 8; ++j) codes[j] = _mm512_loadu_si512(quads + (g * 8 + j) * 64);
  } else {
    const uint8_t* block = quads + g * 320;
    const __m512i low = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    for (int t = 0; t < 4; ++t) {
      const __m512i nibbles = _mm512_loadu_si512(block + t * 64);
      codes[2 * t] = _mm512_and_si512(nibbles, low);
      codes[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low);
    }
    for (int j = 0; j < 8; ++j) {
      uint64_t mask;
      std::memcpy(&mask, block + 256 + 8 * j, sizeof(mask));
      codes[j] = _mm512_or_si512(codes[j], _mm512_maskz_mov_epi8(static_cast<__mmask64>(mask), fifth));
    }
  }
}

template <typename S>
inline __m512 load_scales(const S* scales) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_loadu_ps(scales);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
  }
}

// R rows x one 16-row vector of outputs over all groups: q [R, k] the inputs' int8 codes, d and
// start [R, k / 32] their scales and -offset x their sums; quads this vector's codes, scales its
// [K / 32, 16].
template <int R, int Bits, typename S>
inline void quad_tile(const int8_t* q, const float* d, const int32_t* start, int64_t k, const uint8_t* quads,
                      const S* scales, float* out, int64_t ldo, int64_t cols) {
  const int64_t groups = k / 32;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i codes[8];
    load_codes<Bits>(quads, g, codes);
    const __m512 scale = load_scales(scales + g * 16);
    for (int r = 0; r < R; ++r) {
      __m512i sum = _mm512_set1_epi32(start[r * groups + g]);
      for (int j = 0; j < 8; ++j) {
        int32_t four;  // inputs 4j .. 4j + 3 of the group
        std::memcpy(&four, q + r * k + g * 32 + 4 * j, sizeof(four));
        sum = _mm512_dpbusd_epi32(sum, codes[j], _mm512_set1_epi32(four));
      }
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(d[r * groups + g])),
                                 total[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (cols == 16) {
      _mm512_storeu_ps(out + r * ldo, total[r]);
    } else {
      _mm512_mask_storeu_ps(out + r * ldo, static_cast<__mmask16>((1u << cols) - 1), total[r]);
    }
  }
}

// The tiles of every vector and row, for one width and scale type.
template <int Bits, typename S>
void quads_matmul(const int8_t* q, const float* d, const int32_t* start, int64_t m, int64_t k, const uint8_t* qp,
                  const S* sp, float* o, int64_t v, int64_t vectors) {
  const int64_t groups = k / 32, vector_bytes = k * 16 * Bits / 8;
  at::parallel_for(0, (vectors + kQuadBlock - 1) / kQuadBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t vec = begin * kQuadBlock; vec < std::min(end * kQuadBlock, vectors); ++vec) {
      const uint8_t* vq = qp + vec * vector_bytes;
      const S* vs = sp + vec * groups * 16;
      const int64_t cols = std::min<int64_t>(16, v - vec * 16);
      if (cols <= 0) continue;
      for (int64_t r = 0; r < m; r += kQuadTileRows) {
        const int8_t* qr = q + r * k;
        const float* dr = d + r * groups;
        const int32_t* sr = start + r * groups;
        float* dst = o + r * v + vec * 16;
        switch (std::min<int64_t>(kQuadTileRows, m - r)) {
#define KVSERVE_ROWS(R)                                                  \
  case R:                                                                \
    quad_tile<R, Bits, S>(qr, dr, sr, k, vq, vs, dst, v, cols);          \
    break;
          KVSERVE_ROWS(1) KVSERVE_ROWS(2) KVSERVE_ROWS(3) KVSERVE_ROWS(4)
          KVSERVE_ROWS(5) KVSERVE_ROWS(6) KVSERVE_ROWS(7) KVSERVE_ROWS(8)
#undef KVSERVE_ROWS
          default:
            TORCH_CHECK(false, "int8_quads_matmul: bad row tile");
        }
      }
    }
  });
}

}  // namespace

at::Tensor int8_quads_matmul(at::Tensor x, at::Tensor quads, at::Tensor quad_scales, int64_t v) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "int8_quads_matmul: x [M, K] with K a multiple of 32");
  const int64_t m = x.size(0), k = x.size(1), groups = k / 32, vectors = quads.size(0);
  const bool eight = quads.dim() == 4;
  TORCH_CHECK(quads.scalar_type() == at::kByte && quads.is_contiguous() && vectors * 16 >= v &&
                  (eight ? quads.size(1) * 4 == k && quads.size(2) == 16 && quads.size(3) == 4
                         : quads.dim() == 3 && quads.size(1) == groups && quads.size(2) == 320),
              "int8_quads_matmul: quads [V / 16, K / 4, 16, 4] (8 bits) or [V / 16, K / 32, 320] (5 bits) uint8");
  TORCH_CHECK((quad_scales.scalar_type() == at::kFloat || quad_scales.scalar_type() == at::kHalf) &&
                  quad_scales.is_contiguous() && quad_scales.numel() == vectors * 16 * groups,
              "int8_quads_matmul: quad_scales [V / 16, K / 32, 16] float32 or float16");
  const int32_t offset = eight ? 128 : 16;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  std::vector<int8_t> q(m * k);
  std::vector<float> d(m * groups), sums(m * groups);
  std::vector<int32_t> start(m * groups);
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_group(xp + i * 32, q.data() + i * 32, &d[i], &sums[i]);
      int32_t total = 0;
      for (int j = 0; j < 32; ++j) total += q[i * 32 + j];
      start[i] = -offset * total;
    }
  });
  at::Tensor out = at::empty({m, v}, x.options().dtype(at::kFloat));
  const uint8_t* qp = quads.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const bool half = quad_scales.scalar_type() == at::kHalf;
  if (eight && !half) {
    quads_matmul<8, float>(q.data(), d.data(), start.data(), m, k, qp, quad_scales.data_ptr<float>(), o, v, vectors);
  } else if (eight) {
    quads_matmul<8, at::Half>(q.data(), d.data(), start.data(), m, k, qp, quad_scales.data_ptr<at::Half>(), o, v,
                              vectors);
  } else if (!half) {
    quads_matmul<5, float>(q.data(), d.data(), start.data(), m, k, qp, quad_scales.data_ptr<float>(), o, v, vectors);
  } else {
    quads_matmul<5, at::Half>(q.data(), d.data(), start.data(), m, k, qp, quad_scales.data_ptr<at::Half>(), o, v,
                              vectors);
  }
  return out;
}
#else
at::Tensor int8_quads_matmul(at::Tensor, at::Tensor, at::Tensor, int64_t) {
  TORCH_CHECK(false, "int8_quads_matmul needs AVX512-VNNI");
}
#endif

}  // namespace kvserve
