// int8 codes with a scale per group of 32 (GGML's Q8_0 and Q5_0, and types rounded to it) times int8
// activations on AVX512-VNNI, from the codes stored 16 output rows x 4 inputs interleaved, each code
// as the unsigned byte code + 128:
//   quads [V / 16, K / 4, 16, 4] uint8, quad_scales [V / 16, K / 32, 16] float32
// (as many bytes as row-major codes and scales), so that one vpdpbusd multiplies the four codes of 16
// output rows (its unsigned operand) by four inputs (signed) and adds the four products to each
// row's int32 lane. Each row's inputs are quantized per group of 32 as int8_group_matmul_int8
// quantizes them (quantize_group: x ~ d * q); the + 128 of the codes adds 128 * sum(q) to a group's
// sum, which starts from -128 * sum(q) (one value per input row and group): a group's 32 products
// code * q are summed exactly in integers. Per group then
//   total = fma(float(sum), scale * d, total)
// in group order: every row count runs this one order (tiles of rows over each block's codes, read
// once per group for all of a tile's rows), so a row's result is the same bits whatever rows are
// beside it. Row-major codes take a float step per row, group and output row (int8_int8.cpp); this
// layout takes one per 8 vpdpbusd, 16 outputs at a time (bench/kernels.py: 2.5x for one row, 4-5x
// from 16 rows).

#include <vector>

#include "kernels.h"

namespace kvserve {

bool int8_quads_usable() { return KVSERVE_HAS_VNNI512 && KVSERVE_HAS_INT8_ACTIVATIONS; }

#if KVSERVE_HAS_VNNI512 && KVSERVE_HAS_INT8_ACTIVATIONS
namespace {

constexpr int kQuadTileRows = 8;  // 8 code vectors, 8 int32 and 8 float accumulators of 32 registers
constexpr int64_t kQuadBlock = 4;  // 16-row vectors per task: 64 output rows

// R rows x one 16-row vector of outputs over all groups: q [R, k] the inputs' int8 codes, d and
// start [R, k / 32] their scales and -128 x their sums; quads this vector's [K / 4, 16, 4] codes + 128,
// scales its [K / 32, 16].
template <int R>
inline void quad_tile(const int8_t* q, const float* d, const int32_t* start, int64_t k, const uint8_t* quads,
                      const float* scales, float* out, int64_t ldo, int64_t cols) {
  const int64_t groups = k / 32;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i codes[8];
    for (int j = 0; j < 8; ++j) codes[j] = _mm512_loadu_si512(quads + (g * 8 + j) * 64);
    const __m512 scale = _mm512_loadu_ps(scales + g * 16);
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

}  // namespace

at::Tensor int8_quads_matmul(at::Tensor x, at::Tensor quads, at::Tensor quad_scales, int64_t v) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "int8_quads_matmul: x [M, K] with K a multiple of 32");
  TORCH_CHECK(quads.scalar_type() == at::kByte && quads.dim() == 4 && quads.size(1) * 4 == x.size(1) &&
                  quads.size(2) == 16 && quads.size(3) == 4 && quads.size(0) * 16 >= v && quads.is_contiguous() &&
                  quad_scales.scalar_type() == at::kFloat && quad_scales.is_contiguous() &&
                  quad_scales.numel() == quads.size(0) * 16 * (x.size(1) / 32),
              "int8_quads_matmul: quads [V / 16, K / 4, 16, 4] uint8, scales [V / 16, K / 32, 16] float32");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1), groups = k / 32, vectors = quads.size(0);
  std::vector<int8_t> q(m * k);
  std::vector<float> d(m * groups), sums(m * groups);
  std::vector<int32_t> start(m * groups);
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_group(xp + i * 32, q.data() + i * 32, &d[i], &sums[i]);
      int32_t total = 0;
      for (int j = 0; j < 32; ++j) total += q[i * 32 + j];
      start[i] = -128 * total;
    }
  });
  at::Tensor out = at::empty({m, v}, x.options().dtype(at::kFloat));
  const uint8_t* qp = quads.data_ptr<uint8_t>();
  const float* sp = quad_scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (vectors + kQuadBlock - 1) / kQuadBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t vec = begin * kQuadBlock; vec < std::min(end * kQuadBlock, vectors); ++vec) {
      const uint8_t* vq = qp + vec * k * 16;
      const float* vs = sp + vec * groups * 16;
      const int64_t cols = std::min<int64_t>(16, v - vec * 16);
      if (cols <= 0) continue;
      for (int64_t r = 0; r < m; r += kQuadTileRows) {
        const int8_t* qr = q.data() + r * k;
        const float* dr = d.data() + r * groups;
        const int32_t* sr = start.data() + r * groups;
        float* dst = o + r * v + vec * 16;
        switch (std::min<int64_t>(kQuadTileRows, m - r)) {
#define KVSERVE_ROWS(R)                                    \
  case R:                                                  \
    quad_tile<R>(qr, dr, sr, k, vq, vs, dst, v, cols);     \
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
  return out;
}
#else
at::Tensor int8_quads_matmul(at::Tensor, at::Tensor, at::Tensor, int64_t) {
  TORCH_CHECK(false, "int8_quads_matmul needs AVX512-VNNI");
}
#endif

}  // namespace kvserve
