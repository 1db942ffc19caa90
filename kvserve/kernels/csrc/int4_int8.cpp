// int4 weights (int4_packing.h) times int8 activations. The float kernels (int4_mm.cpp) spend an
// FMA per weight per row: near the CPU's float peak for many rows and bound on unpacking the codes
// for one. Here, as llama.cpp does, each row's inputs are quantized per group of 32 to int8
// (x ~ d * q, d = max|x| / 127, q rounded to nearest even), and AVX2's byte multiply-add
// (vpmaddubsw: 32 code x input products, summed in pairs, per instruction) computes each group's
// sum over code * q exactly in integers. Per group and column:
//   out += (scale * d) * sum_k(code * q) + min * (d * sum_k(q))
// which is the weight (scale * code + min) times the rounded input d * q, as llama.cpp's Q4_1 x Q8_1.
// The integer sums are exact and the float steps per row are the same for one row and for many, so
// a row's result does not depend on the rows batched with it.

#include <array>
#include <utility>
#include <vector>

#include "int4_packing.h"
#include "kernels.h"

namespace kvserve {

#if KVSERVE_HAS_INT8_ACTIVATIONS
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#if KVSERVE_HAS_AMX_INT8
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

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
  for (int64_t g = 0; g < k_len / kInt8Group; ++g) {
    __m256i isum[NV];
    for (int v = 0; v < NV; ++v) isum[v] = _mm256_setzero_si256();
    for (int64_t k0 = g * kInt8Group; k0 < (g + 1) * kInt8Group; k0 += 16) {
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
  for (int v = 0; v < NV; ++v) store8(out + n0 + 8 * v, total[v]);
}

// q8_tile (below) for its main tile, 5 rows x 2 vectors, written out in assembly: GCC keeps some of
// the 10 int16 accumulators on the stack and copies the others between registers every step,
// though they, the 2 code vectors, the broadcast input and 2 products fit AVX2's 16 registers.
// Here the accumulators stay in ymm0-9: per quad of inputs, 2 code loads, 5 broadcasts, 10
// vpmaddubsw and 10 vpaddw; then the group's float step (group_step's arithmetic in the same
// order, so the results are the same bit for bit).
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
  static_assert(kInt8Group == 32, "8 quads per group");
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
  for (int q = 0; q < kInt8Group / 4; ++q) {
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
  const int64_t groups = k_len / kInt8Group;
  __m256 total[R * NT];
  for (int i = 0; i < R * NT; ++i) total[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* xg = xq + r * k_len + g * kInt8Group;
    const float *dg = xd + r * groups + g, *sg = xs + r * groups + g;
    const __m256i* cg = codes + g * (kInt8Group / 4) * NV + v;
    if constexpr (R == 5 && NT == 2) {  // the full tile in assembly
      q8_tile_5x2<NV * 32>(xg, k_len, dg, sg, groups, cg, scale + g * NV + v, min + g * NV + v, total);
    } else {
      q8_tile<R, NT, NV>(xg, k_len, dg, sg, groups, cg, scale + g * NV + v, min + g * NV + v, total);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int t = 0; t < NT; ++t) store8(out + (r + i) * n + n0 + 8 * v + 8 * t, total[i * NT + t]);
  }
}

#if KVSERVE_HAS_VNNI512
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
  const int64_t groups = k_len / kInt8Group;
  __m512 total[R][NT];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) total[i][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R][NT];
    for (int i = 0; i < R; ++i)
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_si512();
    const int8_t* xg = xq + r * k_len + g * kInt8Group;
    for (int q = 0; q < kInt8Group / 4; ++q) {
      const __m256i* cq = codes + (g * (kInt8Group / 4) + q) * NV + v;  // v: the AVX2 vector of the tile's first column
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
    for (int t = 0; t < NT; ++t) store16(out + (r + i) * n + n0 + 8 * v + 16 * t, total[i][t]);
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
  constexpr int kTileRows = 5, kTileVecs = 2;
  const int64_t groups = k_len / kInt8Group;
  scratch(codes, k_len / 4 * NV);
  scratch(scale_min, 2 * groups * NV);
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
#if KVSERVE_HAS_VNNI512
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


#if KVSERVE_HAS_AMX_INT8
constexpr int64_t kAmxInt4Rows = 16;  // from one tile of rows; fewer go through the AVX kernels

// A block's codes (per input 32 bytes: byte i holds column i low, column i + 32 high) in TDPBSUD's B
// layout, per column tile w (columns 16w .. 16w + 15) k_len * 16 bytes: per 4 inputs, 16 columns of
// 4 bytes. With VBMI, one byte permute of 4 inputs' 128 bytes gives tiles 0 and 2 (bytes 0 .. 15,
// low and high nibbles), another tiles 1 and 3 (bytes 16 .. 31).
inline void unpack_int4_block(const uint8_t* block, int64_t k_len, uint8_t* b) {
#if defined(__AVX512VBMI__)
  alignas(64) static const auto order = [] {
    std::array<uint8_t, 128> o{};  // output byte 4c + t: input t's byte c, then 16 + c
    for (int c = 0; c < 16; ++c) {
      for (int t = 0; t < 4; ++t) {
        o[4 * c + t] = static_cast<uint8_t>(32 * t + c);
        o[64 + 4 * c + t] = static_cast<uint8_t>(32 * t + 16 + c);
      }
    }
    return o;
  }();
  const __m512i first_half = _mm512_loadu_si512(order.data()), second_half = _mm512_loadu_si512(order.data() + 64);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t tile = k_len * 16;
  for (int64_t k = 0; k < k_len; k += 4) {
    const __m512i a = _mm512_loadu_si512(block + k * 32), c = _mm512_loadu_si512(block + k * 32 + 64);
    const __m512i p0 = _mm512_permutex2var_epi8(a, first_half, c), p1 = _mm512_permutex2var_epi8(a, second_half, c);
    _mm512_storeu_si512(b + k * 16, _mm512_and_si512(p0, low));
    _mm512_storeu_si512(b + tile + k * 16, _mm512_and_si512(p1, low));
    _mm512_storeu_si512(b + 2 * tile + k * 16, _mm512_and_si512(_mm512_srli_epi16(p0, 4), low));
    _mm512_storeu_si512(b + 3 * tile + k * 16, _mm512_and_si512(_mm512_srli_epi16(p1, 4), low));
  }
#else
  for (int w = 0; w < 4; ++w) {  // columns 16w .. 16w + 15: bytes (w % 2) * 16 .., low nibbles for w < 2
    uint8_t* dst = b + w * k_len * 16;
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t k = 0; k < k_len; k += 4) {
      __m128i a[4];
      for (int t = 0; t < 4; ++t) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (k + t) * 32 + (w % 2) * 16));
        a[t] = _mm_and_si128(w < 2 ? bytes : _mm_srli_epi16(bytes, 4), low);
      }
      const __m128i ab_lo = _mm_unpacklo_epi8(a[0], a[1]), ab_hi = _mm_unpackhi_epi8(a[0], a[1]);
      const __m128i cd_lo = _mm_unpacklo_epi8(a[2], a[3]), cd_hi = _mm_unpackhi_epi8(a[2], a[3]);
      __m128i* o = reinterpret_cast<__m128i*>(dst + k * 16);  // [column][4 inputs] for inputs k .. k + 3
      _mm_storeu_si128(o, _mm_unpacklo_epi16(ab_lo, cd_lo));
      _mm_storeu_si128(o + 1, _mm_unpackhi_epi16(ab_lo, cd_lo));
      _mm_storeu_si128(o + 2, _mm_unpacklo_epi16(ab_hi, cd_hi));
      _mm_storeu_si128(o + 3, _mm_unpackhi_epi16(ab_hi, cd_hi));
    }
  }
