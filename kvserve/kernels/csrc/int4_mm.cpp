// int4 weights (int4_packing.h) times float inputs: int4_mm for a few rows (decode), and the
// dequantized weight for a GEMM over many rows (prefill, large batches), where a GEMM that reuses
// each weight for every row beats a weight-only kernel that re-reads it per row.
//
// PyTorch's int4 CPU kernel is slow on AVX2 and unpacks the weight again for every row; int4_mm
// unpacks each 4-bit code once per call and multiplies it into every row of x from registers.
// With w = code * scale + min per group, a group's sum is scale * sum_k x[k] code[k] +
// min * sum_k x[k]: the inner loop converts codes to float and multiply-adds, nothing more.
// GCC/Clang vector extensions keep it portable.

#include <vector>

#include "int4_packing.h"
#include "kernels.h"

namespace kvserve {
namespace {

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
      for (int v = 0; v < NV; ++v) {
        total[r][v] = int4_group_total(total[r][v], scale[v], acc[0][r][v], acc[1][r][v], xs, min[v]);
      }
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

// The sum of a group's inputs by one fixed order: kLanes at a time into one vector, then its lanes
// in order (sequentially for a group smaller than a vector).
template <typename T>
inline float group_sum(const T* x, int64_t size) {
  if (size % kLanes != 0) {
    float total = 0.f;
    for (int64_t j = 0; j < size; ++j) total += to_float(x[j]);
    return total;
  }
  Vec acc = load_floats(x);
  for (int64_t j = kLanes; j < size; j += kLanes) acc += load_floats(x + j);
  return sum_lanes(acc);
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

#if KVSERVE_HAS_AVX512_BF16
// bfloat16 inputs on AVX512-BF16: vdpbf16ps multiplies a pair of inputs (k, k+1) by the pair of
// codes of 16 columns and adds both products to their float32 lanes, twice the multiply-adds per
// instruction of float FMAs. The codes 0..15 are exact in bfloat16, and so are the products
// (8-bit significands), so the only roundings are the float32 sums, in one fixed order per group:
// pair 0, 1, ... of the group, then the group's scale and min as int4_group_total does. Every row
// count goes through the same tile, so a row's result is the same bits whatever rows are beside it.

// The bfloat16 bit patterns of 0..15, indexed by code (vpermw's table; the upper 16 unused).
inline __m512i bf16_code_table() {
  return _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130,
                          0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
}

// The codes of inputs k (row0) and k + 1 (row1) of a block of NV vectors of columns, as bfloat16
// pairs: vector v's lane j holds (w[k][c], w[k + 1][c]) for column c = v * kLanes + j. Each 16 bytes
// of a row hold 16 columns in their low nibbles and the 16 columns half a block later in the high.
template <int NV>
inline void unpack_pair_bf16(const uint8_t* row0, const uint8_t* row1, __m512i table, __m512i* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < NV / 2; ++c) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row0 + 16 * c));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row1 + 16 * c));
    const __m256i pairs = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
    const __m256i low = _mm256_and_si256(pairs, nibble);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(pairs, 4), nibble);
    out[c] = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(low), table);
    out[c + NV / 2] = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(high), table);
  }
}

// One group of R rows times NT of a block's NV vectors of columns: x bfloat16 bits [R, ldx] from
// the group's first input, codes [pairs, NV] from the tile's first vector (as scale, min, total).
template <int NV, int NT, int R>
inline void int4_bf16_tile(const uint16_t* x, int64_t ldx, const float* xsum, int64_t ldxs, const __m512i* codes,
                           int64_t pairs, const Vec* scale, const Vec* min, Vec* total) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NT; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NT];
    for (int v = 0; v < NT; ++v) b[v] = reinterpret_cast<__m512bh>(codes[p * NV + v]);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int v = 0; v < NT; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const Vec xs = splat(xsum[r * ldxs]);
    for (int v = 0; v < NT; ++v) {
      total[r * NV + v] += fused_multiply_add(scale[v], reinterpret_cast<Vec>(acc[r][v]), xs * min[v]);
    }
  }
}

