// The lm_head: int8 codes with a scale per group of 32 (GGML's Q8_0 layout, a tied lm_head), or a
// float weight, times float rows, in float32:
//   out[m, v] = sum_k x[m, k] * codes[v, k] * scales[v, k / 32]
// with one arithmetic for every row whatever the number of rows (batch invariance). bfloat16 rows
// may instead take AMX tiles (lm_head_amx.cpp).

#include <vector>

#include "kernels.h"

namespace kvserve {
namespace {

// One row of k codes times its scales (one per 32 codes), as T.
template <typename T>
inline void dequantize_int8_row(const int8_t* codes, const float* scales, int64_t k, T* out) {
  for (int64_t g = 0; g < k / 32; ++g) {
    const float scale = scales[g];
#pragma omp simd
    for (int64_t j = 0; j < 32; ++j) out[g * 32 + j] = weight_from_float<T>(scale * codes[g * 32 + j]);
  }
}

// out[i] = the sum of v[i]'s lanes for kLanes vectors, by one fixed tree per lane whatever else is
// summed beside it (sum_lanes_each where the CPU has it, else sum_lanes).
inline void reduce_lanes_each(const Vec* v, float* out) {
#if KVSERVE_HAS_VEC_FMA
  const Vec sums = sum_lanes_each(v);
  std::memcpy(out, &sums, sizeof(sums));
#else
  for (int64_t i = 0; i < kLanes; ++i) out[i] = sum_lanes(v[i]);
#endif
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
constexpr int64_t kPrefetchRows = 16 * kLmCols;  // how far ahead the single-pass tiles prefetch codes
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
#if defined(__x86_64__) && KVSERVE_HAS_AVX
        asm("" : "+v"(w));  // one load into a register: GCC would otherwise load it again for every row
#endif
      } else {
        if constexpr (std::is_same_v<W, int8_t>) {
          // the code rows a few tiles on: a vocabulary of 262k rows streams from DRAM, which the
          // hardware prefetcher alone leaves half used
          __builtin_prefetch(code_rows[c] + kPrefetchRows * k + i);
        }
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

}  // namespace

// With AMX, bfloat16 inputs from amx_min_rows rows go through the tiles: 1 for batch invariance
// (a row's sums then never depend on how many rows came with it), kAmxMinRows where the float
// kernel is faster for fewer rows.
at::Tensor int8_group_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t amx_min_rows) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1) && codes.size(1) % 32 == 0,
              "int8_group_matmul: x [M, K], codes [V, K] with K a multiple of 32");
  x = x.contiguous();
  at::Tensor out = at::empty({x.size(0), codes.size(0)}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kBFloat16 && x.size(0) >= std::max<int64_t>(1, amx_min_rows) && amx_usable()) {
    int8_group_matmul_amx(x.data_ptr<c10::BFloat16>(), codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                          out.data_ptr<float>(), x.size(0), x.size(1), codes.size(0));
    return out;
  }
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

}  // namespace kvserve