#endif
}

// One block of 64 columns (block_n 64) on AMX tiles: its codes unpacked once per call into TDPBSUD's
// B layout (unpack_int4_block), then per column tile of 16 and 16 rows of xq (zero past m), and per
// group, TDPBSUD gives each row's sum over code * q exactly, as the AVX kernels' integer sums, and
// the float step is group_step's, in group order: the same bits. The R live rows' totals stay in
// registers through every group. Software-pipelined, as a tile's sums reach memory only some way
// after its multiply is issued: group g's multiply goes to C tile 0, 3 or 4 (g % 3), then the
// previous group's sums are stored, then group g - 2's float steps run (three buffers).
template <int R>
inline void int4_tile_floats(const int32_t* sums, const float* xd, const float* xs, const float* scales_mins,
                             int64_t groups, int64_t g, __m512* total) {
  const __m512 scale = _mm512_loadu_ps(scales_mins + 128 * g);
  const __m512 min = _mm512_loadu_ps(scales_mins + 128 * g + 64);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    total[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(xd[r * groups + g])),
                               _mm512_cvtepi32_ps(_mm512_load_si512(sums + r * 16)), total[r]);
    total[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * groups + g]), min, total[r]);
  }
}

// (GCC's tile intrinsics paste the tile number into the instruction: literals only, hence a macro.)
#define KVSERVE_INT4_STEP(C, PREVIOUS)                \
  _tile_zero(C);                                      \
  _tile_loadd(1, xq + g * kInt8Group, k_len);         \
  _tile_loadd(2, codes + g * 512, 64);                \
  _tile_dpbsud(C, 1, 2);                              \
  if (g >= 1) _tile_stored(PREVIOUS, c[(g + 2) % 3], 64);

