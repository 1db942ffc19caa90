// int8 codes with a scale per group of 32 (GGML's Q8_0: the lm_head) times int8 activations on
// AVX512-VNNI, from the codes stored 16 output rows x 4 inputs interleaved:
//   quads [V / 16, K / 4, 16, 4] int8, quad_scales [V / 16, K / 32, 16] float32,
//   quad_offsets [V / 16, K / 32, 16] int32 (-128 times the sum of each row's 32 codes of the group)
// so that one vpdpbusd multiplies four inputs by the four codes of 16 output rows and adds the four
// products to each row's int32 lane. Each row's inputs are quantized per group of 32 as
// int8_group_matmul_int8 quantizes them (quantize_group: x ~ d * q); vpdpbusd takes unsigned bytes
// times signed ones, so the inputs go in as q + 128 and the offset takes 128 * sum(codes) back out:
// a group's 32 products are summed exactly in integers. Per group then
//   total = fma(float(sum), scale * d, total)
// in group order: every row count runs this one order (tiles of rows over each block's codes, read
// once per group for all of a tile's rows), so a row's logits are the same bits whatever rows are
// beside it. Row-major codes take a float step per row, group and output row (int8_int8.cpp); this
// layout takes one per 8 vpdpbusd, 16 outputs at a time.

#include <vector>

#include "kernels.h"

namespace kvserve {

bool int8_quads_usable() { return KVSERVE_HAS_VNNI512 && KVSERVE_HAS_INT8_ACTIVATIONS; }

#if KVSERVE_HAS_VNNI512 && KVSERVE_HAS_INT8_ACTIVATIONS
namespace {

constexpr int kQuadTileRows = 8;  // 8 code vectors, 8 int32 and 8 float accumulators of 32 registers
constexpr int64_t kQuadBlock = 4;  // 16-row vectors per task: 64 output rows

// R rows x one 16-row vector of outputs over all groups: u [R, k] the inputs as q + 128, d [R, k / 32]
// their scales; quads this vector's [K / 4, 16, 4] codes, scales and offsets its [K / 32, 16].
template <int R>
inline void quad_tile(const uint8_t* u, const float* d, int64_t k, const int8_t* quads, const float* scales,
                      const int32_t* offsets, float* out, int64_t ldo, int64_t cols) {
  const int64_t groups = k / 32;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i codes[8];
    for (int j = 0; j < 8; ++j) codes[j] = _mm512_loadu_si512(quads + (g * 8 + j) * 64);
    const __m512i offset = _mm512_loadu_si512(offsets + g * 16);
    const __m512 scale = _mm512_loadu_ps(scales + g * 16);
    for (int r = 0; r < R; ++r) {
      __m512i sum = offset;
      for (int j = 0; j < 8; ++j) {
        int32_t four;  // inputs 4j .. 4j + 3 of the group
        std::memcpy(&four, u + r * k + g * 32 + 4 * j, sizeof(four));
        sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi32(four), codes[j]);
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

at::Tensor int8_quads_matmul(at::Tensor x, at::Tensor quads, at::Tensor quad_scales, at::Tensor quad_offsets,
                             int64_t v) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "int8_quads_matmul: x [M, K] with K a multiple of 32");
  TORCH_CHECK(quads.dim() == 4 && quads.size(1) * 4 == x.size(1) && quads.size(2) == 16 && quads.size(3) == 4 &&
                  quads.size(0) * 16 >= v && quads.is_contiguous() && quad_scales.is_contiguous() &&
                  quad_offsets.is_contiguous() && quad_scales.numel() == quad_offsets.numel() &&
                  quad_scales.numel() == quads.size(0) * 16 * (x.size(1) / 32),
              "int8_quads_matmul: quads [V / 16, K / 4, 16, 4], scales and offsets [V / 16, K / 32, 16]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1), groups = k / 32, vectors = quads.size(0);
  std::vector<uint8_t> u(m * k);
  std::vector<float> d(m * groups), sums(m * groups);
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int8_t q[32];
      quantize_group(xp + i * 32, q, &d[i], &sums[i]);
      for (int j = 0; j < 32; ++j) u[i * 32 + j] = static_cast<uint8_t>(q[j] + 128);
    }
  });
  at::Tensor out = at::empty({m, v}, x.options().dtype(at::kFloat));
  const int8_t* qp = quads.data_ptr<int8_t>();
  const float* sp = quad_scales.data_ptr<float>();
  const int32_t* op = quad_offsets.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (vectors + kQuadBlock - 1) / kQuadBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t vec = begin * kQuadBlock; vec < std::min(end * kQuadBlock, vectors); ++vec) {
      const int8_t* vq = qp + vec * k * 16;
      const float* vs = sp + vec * groups * 16;
      const int32_t* vo = op + vec * groups * 16;
      const int64_t cols = std::min<int64_t>(16, v - vec * 16);
      for (int64_t r = 0; r < m; r += kQuadTileRows) {
        const uint8_t* ur = u.data() + r * k;
        const float* dr = d.data() + r * groups;
        float* dst = o + r * v + vec * 16;
        switch (std::min<int64_t>(kQuadTileRows, m - r)) {
#define KVSERVE_ROWS(R)                                       \
  case R:                                                     \
    quad_tile<R>(ur, dr, k, vq, vs, vo, dst, v, cols); \
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
at::Tensor int8_quads_matmul(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t) {
  TORCH_CHECK(false, "int8_quads_matmul needs AVX512-VNNI");
}
#endif

}  // namespace kvserve
