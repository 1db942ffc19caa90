// int8 codes with a scale per group of 32 inputs (GGML's Q8_0 and Q5_0: Int8GroupLinear layers and
// the lm_head) times int8 activations, as llama.cpp's Q8_0 x Q8_0 dot product. Each row's inputs
// are quantized per group of 32 (quantize_group: x ~ d * q), and AVX2's byte multiply-add takes a
// group's 32 code x q products exactly in integers (|q| times the code with q's sign, so that the
// unsigned x signed vpmaddubsw never saturates: 2 * 127 * 127 < 32768), as 8 int32 lanes. Then
//   acc += (scale * d) * float(lanes)
// per group, and the 8 lanes are summed once at the end (hsum8). One row's arithmetic is the same
// in any tile of rows and for any number of rows (batch invariance). Where the float kernel
// (lm_head.cpp) spends a widening, a conversion, a multiply and an FMA per 16 codes, this spends 6
// AVX2 operations per 32.

#include <vector>

#include "kernels.h"

namespace kvserve {

#if KVSERVE_HAS_INT8_ACTIVATIONS
namespace {

constexpr int kRowTile = 4;         // rows sharing each code load
constexpr int64_t kColumnBlock = 64;  // code rows per task
constexpr int64_t kPrefetchAhead = 8;  // code rows ahead to prefetch: a large vocabulary streams from DRAM

// A group's 32 products code * q, summed in 8 int32 lanes of 4.
inline __m256i group_products(__m256i codes, __m256i q) {
  const __m256i magnitude = _mm256_sign_epi8(q, q), signed_codes = _mm256_sign_epi8(codes, q);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_codes), _mm256_set1_epi16(1));
}

// R rows of quantized inputs (xq [R, k], xd [R, k / 32]) times one code row: out[r * ldo].
template <int R>
inline void code_row_times_rows(const int8_t* xq, const float* xd, int64_t k, const int8_t* codes,
                                const float* scales, float* out, int64_t ldo) {
  const int64_t groups = k / kInt8Group;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * kInt8Group));
    for (int r = 0; r < R; ++r) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + g * kInt8Group));
      const __m256 lanes = _mm256_cvtepi32_ps(group_products(c, q));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scales[g] * xd[r * groups + g]), lanes, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum8(acc[r]);
}

}  // namespace

void int8_group_matmul_int8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % kInt8Group == 0,
              "int8_group_matmul_int8: contiguous float32 x [M, K], whole groups of 32");
  const int64_t m = x.size(0), k = x.size(1), v = codes.size(0), groups = k / kInt8Group;
  std::vector<int8_t> xq(m * k);
  std::vector<float> xd(m * groups), xs(m * groups);
  const float* xf = x.data_ptr<float>();
  at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_group(xf + i * kInt8Group, xq.data() + i * kInt8Group, &xd[i], &xs[i]);
    }
  });
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (v + kColumnBlock - 1) / kColumnBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t col = begin * kColumnBlock; col < std::min(end * kColumnBlock, v); ++col) {
      for (int64_t line = 0; col + kPrefetchAhead < v && line < k; line += 64) {
        __builtin_prefetch(c + (col + kPrefetchAhead) * k + line);
      }
      for (int64_t r = 0; r < m; r += kRowTile) {
        const int8_t* rq = xq.data() + r * k;
        const float* rd = xd.data() + r * groups;
        const int8_t* row_codes = c + col * k;
        float* dst = o + r * v + col;
        switch (std::min<int64_t>(kRowTile, m - r)) {
          case 1:
            code_row_times_rows<1>(rq, rd, k, row_codes, s + col * groups, dst, v);
            break;
          case 2:
            code_row_times_rows<2>(rq, rd, k, row_codes, s + col * groups, dst, v);
            break;
          case 3:
            code_row_times_rows<3>(rq, rd, k, row_codes, s + col * groups, dst, v);
            break;
          default:
            code_row_times_rows<4>(rq, rd, k, row_codes, s + col * groups, dst, v);
        }
      }
    }
  });
}
#else
void int8_group_matmul_int8(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&) {
  TORCH_CHECK(false, "int8_group_matmul_int8: this build has no int8 activations (AVX2, F16C and FMA)");
}
#endif

}  // namespace kvserve