// R rows (of a tile of 16) times one column tile: codes in B layout, scales_mins from its first column.
// ahead: cache lines of the next block's packed codes to fetch into L2 meanwhile, spread over the groups.
template <int R, typename O>
void int4_tile(const int8_t* xq, const float* xd, const float* xs, const uint8_t* codes, const float* scales_mins,
               int64_t k_len, O* out, int64_t n, const uint8_t* ahead, int64_t ahead_lines) {
  const int64_t groups = k_len / kInt8Group, per_group = (ahead_lines + groups - 1) / groups;
  alignas(64) int32_t c[3][256];
  __m512 total[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    switch (g % 3) {
      case 0:
        KVSERVE_INT4_STEP(0, 4)
        break;
      case 1:
        KVSERVE_INT4_STEP(3, 0)
        break;
      default:
        KVSERVE_INT4_STEP(4, 3)
        break;
    }
    if (g >= 2) int4_tile_floats<R>(c[(g + 1) % 3], xd, xs, scales_mins, groups, g - 2, total);
    for (int64_t line = g * per_group; line < std::min(ahead_lines, (g + 1) * per_group); ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * line), _MM_HINT_T1);
    }
  }
  const int64_t last = groups - 1;  // its sums still in a tile; the one before it stored, not stepped
  switch (last % 3) {
    case 0:
      _tile_stored(0, c[0], 64);
      break;
    case 1:
      _tile_stored(3, c[1], 64);
      break;
    default:
      _tile_stored(4, c[2], 64);
      break;
  }
  for (int64_t g = std::max<int64_t>(0, last - 1); g <= last; ++g) {
    int4_tile_floats<R>(c[g % 3], xd, xs, scales_mins, groups, g, total);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) store16(out + r * n, total[r]);
}
#undef KVSERVE_INT4_STEP

// int4_tile for 1 .. 16 rows, by row count.
template <typename O, int... R>
constexpr auto int4_tiles(std::integer_sequence<int, R...>) {
  return std::array{&int4_tile<R + 1, O>...};
}

template <typename S, typename O>
void q8_block_amx(const int8_t* xq, const float* xd, const float* xs, int64_t m, const uint8_t* block,
                  const S* scales_mins, int64_t n, int64_t n0, int64_t k_len, O* out, std::vector<uint8_t>& b,
                  std::vector<float>& sm, const uint8_t* next_block) {
  const int64_t groups = k_len / kInt8Group;
  scratch(b, 4 * k_len * 16);
  scratch(sm, groups * 128);  // the block's scales and mins as float32, side by side per group
  for (int64_t g = 0; g < groups; ++g) {
    for (int v = 0; v < 4; ++v) {
      _mm512_storeu_ps(sm.data() + 128 * g + 16 * v, load16(scales_mins + 2 * g * n + n0 + 16 * v));
      _mm512_storeu_ps(sm.data() + 128 * g + 64 + 16 * v, load16(scales_mins + (2 * g + 1) * n + n0 + 16 * v));
    }
  }
  unpack_int4_block(block, k_len, b.data());
  static constexpr auto tiles = int4_tiles<O>(std::make_integer_sequence<int, 16>{});
  // The next block's codes (32 bytes per input) come from memory while this block's tiles run: its
  // unpack then reads L2, not DRAM. Each of the 4 x row-tile calls fetches an equal share.
  const int64_t calls = 4 * ((m + 15) / 16), lines = next_block != nullptr ? k_len / 2 : 0;
  const int64_t share = (lines + calls - 1) / calls;
  int64_t call = 0;
  for (int w = 0; w < 4; ++w) {
    for (int64_t r0 = 0; r0 < m; r0 += 16, ++call) {
      const int64_t first = std::min(lines, call * share), count = std::min(lines, first + share) - first;
      tiles[std::min<int64_t>(16, m - r0) - 1](xq + r0 * k_len, xd + r0 * groups, xs + r0 * groups,
                                               b.data() + w * k_len * 16, sm.data() + 16 * w, k_len,
                                               out + r0 * n + n0 + 16 * w, n, next_block + 64 * first, count);
    }
  }
}
#endif