// One or two rows (decode of one or two streams) times one block, the codes unpacked into
// registers and used at once: the same sums in the same order as the tiles below.
template <int NV, int R, typename S, typename O>
void int4_bf16_block_few(const uint16_t* x, const float* xsum, const uint8_t* block, const S* scales_mins,
                         int64_t n, int64_t n0, int64_t k_len, int64_t group_size, O* out) {
  constexpr int64_t half = NV * kLanes / 2;
  const int64_t groups = k_len / group_size, pairs = group_size / 2;
  const __m512i table = bf16_code_table();
  Vec total[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) total[r][v] = Vec{};
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[R][NV];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < pairs; ++p) {
      const uint8_t* row = block + (g * group_size + 2 * p) * half;
      __m512i codes[NV];
      unpack_pair_bf16<NV>(row, row + half, table, codes);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * k_len + g * group_size + 2 * p, sizeof(pair));
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, reinterpret_cast<__m512bh>(codes[v]));
      }
    }
    Vec scale[NV], min[NV];
    group_scale_min<NV>(scales_mins, g, n, n0, scale, min);
    for (int r = 0; r < R; ++r) {
      const Vec xs = splat(xsum[r * groups + g]);
      for (int v = 0; v < NV; ++v) {
        total[r][v] += fused_multiply_add(scale[v], reinterpret_cast<Vec>(acc[r][v]), xs * min[v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float lanes[NV * kLanes];
    std::memcpy(lanes, total[r], sizeof(lanes));
    for (int64_t j = 0; j < NV * kLanes; ++j) out[r * n + n0 + j] = from_float<O>(lanes[j]);
  }
}

// All m rows times one block: each group's codes are unpacked once into `codes` (NV KB at most),
// then multiplied into tiles of 6 rows x 4 vectors (24 accumulators of the 32 registers).
template <int NV, typename S, typename O>
void int4_bf16_block(const uint16_t* x, int64_t m, const float* xsum, const uint8_t* block, const S* scales_mins,
                     int64_t n, int64_t n0, int64_t k_len, int64_t group_size, O* out, std::vector<__m512i>& codes,
                     std::vector<Vec>& total) {
  constexpr int64_t half = NV * kLanes / 2;
  constexpr int kTileVecs = NV < 4 ? NV : 4, kTileRows = 6;
  const int64_t groups = k_len / group_size, pairs = group_size / 2;
  const __m512i table = bf16_code_table();
  codes.resize(pairs * NV);
  total.assign(m * NV, Vec{});
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t p = 0; p < pairs; ++p) {
      const uint8_t* row = block + (g * group_size + 2 * p) * half;
      unpack_pair_bf16<NV>(row, row + half, table, &codes[p * NV]);
    }
    Vec scale[NV], min[NV];
    group_scale_min<NV>(scales_mins, g, n, n0, scale, min);
    for (int64_t r = 0; r < m; r += kTileRows) {
      const uint16_t* xr = x + r * k_len + g * group_size;
      const float* xs = xsum + r * groups + g;
      for (int v = 0; v < NV; v += kTileVecs) {
        const __m512i* c = codes.data() + v;
        Vec* t = total.data() + r * NV + v;
        switch (std::min<int64_t>(kTileRows, m - r)) {
#define KVSERVE_ROWS(R)                                                                                  \
  case R:                                                                                                \
    int4_bf16_tile<NV, kTileVecs, R>(xr, k_len, xs, groups, c, pairs, scale + v, min + v, t); \
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
void int4_bf16_impl(const uint16_t* x, const float* xsum, int64_t m, int64_t k_len, const uint8_t* packed,
                    const S* scales_mins, int64_t n, int64_t group_size, O* out) {
  constexpr int64_t block_n = NV * kLanes;
  // Work items are (block, chunk of rows): with 9 blocks (576 outputs) one thread would otherwise
  // get 5 and the other 4. A row's sums do not depend on its chunk.
  const int64_t blocks = n / block_n, threads = at::get_num_threads();
  const int64_t chunks = m >= 12 && blocks % threads != 0 && blocks < 8 * threads ? 2 : 1;
  const int64_t chunk_rows = chunks == 1 ? m : (m + 11) / 12 * 6;  // halves in whole tiles of 6 rows
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> codes;
    std::vector<Vec> total;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / chunks, r0 = item % chunks * chunk_rows, rows = std::min(chunk_rows, m - r0);
      const uint8_t* block = packed + b * (block_n / 2) * k_len;
      const uint16_t* xr = x + r0 * k_len;
      const float* xs = xsum + r0 * (k_len / group_size);
      O* o = out + r0 * n;
      if (rows == 1) {
        int4_bf16_block_few<NV, 1>(xr, xs, block, scales_mins, n, b * block_n, k_len, group_size, o);
      } else if (rows == 2) {
        int4_bf16_block_few<NV, 2>(xr, xs, block, scales_mins, n, b * block_n, k_len, group_size, o);
      } else if (rows > 0) {
        int4_bf16_block<NV>(xr, rows, xs, block, scales_mins, n, b * block_n, k_len, group_size, o, codes, total);
      }
    }
  });
}
#endif

template <typename S, typename T>
void dequantize_int4_impl(const uint8_t* packed, const S* scales_mins, T* out, int64_t n, int64_t k,
                          int64_t group_size, int64_t block_n) {
  // The transposed weight [K, N]: every store and every byte load is contiguous.
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

}  // namespace

at::Tensor int4_mm(at::Tensor x, at::Tensor packed, at::Tensor scales_mins, int64_t n, int64_t group_size,
                   int64_t block_n, bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % group_size == 0 && n % block_n == 0 && group_size % 2 == 0,
              "int4_mm: x [M, K], whole groups of an even size");
  TORCH_CHECK(block_n % (2 * kLanes) == 0 && block_n / kLanes <= 8, "int4_mm: unsupported block of ", block_n, " rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int4_mm runs in float32 or bfloat16");
  x = x.contiguous();
  const int64_t m = x.size(0), k_len = x.size(1), groups = k_len / group_size;
  at::Tensor out = at::empty({m, n}, x.options());
  if (kInt8Activations && int8_activations && group_size == kInt8Group && (block_n == 32 || block_n == 64)) {
    int4_int8_mm(x, packed, scales_mins, n, block_n, out);  // x float32 or bfloat16, quantized as it is
    return out;
  }
  // [M, K / g]: each group summed by one fixed order (kLanes at a time, then the lanes in order),
  // whatever the number of rows; rows in parallel (a serial loop here was a tenth of a 64-row step).
  at::Tensor xsum = at::empty({m, groups}, x.options().dtype(at::kFloat));
  float* sums = xsum.data_ptr<float>();
  with_compute_type(x.scalar_type(), [&](auto compute) {
    using T = decltype(compute);
    const T* xp = x.data_ptr<T>();
    at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * groups; i < end * groups; ++i) sums[i] = group_sum(xp + i * group_size, group_size);
    });
  });
  const uint8_t* w = packed.data_ptr<uint8_t>();