template <int NV, typename X, typename S, typename O>
void q8_mm_impl(const X* x, int64_t m, int64_t k_len, const uint8_t* packed, const S* scales_mins, int64_t n,
                O* out) {
  const int64_t groups = k_len / kInt8Group;
  const int64_t padded = (m + 15) / 16 * 16;  // whole tiles of rows for AMX, zero past m
  thread_local std::vector<int8_t> xq_buffer;
  thread_local std::vector<float> xd_buffer, xs_buffer;
  int8_t* const xq = scratch(xq_buffer, padded * k_len);
  std::fill(xq + m * k_len, xq + padded * k_len, 0);
  float* const xd = scratch(xd_buffer, m * groups);
  float* const xs = scratch(xs_buffer, m * groups);
  at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_group(x + i * kInt8Group, xq + i * kInt8Group, &xd[i], &xs[i]);
    }
  });
  constexpr int64_t block_n = NV * 8;
#if KVSERVE_HAS_AMX_INT8
  if (block_n == 64 && m >= kAmxInt4Rows && amx_usable()) {
    // Blocks that do not split evenly over the threads (a 576-wide layer: 9) are split by rows too
    // where there are many (a prefill), in whole tiles, one part per thread: each part unpacks its
    // block's codes again, which costs more than the balance gains for a few tiles of rows.
    const int64_t blocks = n / block_n, threads = at::get_num_threads(), tiles = padded / 16;
    const int64_t parts = blocks % threads == 0 || tiles < 16 ? 1 : threads;
    const int64_t part_rows = (tiles + parts - 1) / parts * 16;
    at::parallel_for(0, blocks * parts, 1, [&](int64_t begin, int64_t end) {
      load_int8_tile_config();
      thread_local std::vector<uint8_t> b;  // kept per worker: no allocation or zero fill per call
      thread_local std::vector<float> sm;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t blk = task / parts, r0 = task % parts * part_rows, rows = std::min(part_rows, m - r0);
        if (rows <= 0) continue;
        const int64_t next = task + 1 < end ? (task + 1) / parts : -1;  // this thread's next block, if any
        q8_block_amx(xq + r0 * k_len, xd + r0 * groups, xs + r0 * groups, rows,
                     packed + blk * (block_n / 2) * k_len, scales_mins, n, blk * block_n, k_len, out + r0 * n, b, sm,
                     next >= 0 && next != blk ? packed + next * (block_n / 2) * k_len : nullptr);
      }
      _tile_release();
    });
    return;
  }
#endif
  parallel_tasks(n / block_n, m, [&](int64_t b) {
    thread_local std::vector<__m256i> codes;
    thread_local std::vector<__m256> scale_min;
    const uint8_t* block = packed + b * (block_n / 2) * k_len;
    if (m == 1) {
      q8_block_one<NV>(xq, xd, xs, block, scales_mins, n, b * block_n, k_len, out);
    } else {
      q8_block_many<NV>(xq, xd, xs, m, block, scales_mins, n, b * block_n, k_len, out, codes, scale_min);
    }
  });
}

}  // namespace

void int4_int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_mins, int64_t n,
                  int64_t block_n, at::Tensor& out) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous() &&
                  x.size(1) % kInt8Group == 0,
              "int4_int8_mm: contiguous float32 or bfloat16 x [M, K], whole groups");
  TORCH_CHECK(block_n == 32 || block_n == 64, "int4_int8_mm: blocks of 32 or 64 rows");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  with_scales_mins(scales_mins, [&](auto* sm) {
    with_compute_type(x.scalar_type(), [&](auto input) {
      using X = decltype(input);
      with_compute_type(out.scalar_type(), [&](auto compute) {
        using O = decltype(compute);
        if (block_n == 32) {
          q8_mm_impl<4>(x.data_ptr<X>(), x.size(0), x.size(1), w, sm, n, out.data_ptr<O>());
        } else {
          q8_mm_impl<8>(x.data_ptr<X>(), x.size(0), x.size(1), w, sm, n, out.data_ptr<O>());
        }
      });
    });
  });
}
#else
void int4_int8_mm(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, at::Tensor&) {
  TORCH_CHECK(false, "int4_int8_mm: this build has no int8 activations (AVX2, F16C and FMA)");
}
#endif

}  // namespace kvserve