#if KVSERVE_HAS_AVX512_BF16
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    with_scales_mins(scales_mins, [&](auto* sm) {
      at::BFloat16* o = out.data_ptr<at::BFloat16>();
      switch (block_n / kLanes) {
        case 2: int4_bf16_impl<2>(xb, sums, m, k_len, w, sm, n, group_size, o); break;
        case 4: int4_bf16_impl<4>(xb, sums, m, k_len, w, sm, n, group_size, o); break;
        default: int4_bf16_impl<8>(xb, sums, m, k_len, w, sm, n, group_size, o); break;
      }
    });
    return out;
  }
#endif
  at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  with_scales_mins(scales_mins, [&](auto* sm) {
    with_compute_type(x.scalar_type(), [&](auto compute) {
      using O = decltype(compute);
      O* o = out.data_ptr<O>();
      switch (block_n / kLanes) {
        case 2: int4_mm_impl<2>(xp, sums, m, k_len, w, sm, n, group_size, o); break;
        case 4: int4_mm_impl<4>(xp, sums, m, k_len, w, sm, n, group_size, o); break;
        default: int4_mm_impl<8>(xp, sums, m, k_len, w, sm, n, group_size, o); break;
      }
    });
  });
  return out;
}

at::Tensor dequantize_int4(at::Tensor packed, at::Tensor scales_mins, int64_t n, int64_t k, int64_t group_size,
                           int64_t block_n, at::ScalarType dtype) {
  TORCH_CHECK(n % block_n == 0 && k % group_size == 0, "dequantize_int4 takes whole blocks of rows");
  at::Tensor out = at::empty({k, n}, packed.options().dtype(dtype));
  with_scales_mins(scales_mins, [&](auto* sm) {
    with_compute_type(dtype, [&](auto compute) {
      using T = decltype(compute);
      dequantize_int4_impl(packed.data_ptr<uint8_t>(), sm, out.data_ptr<T>(), n, k, group_size, block_n);
    });
  });
  return out;
}

}  // namespace kvserve
