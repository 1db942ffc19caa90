// int8 codes with a scale per group of 32 (GGML's Q8_0 and Q5_0, and types rounded to it) times int8
// activations, from the codes stored 16 output rows x 4 inputs interleaved, so that on AVX512-VNNI one
// vpdpbusd multiplies the four codes of 16 output rows (its unsigned operand) by four inputs (signed)
// and adds the four products to each row's int32 lane (on AVX2: vpmaddubsw and vpmaddwd per half of
// the rows, the same sums; see the AVX2 section). Per 16-row vector and group of 32 inputs the
// codes are eight such 64-byte vectors (j = 0..7: inputs 4j..4j+3 of the group), held in one of two
// widths:
//   8 bits: quads [V / 16, K / 4, 16, 4] uint8, each code + 128 (as many bytes as row-major codes);
//   5 bits: quads [V / 16, K / 32, 320] uint8 for codes in -16..15 (GGML's Q5_0), each code + 16:
//     bytes 0..255 four 64-byte vectors of nibbles, vector t holding vector 2t's low 4 bits in its
//     low nibble and vector 2t + 1's in its high one; bytes 256..319 a 64-byte plane of fifth bits,
//     byte i's bit j the fifth bit of vector j's byte i, so that one shift of the plane puts vector
//     j's at bit 4 of every byte (as many bytes as GGML's blocks hold the codes);
// and quad_scales [V / 16, K / 32, 16] float32, or float16 where the file's scales are (Q8_0, Q5_0).
// GGML's Q6_K (6-bit codes, a scale per 16 inputs) has a form of its own further below (k6_matmul).
// So do GGML's Q5_1 and Q5_K (5-bit codes with a scale and a min per group: min5_matmul).
// Each row's inputs are quantized per group of 32 as int8_group_matmul_int8 quantizes them
// (quantize_group: x ~ d * q); the offset of the codes (128 or 16) adds offset * sum(q) to a group's
// sum, which starts from -offset * sum(q) (one value per input row and group): a group's 32 products
// code * q are summed exactly in integers, the same integer in either width. Per group then
//   total = fma(float(sum), scale * d, total)
// in group order: every row count runs this one order (tiles of rows over each block's codes, read
// once per group for all of a tile's rows), so a row's result is the same bits whatever rows are
// beside it, and the same in either width. Row-major codes take a float step per row, group and
// output row (int8_int8.cpp); this layout takes one per 8 vpdpbusd, 16 outputs at a time
// (bench/kernels.py: 2.5x for one row, 4-5x from 16 rows on AVX512-VNNI; 1.2-1.8x for one row and
// 1.3-1.7x from 16 on AVX2).
// With AMX (int8 tiles), from kAmxQuadRows rows: a group's eight code vectors are exactly the B tile
// of TDPBSUD (8 rows of 16 outputs x 4 inputs), read from the weight as held (8 bits) or unpacked once
// per call (5 bits), and 16 rows of q the A tile; one instruction sums a group for 16 rows x 16
// outputs in int32, the offset's start is added, and the float step is the VNNI kernel's, per row of
// 16 outputs in group order: the same integers and the same float operations, so the same bits.

#include <type_traits>
#include <vector>

#include "kernels.h"

namespace kvserve {

bool int8_quads_usable() { return KVSERVE_HAS_INT8_ACTIVATIONS; }

#if KVSERVE_HAS_INT8_ACTIVATIONS
namespace {

constexpr int64_t kQuadBlock = 4;  // 16-row vectors per task: 64 output rows

// ----- 6 bits with K-quant scales (GGML's Q6_K) ---------------------------------------------------
// quads [V / 16, K / 32, 384]: per group the 5-bit layout's four nibble vectors, then two 64-byte
// vectors of crumbs (vector u's byte i, bits 2t and 2t + 1: bits 4 and 5 of code vector 4u + t's byte
// i), each code + 32; kscales [V / 16, K / 256, 288] uint8: per block of 256 inputs an int8 scale per
// 16 inputs and row ([16 sub-blocks][16 rows]), then the block's float16 scale per row. A code's
// weight is d * scale * (code - 32), as GGML dequantizes it; each 16 inputs are summed in int32 from
// -32 * sum(q) over them and take their float step: two per group, in input order.
constexpr int64_t kK6Bytes = 384, kK6ScaleBytes = 288;

// ----- 5 or 4 bits with a min per group (GGML's Q5_1 and Q5_K; Q4_0, Q4_1 and Q4_K) ---------------
// quads [V / 16, K / 32, 320]: the 5-bit layout, each code as GGML's 0..31 (no offset), or
// [V / 16, K / 32, 256]: its four nibble vectors alone, codes 0..15 (GGML's Q4_0 and Q4_1 with Q5_1's
// form of scales, Q4_0's code - 8 as min = -8 * scale; Q4_K with Q5_K's), and either
//   Q5_1: scales [V / 16, K / 32, 2, 16] float16, per group the 16 rows' scales, then their mins:
//     w = scale * code + min (6 bits a weight, as the file);
//   Q5_K: scales [V / 16, K / 256, 320] uint8, per block of 256 inputs the 6-bit scales [8 groups][16
//     rows] and mins [8][16] a byte each, then the rows' float16 d [16] and dmin [16]:
//     w = (d * scale) * code - dmin * min, as GGML dequantizes it (5.625 bits a weight, the file 5.5).
// A group's sum over code * q is exact in int32 (no offset to undo), and its float step is the int4
// kernels' (int4_int8.cpp group_step): total = fma(scale * d, float(sum), total), then
// total = fma(s, min, total), s = d * sum(q) from quantize_group, so the min meets the rounded inputs.
// vpdpbusd, and from 16 rows AMX tiles where usable (min5_matmul_amx): the same integer sums and float
// steps in one order, so the same bits whatever rows are beside a row. These are also the integer sums
// and float steps of int4_int8.cpp's kernels, in the same order: a 4-bit layer held so gives the bits
// of the same codes, scales and mins packed for int4_mm, without rearranging the codes on each call.
constexpr int64_t kMin5Bytes = 320, kMin4Bytes = 256, kK5ScaleBytes = 320;

#if KVSERVE_HAS_VNNI512
constexpr int kQuadTileRows = 8;  // 8 code vectors, 8 int32 and 8 float accumulators of 32 registers
constexpr int32_t kEightOffset = 128;  // vpdpbusd takes the 8-bit codes as held: code + 128, unsigned

// The four nibble vectors at `block` (the 5- and 6-bit layouts): vector t's low nibbles are the low 4
// bits of code vector 2t, its high nibbles those of vector 2t + 1.
inline void load_nibbles(const uint8_t* block, __m512i* codes) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int t = 0; t < 4; ++t) {
    const __m512i nibbles = _mm512_loadu_si512(block + t * 64);
    codes[2 * t] = _mm512_and_si512(nibbles, low);
    codes[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low);
  }
}

// Every byte of `v` shifted so that its bit `bit` lands at bit 4 (bit + 1 at bit 5): a 16-bit shift by at
// most 4, so bits 4 and 5 of each byte come from that byte. The callers mask the rest away.
inline __m512i at_bit4(__m512i v, int bit) {
  return bit <= 4 ? _mm512_slli_epi16(v, 4 - bit) : _mm512_srli_epi16(v, bit - 4);
}

// Group g's eight code vectors of one 16-row vector, each byte a code plus its offset.
template <int Bits>
inline void load_codes(const uint8_t* quads, int64_t g, __m512i* codes) {
  if constexpr (Bits == 8) {
    for (int j = 0; j < 8; ++j) codes[j] = _mm512_loadu_si512(quads + (g * 8 + j) * 64);
  } else if constexpr (Bits == 4) {
    load_nibbles(quads + g * kMin4Bytes, codes);
  } else {
    const uint8_t* block = quads + g * 320;
    const __m512i fifth = _mm512_set1_epi8(0x10), plane = _mm512_loadu_si512(block + 256);
    load_nibbles(block, codes);
    for (int j = 0; j < 8; ++j) {
      // codes | (plane's bit j moved to bit 4 & 0x10): 0xF8 is A | (B & C)
      codes[j] = _mm512_ternarylogic_epi32(codes[j], at_bit4(plane, j), fifth, 0xF8);
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
// [K / 32, 16]; first_row the tile's first row among the call's (the AVX2 tiles share unpacked codes).
template <int R, int Bits, typename S>
inline void quad_tile(const int8_t* q, const float* d, const int32_t* start, int64_t k, const uint8_t* quads,
                      const S* scales, float* out, int64_t ldo, int64_t cols, int64_t /*first_row*/) {
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
  for (int r = 0; r < R; ++r) store_outputs(out + r * ldo, total[r], cols);
}

inline void load_codes6(const uint8_t* quads, int64_t g, __m512i* codes) {
  const uint8_t* block = quads + g * kK6Bytes;
  const __m512i high = _mm512_set1_epi8(0x30);
  load_nibbles(block, codes);
  for (int u = 0; u < 2; ++u) {
    const __m512i crumbs = _mm512_loadu_si512(block + 256 + u * 64);
    for (int t = 0; t < 4; ++t) {
      // codes | (crumbs' bits 2t, 2t + 1 moved to bits 4, 5 & 0x30): 0xF8 is A | (B & C)
      codes[4 * u + t] = _mm512_ternarylogic_epi32(codes[4 * u + t], at_bit4(crumbs, 2 * t), high, 0xF8);
    }
  }
}

// R rows x one 16-row vector: start2 [R, k / 32, 2] -32 x each half group's sum of q.
template <int R>
inline void k6_tile(const int8_t* q, const float* d, const int32_t* start2, int64_t k, const uint8_t* quads,
                    const uint8_t* kscales, float* out, int64_t ldo, int64_t cols, int64_t /*first_row*/) {
  const int64_t groups = k / 32;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i codes[8];
    load_codes6(quads, g, codes);
    const uint8_t* ks = kscales + (g / 8) * kK6ScaleBytes;
    const __m512 block_scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ks + 256)));
    __m512 scale[2];
    for (int h = 0; h < 2; ++h) {
      const __m128i sub = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ks + ((g % 8) * 2 + h) * 16));
      scale[h] = _mm512_mul_ps(block_scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub)));
    }
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        __m512i sum = _mm512_set1_epi32(start2[(r * groups + g) * 2 + h]);
        for (int j = 4 * h; j < 4 * h + 4; ++j) {
          int32_t four;  // inputs 4j .. 4j + 3 of the group
          std::memcpy(&four, q + r * k + g * 32 + 4 * j, sizeof(four));
          sum = _mm512_dpbusd_epi32(sum, codes[j], _mm512_set1_epi32(four));
        }
        total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                   _mm512_mul_ps(scale[h], _mm512_set1_ps(d[r * groups + g])), total[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_outputs(out + r * ldo, total[r], cols);
}

// Group g's scales and mins for one 16-row vector, as float32 (Q5_K's products d * scale and
// -(dmin * min) exact: an 11-bit mantissa times a 6-bit integer).
template <bool KQuant>
inline void min5_scales(const uint8_t* scales, int64_t g, __m512& scale, __m512& min) {
  if constexpr (KQuant) {
    const uint8_t* ks = scales + (g / 8) * kK5ScaleBytes;
    const auto bytes = [&](int64_t at) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ks + at))));
    };
    const auto halves = [&](int64_t at) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ks + at)));
    };
    scale = _mm512_mul_ps(halves(256), bytes((g % 8) * 16));
    min = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(halves(288), bytes(128 + (g % 8) * 16)));
  } else {
    const uint8_t* h = scales + g * 64;
    scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
    min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32)));
  }
}

// One group's float step for a row's 16 outputs: total = fma(scale * d, float(sum), total), then
// total = fma(s, min, total); every row count takes it in group order.
inline __m512 min5_step(__m512 total, __m512i sum, __m512 scale, __m512 min, float d, float s) {
  total = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(d)), _mm512_cvtepi32_ps(sum), total);
  return _mm512_fmadd_ps(_mm512_set1_ps(s), min, total);
}

// R rows x one 16-row vector over all groups: s [R, k / 32] d * sum(q) of each row's group. Bits: 5 or 4.
template <int R, int Bits, bool KQuant>
inline void min5_tile(const int8_t* q, const float* d, const float* s, int64_t k, const uint8_t* quads,
                      const uint8_t* scales, float* out, int64_t ldo, int64_t cols, int64_t /*first_row*/) {
  const int64_t groups = k / 32;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i codes[8];
    load_codes<Bits>(quads, g, codes);
    __m512 scale, min;
    min5_scales<KQuant>(scales, g, scale, min);
    for (int r = 0; r < R; ++r) {
      __m512i sum = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        int32_t four;  // inputs 4j .. 4j + 3 of the group
        std::memcpy(&four, q + r * k + g * 32 + 4 * j, sizeof(four));
        sum = _mm512_dpbusd_epi32(sum, codes[j], _mm512_set1_epi32(four));
      }
      total[r] = min5_step(total[r], sum, scale, min, d[r * groups + g], s[r * groups + g]);
    }
  }
  for (int r = 0; r < R; ++r) store_outputs(out + r * ldo, total[r], cols);
}

// 4-bit codes, from kPairTileFromRows rows: R rows x two 16-row vectors (the second at `next` bytes of codes
// and `next_scales` of scales from the first), as int4_int8.cpp's q8_rows_vnni takes them: each nibble
// vector is unpacked once for all R rows and each row's four inputs broadcast once for both vectors
// (min5_tile broadcasts them per vector: one broadcast per vpdpbusd). min5_tile's integer sums and float
// steps in its order, so the same bits. Registers: 2R sums, 2R totals, 4 code vectors, 2 inputs.
constexpr int kPairTileFromRows = 2, kMin4TileRows = 6;
template <int R, bool KQuant>
inline void min4_pair_tile(const int8_t* q, const float* d, const float* s, int64_t k, const uint8_t* quads,
                           int64_t next, const uint8_t* scales, int64_t next_scales, float* out, int64_t ldo,
                           int64_t cols) {
  const int64_t groups = k / 32;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {  // nibble vector t: code vectors 2t (low nibbles) and 2t + 1 (high)
      __m512i codes[2][2];
      for (int v = 0; v < 2; ++v) {
        const __m512i nibbles = _mm512_loadu_si512(quads + v * next + g * kMin4Bytes + t * 64);
        codes[v][0] = _mm512_and_si512(nibbles, low);
        codes[v][1] = _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        for (int h = 0; h < 2; ++h) {
          int32_t four;  // inputs 4j .. 4j + 3 of the group, j = 2t + h
          std::memcpy(&four, q + r * k + g * 32 + 8 * t + 4 * h, sizeof(four));
          const __m512i inputs = _mm512_set1_epi32(four);
          sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], codes[0][h], inputs);
          sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], codes[1][h], inputs);
        }
      }
    }
    for (int v = 0; v < 2; ++v) {
      __m512 scale, min;
      min5_scales<KQuant>(scales + v * next_scales, g, scale, min);
      for (int r = 0; r < R; ++r) {
        total[r][v] = min5_step(total[r][v], sum[r][v], scale, min, d[r * groups + g], s[r * groups + g]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    store_outputs(out + r * ldo, total[r][0], 16);
    store_outputs(out + r * ldo + 16, total[r][1], cols);
  }
}

// 8-bit codes, from kPairTileFromRows rows: R rows x two 16-row vectors, as min4_pair_tile takes the 4-bit
// codes (each code vector loaded once for all R rows, each row's four inputs broadcast once for both
// vectors). quad_tile's integer sums, from `start`, and its float step in its order: the same bits.
// (For 5 bits this measured slower than quad_tile: unpacking a group's codes per tile of 5 rows instead
// of 8 cost more than the broadcasts saved.)
constexpr int kQuadPairRows = 6;
template <int R, typename S>
inline void quad_pair_tile(const int8_t* q, const float* d, const int32_t* start, int64_t k, const uint8_t* quads,
                           int64_t next, const S* scales, int64_t next_scales, float* out, int64_t ldo,
                           int64_t cols) {
  const int64_t groups = k / 32;
  __m512 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_set1_epi32(start[r * groups + g]);
    for (int j = 0; j < 8; ++j) {  // inputs 4j .. 4j + 3 of the group
      const __m512i codes0 = _mm512_loadu_si512(quads + (g * 8 + j) * 64);
      const __m512i codes1 = _mm512_loadu_si512(quads + next + (g * 8 + j) * 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, q + r * k + g * 32 + 4 * j, sizeof(four));
        const __m512i inputs = _mm512_set1_epi32(four);
        sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], codes0, inputs);
        sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], codes1, inputs);
      }
    }
    for (int v = 0; v < 2; ++v) {
      const __m512 scale = load_scales(scales + v * next_scales + g * 16);
      for (int r = 0; r < R; ++r) {
        total[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][v]),
                                      _mm512_mul_ps(scale, _mm512_set1_ps(d[r * groups + g])), total[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    store_outputs(out + r * ldo, total[r][0], 16);
    store_outputs(out + r * ldo + 16, total[r][1], cols);
  }
}
#else
// ----- AVX2 (no VNNI): the same integer sums and float steps, so the same bits ----------------------
// A 16-row code vector is two 256-bit halves (rows 0-7, rows 8-15), each row's 4 inputs one int32
// lane. vpdpbusd's four products per lane are vpmaddubsw (unsigned code x signed q, pairs summed
// into int16) then vpmaddwd by ones (pairs summed into int32). vpmaddubsw saturates, so:
// - the 5- and 6-bit codes (0..63) go in as they are; their int16 pair sums stay below 2 x 63 x 127,
//   so 4 (5 bits) or 2 (6 bits) vectors' pair sums are added before widening;
// - the 8-bit codes are made signed (the layout's + 128 undone) and go in as |code| against q with
//   the code's sign (2 x 128 x 127 < 32768), llama.cpp's way; their offset is then 0 (kEightOffset).
// Every sum is exact, so it is the same integer as vpdpbusd's, and the float steps are the same
// operations per lane in the same order.
constexpr int kQuadTileRows = 4;  // from this many rows a vector's groups are unpacked once (run_tile)
constexpr int32_t kEightOffset = 0;  // the 8-bit codes made signed as they are loaded

using Half = __m256i;    // 8 rows x 4 inputs of one code vector, or 8 int32 lanes
using Halves = Half[2];  // one code vector: rows 0-7, 8-15

// Bit `bit` of every byte of `v` moved to bit 4 (at_bit4 on AVX-512).
inline __m256i at_bit4(__m256i v, int bit) {
  return bit <= 4 ? _mm256_slli_epi16(v, 4 - bit) : _mm256_srli_epi16(v, bit - 4);
}

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The four nibble vectors at `block` (the 5- and 6-bit layouts), as load_nibbles on AVX-512.
inline void load_nibbles(const uint8_t* block, Halves* codes) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int t = 0; t < 4; ++t) {
    for (int h = 0; h < 2; ++h) {
      const __m256i nibbles = load256(block + t * 64 + h * 32);
      codes[2 * t][h] = _mm256_and_si256(nibbles, low);
      codes[2 * t + 1][h] = _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), low);
    }
  }
}

// Group g's eight code vectors: 8 bits signed (code), 5 and 4 bits as held (code + 16, 0..31 or 0..15).
template <int Bits>
inline void load_codes(const uint8_t* quads, int64_t g, Halves* codes) {
  if constexpr (Bits == 8) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int j = 0; j < 8; ++j) {
      for (int h = 0; h < 2; ++h) codes[j][h] = _mm256_xor_si256(load256(quads + (g * 8 + j) * 64 + h * 32), flip);
    }
  } else if constexpr (Bits == 4) {
    load_nibbles(quads + g * kMin4Bytes, codes);
  } else {
    const uint8_t* block = quads + g * 320;
    const __m256i fifth = _mm256_set1_epi8(0x10);
    load_nibbles(block, codes);
    for (int h = 0; h < 2; ++h) {
      const __m256i plane = load256(block + 256 + 32 * h);
      for (int j = 0; j < 8; ++j) codes[j][h] = _mm256_or_si256(codes[j][h], _mm256_and_si256(at_bit4(plane, j), fifth));
    }
  }
}

inline void load_codes6(const uint8_t* quads, int64_t g, Halves* codes) {
  const uint8_t* block = quads + g * kK6Bytes;
  const __m256i high = _mm256_set1_epi8(0x30);
  load_nibbles(block, codes);
  for (int u = 0; u < 2; ++u) {
    for (int h = 0; h < 2; ++h) {
      const __m256i crumbs = load256(block + 256 + u * 64 + h * 32);
      for (int t = 0; t < 4; ++t) {
        codes[4 * u + t][h] = _mm256_or_si256(codes[4 * u + t][h], _mm256_and_si256(at_bit4(crumbs, 2 * t), high));
      }
    }
  }
}

// A row's inputs 4j .. 4j + 3 of group g, in every int32 lane, for j = 0..7.
inline void broadcast_fours(const int8_t* group_q, __m256i* fours) {
  for (int j = 0; j < 8; ++j) {
    int32_t four;
    std::memcpy(&four, group_q + 4 * j, sizeof(four));
    fours[j] = _mm256_set1_epi32(four);
  }
}

inline void store_outputs(float* dst, const __m256* values, int64_t cols) {
  if (cols == 16) {
    _mm256_storeu_ps(dst, values[0]);
    _mm256_storeu_ps(dst + 8, values[1]);
  } else {
    alignas(32) float all[16];
    _mm256_store_ps(all, values[0]);
    _mm256_store_ps(all + 8, values[1]);
    std::memcpy(dst, all, cols * sizeof(float));
  }
}

// A group's data for the rows' steps, unpacked from the layout: its eight code vectors (8 bits signed,
// 5 and 6 bits as held) and up to four vectors of float scales (each form its own: see its tile).
struct GroupData {
  Halves codes[8];
  __m256 scales[4];
};
// 8-bit codes also keep each code's magnitude, vpmaddubsw's unsigned operand: made once per group,
// not once per row, where tiles of rows share the vector (kept_groups) and its groups stay in L1 (up
// to kMagnitudeGroups: 23 KB kept; a 2048-input layer's 72 KB ran 15% slower from L2 than making them).
struct EightData : GroupData {
  Halves magnitudes[8];
};
constexpr int64_t kMagnitudeGroups = 20;

// Where a tile of rows keeps its vector's unpacked groups: where several tiles of rows share the vector,
// this thread's buffer, which the first tile (first_row 0) fills and the others read back (the driver
// runs a vector's tiles in turn on one thread); else nowhere (nullptr: the vector's only tile unpacks
// group by group).
template <typename Data>
inline Data* kept_groups(int64_t groups, int rows, int64_t first_row) {
  if (first_row == 0 && rows < kQuadTileRows) return nullptr;
  thread_local std::vector<Data> buffer;
  return scratch(buffer, groups);
}

constexpr int64_t kGroupChunk = 16;  // 10 KB of unpacked groups (18 KB with magnitudes), in L1 for each row in turn

// R rows x one 16-row vector of outputs over all groups, for any form: unpack(g, data) unpacks group g,
// step(r, g, data, total) adds row r's group g to its two accumulators (rows 0-7 and 8-15 of the
// vector). A vector's only tile unpacks each group for its rows. Where tiles share the vector, the first
// unpacks every group into the kept buffer, and each tile runs its rows in turn over kGroupChunk groups
// at a time, a row's accumulators in registers (AVX2's 16 do not hold 4 rows' and a group's inputs).
// Either way a row takes its groups' steps in group order, so its bits are the same.
template <int R, typename Data = GroupData, typename Unpack, typename Step>
inline void run_tile(int64_t groups, int64_t first_row, float* out, int64_t ldo, int64_t cols, Unpack unpack,
                     Step step) {
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  Data* const kept = kept_groups<Data>(groups, R, first_row);
  if (kept == nullptr) {
    for (int64_t g = 0; g < groups; ++g) {
      Data data;
      unpack(g, data);
      for (int r = 0; r < R; ++r) step(r, g, data, total[r]);
    }
  } else {
    if (first_row == 0) {
      for (int64_t g = 0; g < groups; ++g) unpack(g, kept[g]);
    }
    for (int64_t g0 = 0; g0 < groups; g0 += kGroupChunk) {
      const int64_t g1 = std::min(g0 + kGroupChunk, groups);
      for (int r = 0; r < R; ++r) {
        __m256 row[2] = {total[r][0], total[r][1]};
        for (int64_t g = g0; g < g1; ++g) step(r, g, kept[g], row);
        total[r][0] = row[0];
        total[r][1] = row[1];
      }
    }
  }
  for (int r = 0; r < R; ++r) store_outputs(out + r * ldo, total[r], cols);
}

// Half h of sum over code vectors j = J0 .. J1 - 1 of code x q, in int32 lanes (8 rows), exact. 8 bits:
// |code| (magnitudes where given, else made here) times q with the code's sign.
template <int Bits, int J0, int J1>
inline __m256i half_dot(const Halves* codes, const __m256i* fours, int h, const Halves* magnitudes = nullptr) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum = _mm256_setzero_si256();
  if constexpr (Bits == 8) {
    for (int j = J0; j < J1; ++j) {
      const __m256i c = codes[j][h];
      const __m256i magnitude = magnitudes != nullptr ? magnitudes[j][h] : _mm256_sign_epi8(c, c);
      const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(fours[j], c));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
    }
  } else {
    constexpr int join = Bits == 5 ? 4 : 2;  // 4 x 2 x 31 x 127 and 2 x 2 x 63 x 127 < 32768
    static_assert((J1 - J0) % join == 0);
    for (int j = J0; j < J1; j += join) {
      __m256i pairs = _mm256_maddubs_epi16(codes[j][h], fours[j]);
      for (int i = 1; i < join; ++i) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(codes[j + i][h], fours[j + i]));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
    }
  }
  return sum;
}

template <typename S>
inline __m256 load_scales8(const S* scales) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm256_loadu_ps(scales);
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
  }
}

inline __m256 halves8(const uint8_t* p) {  // 8 float16 values as float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// R rows x one 16-row vector of outputs over all groups (quad_tile on AVX-512).
template <int R, int Bits, typename S>
inline void quad_tile(const int8_t* q, const float* d, const int32_t* start, int64_t k, const uint8_t* quads,
                      const S* scales, float* out, int64_t ldo, int64_t cols, int64_t first_row) {
  const int64_t groups = k / 32;
  const auto unpack = [&](int64_t g, auto& data) {
    load_codes<Bits>(quads, g, data.codes);
    if constexpr (std::is_same_v<std::decay_t<decltype(data)>, EightData>) {
      for (int j = 0; j < 8; ++j) {
        for (int h = 0; h < 2; ++h) data.magnitudes[j][h] = _mm256_sign_epi8(data.codes[j][h], data.codes[j][h]);
      }
    }
    data.scales[0] = load_scales8(scales + g * 16);
    data.scales[1] = load_scales8(scales + g * 16 + 8);
  };
  const auto step = [&](int r, int64_t g, const auto& data, __m256* total) {
    __m256i fours[8];
    broadcast_fours(q + r * k + g * 32, fours);
    const __m256 row_d = _mm256_set1_ps(d[r * groups + g]);
    for (int h = 0; h < 2; ++h) {
      const __m256i dot = [&] {
        if constexpr (std::is_same_v<std::decay_t<decltype(data)>, EightData>) {
          return half_dot<8, 0, 8>(data.codes, fours, h, data.magnitudes);
        } else {
          return half_dot<Bits, 0, 8>(data.codes, fours, h);
        }
      }();
      const __m256i sum = _mm256_add_epi32(_mm256_set1_epi32(start[r * groups + g]), dot);
      total[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(data.scales[h], row_d), total[h]);
    }
  };
  if constexpr (Bits == 8) {  // magnitudes where the vector's groups are kept (run_tile)
    if (groups <= kMagnitudeGroups && (first_row > 0 || R >= kQuadTileRows)) {
      run_tile<R, EightData>(groups, first_row, out, ldo, cols, unpack, step);
      return;
    }
  }
  run_tile<R, GroupData>(groups, first_row, out, ldo, cols, unpack, step);
}

// R rows x one 16-row vector of Q6_K (k6_tile on AVX-512). scales[2 hg + h]: half group hg's, rows of half h.
template <int R>
inline void k6_tile(const int8_t* q, const float* d, const int32_t* start2, int64_t k, const uint8_t* quads,
                    const uint8_t* kscales, float* out, int64_t ldo, int64_t cols, int64_t first_row) {
  const int64_t groups = k / 32;
  const auto unpack = [&](int64_t g, GroupData& data) {
    load_codes6(quads, g, data.codes);
    const uint8_t* ks = kscales + (g / 8) * kK6ScaleBytes;
    for (int hg = 0; hg < 2; ++hg) {
      for (int h = 0; h < 2; ++h) {
        const __m128i sub = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ks + ((g % 8) * 2 + hg) * 16 + 8 * h));
        const __m256 sub_scales = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sub));
        data.scales[2 * hg + h] = _mm256_mul_ps(halves8(ks + 256 + 16 * h), sub_scales);
      }
    }
  };
  const auto step = [&](int r, int64_t g, const GroupData& data, __m256* total) {
    __m256i fours[8];
    broadcast_fours(q + r * k + g * 32, fours);
    const __m256 row_d = _mm256_set1_ps(d[r * groups + g]);
    for (int hg = 0; hg < 2; ++hg) {
      for (int h = 0; h < 2; ++h) {
        const __m256i dot =
            hg == 0 ? half_dot<6, 0, 4>(data.codes, fours, h) : half_dot<6, 4, 8>(data.codes, fours, h);
        const __m256i sum = _mm256_add_epi32(_mm256_set1_epi32(start2[(r * groups + g) * 2 + hg]), dot);
        total[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(data.scales[2 * hg + h], row_d), total[h]);
      }
    }
  };
  run_tile<R>(groups, first_row, out, ldo, cols, unpack, step);
}

// Group g's scales and mins for half h of a 16-row vector (min5_scales on AVX-512).
template <bool KQuant>
inline void min5_scales(const uint8_t* scales, int64_t g, int h, __m256& scale, __m256& min) {
  if constexpr (KQuant) {
    const uint8_t* ks = scales + (g / 8) * kK5ScaleBytes;
    const auto bytes = [&](int64_t at) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ks + at + 8 * h))));
    };
    scale = _mm256_mul_ps(halves8(ks + 256 + 16 * h), bytes((g % 8) * 16));
    min = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(halves8(ks + 288 + 16 * h), bytes(128 + (g % 8) * 16)));
  } else {
    scale = halves8(scales + g * 64 + 16 * h);
    min = halves8(scales + g * 64 + 32 + 16 * h);
  }
}

// R rows x one 16-row vector of Q5_1 or Q5_K, or of 4-bit codes (min5_tile on AVX-512). scales: the
// rows' scales, then their mins. The 4-bit codes take the 5-bit dot (0..15 within its bounds).
template <int R, int Bits, bool KQuant>
inline void min5_tile(const int8_t* q, const float* d, const float* s, int64_t k, const uint8_t* quads,
                      const uint8_t* scales, float* out, int64_t ldo, int64_t cols, int64_t first_row) {
  const int64_t groups = k / 32;
  const auto unpack = [&](int64_t g, GroupData& data) {
    load_codes<Bits>(quads, g, data.codes);
    for (int h = 0; h < 2; ++h) min5_scales<KQuant>(scales, g, h, data.scales[h], data.scales[2 + h]);
  };
  const auto step = [&](int r, int64_t g, const GroupData& data, __m256* total) {
    __m256i fours[8];
    broadcast_fours(q + r * k + g * 32, fours);
    const __m256 row_d = _mm256_set1_ps(d[r * groups + g]), row_s = _mm256_set1_ps(s[r * groups + g]);
    for (int h = 0; h < 2; ++h) {
      const __m256i sum = half_dot<5, 0, 8>(data.codes, fours, h);
      total[h] = _mm256_fmadd_ps(_mm256_mul_ps(data.scales[h], row_d), _mm256_cvtepi32_ps(sum), total[h]);
      total[h] = _mm256_fmadd_ps(row_s, data.scales[2 + h], total[h]);
    }
  };
  run_tile<R>(groups, first_row, out, ldo, cols, unpack, step);
}
#endif

// The tiles of every vector and row, for one width and scale type.
template <int Bits, typename S>
void quads_matmul(const int8_t* q, const float* d, const int32_t* start, int64_t m, int64_t k, const uint8_t* qp,
                  const S* sp, float* o, int64_t v, int64_t vectors) {
  const int64_t groups = k / 32, vector_bytes = k * 16 * Bits / 8;
#if KVSERVE_HAS_VNNI512
  const bool pairs = Bits == 8 && m >= kPairTileFromRows;  // two vectors at a time (quad_pair_tile), tasks of two
#else
  const bool pairs = false;
#endif
  const int64_t block = pairs ? 2 : kQuadBlock;
  parallel_tasks((vectors + block - 1) / block, m, [&](int64_t task) {
    for (int64_t vec = task * block; vec < std::min((task + 1) * block, vectors); ++vec) {
      const uint8_t* vq = qp + vec * vector_bytes;
      const S* vs = sp + vec * groups * 16;
      const int64_t cols = std::min<int64_t>(16, v - vec * 16);
      if (cols <= 0) continue;
#if KVSERVE_HAS_VNNI512
      if (pairs && vec + 1 < std::min((task + 1) * block, vectors) && v > (vec + 1) * 16) {
        constexpr int kRows = kQuadPairRows;
        const int64_t cols1 = std::min<int64_t>(16, v - (vec + 1) * 16);
        for (int64_t r = 0; r < m; r += kRows) {
          const int8_t* qr = q + r * k;
          const float* dr = d + r * groups;
          const int32_t* sr = start + r * groups;
          float* dst = o + r * v + vec * 16;
          switch (std::min<int64_t>(kRows, m - r)) {
#define KVSERVE_ROWS(R)                                                                                 \
  case R:                                                                                               \
    quad_pair_tile<R, S>(qr, dr, sr, k, vq, vector_bytes, vs, groups * 16, dst, v, cols1);            \
    break;
            KVSERVE_ROWS(1) KVSERVE_ROWS(2) KVSERVE_ROWS(3) KVSERVE_ROWS(4) KVSERVE_ROWS(5) KVSERVE_ROWS(6)
#undef KVSERVE_ROWS
            default:
              TORCH_CHECK(false, "int8_quads_matmul: bad row tile");
          }
        }
        ++vec;  // the pair's second vector is done
        continue;
      }
#endif
      for (int64_t r = 0; r < m; r += kQuadTileRows) {
        const int8_t* qr = q + r * k;
        const float* dr = d + r * groups;
        const int32_t* sr = start + r * groups;
        float* dst = o + r * v + vec * 16;
        switch (std::min<int64_t>(kQuadTileRows, m - r)) {
#define KVSERVE_ROWS(R)                                                  \
  case R:                                                                \
    quad_tile<R, Bits, S>(qr, dr, sr, k, vq, vs, dst, v, cols, r);       \
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

void k6_matmul(const int8_t* q, const float* d, const int32_t* start2, int64_t m, int64_t k, const uint8_t* qp,
               const uint8_t* sp, float* o, int64_t v, int64_t vectors) {
  const int64_t groups = k / 32, vector_bytes = groups * kK6Bytes, scale_bytes = k / 256 * kK6ScaleBytes;
  parallel_tasks((vectors + kQuadBlock - 1) / kQuadBlock, m, [&](int64_t task) {
    for (int64_t vec = task * kQuadBlock; vec < std::min((task + 1) * kQuadBlock, vectors); ++vec) {
      const int64_t cols = std::min<int64_t>(16, v - vec * 16);
      if (cols <= 0) continue;
      for (int64_t r = 0; r < m; r += kQuadTileRows) {
        const int8_t* qr = q + r * k;
        const float* dr = d + r * groups;
        const int32_t* sr = start2 + r * groups * 2;
        float* dst = o + r * v + vec * 16;
        const uint8_t* vq = qp + vec * vector_bytes;
        const uint8_t* vs = sp + vec * scale_bytes;
        switch (std::min<int64_t>(kQuadTileRows, m - r)) {
#define KVSERVE_ROWS(R)                                  \
  case R:                                                \
    k6_tile<R>(qr, dr, sr, k, vq, vs, dst, v, cols, r);  \
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

template <int Bits, bool KQuant>
void min5_matmul(const int8_t* q, const float* d, const float* s, int64_t m, int64_t k, const uint8_t* qp,
                 const uint8_t* sp, float* o, int64_t v, int64_t vectors) {
  const int64_t groups = k / 32, vector_bytes = groups * (Bits == 4 ? kMin4Bytes : kMin5Bytes);
  const int64_t scale_bytes = KQuant ? k / 256 * kK5ScaleBytes : groups * 64;
#if KVSERVE_HAS_VNNI512
  // 4-bit codes from kPairTileFromRows rows: two vectors at a time (min4_pair_tile), tasks of two vectors (the
  // codes need no unpacking per call, so smaller tasks cost nothing and balance the threads better)
  const bool pairs = Bits == 4 && m >= kPairTileFromRows;
#else
  const bool pairs = false;
#endif
  const int64_t block = pairs ? 2 : kQuadBlock;
  parallel_tasks((vectors + block - 1) / block, m, [&](int64_t task) {
    for (int64_t vec = task * block; vec < std::min((task + 1) * block, vectors); ++vec) {
      const int64_t cols = std::min<int64_t>(16, v - vec * 16);
      if (cols <= 0) continue;
#if KVSERVE_HAS_VNNI512
      if (pairs && vec + 1 < std::min((task + 1) * block, vectors) && v > (vec + 1) * 16) {
        const int64_t cols1 = std::min<int64_t>(16, v - (vec + 1) * 16);
        for (int64_t r = 0; r < m; r += kMin4TileRows) {
          const int8_t* qr = q + r * k;
          const float* dr = d + r * groups;
          const float* sr = s + r * groups;
          float* dst = o + r * v + vec * 16;
          const uint8_t* vq = qp + vec * vector_bytes;
          const uint8_t* vs = sp + vec * scale_bytes;
          switch (std::min<int64_t>(kMin4TileRows, m - r)) {
#define KVSERVE_ROWS(R)                                                                                 \
  case R:                                                                                               \
    min4_pair_tile<R, KQuant>(qr, dr, sr, k, vq, vector_bytes, vs, scale_bytes, dst, v, cols1);         \
    break;
            KVSERVE_ROWS(1) KVSERVE_ROWS(2) KVSERVE_ROWS(3) KVSERVE_ROWS(4) KVSERVE_ROWS(5) KVSERVE_ROWS(6)
#undef KVSERVE_ROWS
            default:
              TORCH_CHECK(false, "int8_quads_matmul: bad row tile");
          }
        }
        ++vec;  // the pair's second vector is done
        continue;
      }
#endif
      for (int64_t r = 0; r < m; r += kQuadTileRows) {
        const int8_t* qr = q + r * k;
        const float* dr = d + r * groups;
        const float* sr = s + r * groups;
        float* dst = o + r * v + vec * 16;
        const uint8_t* vq = qp + vec * vector_bytes;
        const uint8_t* vs = sp + vec * scale_bytes;
        switch (std::min<int64_t>(kQuadTileRows, m - r)) {
#define KVSERVE_ROWS(R)                                              \
  case R:                                                            \
    min5_tile<R, Bits, KQuant>(qr, dr, sr, k, vq, vs, dst, v, cols, r); \
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

#if KVSERVE_HAS_AMX_INT8
constexpr int64_t kAmxQuadRows = 16;  // from one tile of rows; fewer go through vpdpbusd

// total[r] = fma(float(c[r] + start), scale * d, total[r]) for the block's rows r: the VNNI kernel's step.
template <typename S>
inline void quad_epilogue(__m512* total, const int32_t* c, const S* scales, const float* d, const int32_t* start,
                          int64_t groups, int64_t rows) {
  const __m512 scale = load_scales(scales);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i sum = _mm512_add_epi32(_mm512_load_si512(c + r * 16), _mm512_set1_epi32(start[r * groups]));
    total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(d[r * groups])), total[r]);
  }
}

// Group g: its product into C tile TILE, then the previous group's sums stored from OTHER and scaled
// into total (a store waits for its multiply: each waits on work issued an iteration earlier).
// (GCC's tile intrinsics paste the tile number into the instruction: literals only, hence a macro.)
#define KVSERVE_QUAD_STEP(TILE, OTHER)                                                                       \
  template <typename S>                                                                                      \
  inline void quad_step_##TILE(int64_t g, const int8_t* q, int64_t k, const uint8_t* b, int32_t(*c)[256],   \
                               __m512* total, const S* scales, const float* d, const int32_t* start,        \
                               int64_t groups, int64_t rows) {                                               \
    _tile_zero(TILE);                                                                                        \
    _tile_loadd(1, q + g * 32, k);                                                                           \
    _tile_loadd(2, b + g * 512, 64);                                                                         \
    _tile_dpbsud(TILE, 1, 2);                                                                                \
    if (g >= 1) {                                                                                            \
      _tile_stored(OTHER, c[(g - 1) & 1], 64);                                                               \
      quad_epilogue(total, c[(g - 1) & 1], scales + (g - 1) * 16, d + g - 1, start + g - 1, groups, rows);   \
    }                                                                                                        \
  }
KVSERVE_QUAD_STEP(0, 3)
KVSERVE_QUAD_STEP(3, 0)
#undef KVSERVE_QUAD_STEP

// quads_matmul on tiles: q, d and start with rows to a multiple of 16 (zero past m).
template <int Bits, typename S>
void quads_matmul_amx(const int8_t* q, const float* d, const int32_t* start, int64_t m, int64_t k, const uint8_t* qp,
                      const S* sp, float* o, int64_t v, int64_t vectors) {
  const int64_t groups = k / 32, vector_bytes = k * 16 * Bits / 8;
  at::parallel_for(0, vectors, 1, [&](int64_t begin, int64_t end) {
    load_int8_tile_config();
    std::vector<uint8_t> unpacked(Bits == 8 ? 0 : k * 16);  // a vector's codes at 8 bits (+ 16)
    alignas(64) int32_t c[2][256];
    for (int64_t vec = begin; vec < end; ++vec) {
      const int64_t cols = std::min<int64_t>(16, v - vec * 16);
      if (cols <= 0) continue;
      const uint8_t* b = qp + vec * vector_bytes;
      if constexpr (Bits != 8) {
        for (int64_t g = 0; g < groups; ++g) {
          __m512i codes[8];
          load_codes<Bits>(b, g, codes);
          for (int j = 0; j < 8; ++j) _mm512_storeu_si512(unpacked.data() + (g * 8 + j) * 64, codes[j]);
        }
        b = unpacked.data();
      }
      const S* vs = sp + vec * groups * 16;
      for (int64_t r0 = 0; r0 < m; r0 += 16) {
        const int64_t rows = std::min<int64_t>(16, m - r0);
        const int8_t* qr = q + r0 * k;
        const float* dr = d + r0 * groups;
        const int32_t* sr = start + r0 * groups;
        __m512 total[16];
        for (int r = 0; r < 16; ++r) total[r] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
          if (g & 1) {
            quad_step_3(g, qr, k, b, c, total, vs, dr, sr, groups, rows);
          } else {
            quad_step_0(g, qr, k, b, c, total, vs, dr, sr, groups, rows);
          }
        }
        const int64_t last = groups - 1;
        if (last & 1) {
          _tile_stored(3, c[last & 1], 64);
        } else {
          _tile_stored(0, c[last & 1], 64);
        }
        quad_epilogue(total, c[last & 1], vs + last * 16, dr + last, sr + last, groups, rows);
        for (int64_t r = 0; r < rows; ++r) store_outputs(o + (r0 + r) * v + vec * 16, total[r], cols);
      }
    }
    _tile_release();
  });
}

// min5_matmul on tiles from kAmxQuadRows rows: a vector's codes unpacked once per call into TDPBSUD's
// B layout (the 5- or 4-bit quads' eight vectors per group, each byte a code), 16 rows of q the A tile;
// the int32 sums are min5_tile's and take its float step per row in group order: the same bits.
template <bool KQuant>
inline void min5_epilogue(__m512* total, const int32_t* c, const uint8_t* scales, int64_t g, const float* d,
                          const float* s, int64_t groups, int64_t rows) {
  __m512 scale, min;
  min5_scales<KQuant>(scales, g, scale, min);
  for (int64_t r = 0; r < rows; ++r) {
    total[r] = min5_step(total[r], _mm512_load_si512(c + r * 16), scale, min, d[r * groups + g], s[r * groups + g]);
  }
}

// As quad_step_*: group g's product into TILE, then the previous group's sums stored from OTHER and stepped.
#define KVSERVE_MIN5_STEP(TILE, OTHER)                                                                        \
  template <bool KQuant>                                                                                      \
  inline void min5_step_##TILE(int64_t g, const int8_t* q, int64_t k, const uint8_t* b, int32_t(*c)[256],    \
                               __m512* total, const uint8_t* scales, const float* d, const float* s,        \
                               int64_t groups, int64_t rows) {                                               \
    _tile_zero(TILE);                                                                                        \
    _tile_loadd(1, q + g * 32, k);                                                                           \
    _tile_loadd(2, b + g * 512, 64);                                                                         \
    _tile_dpbsud(TILE, 1, 2);                                                                                \
    if (g >= 1) {                                                                                            \
      _tile_stored(OTHER, c[(g - 1) & 1], 64);                                                               \
      min5_epilogue<KQuant>(total, c[(g - 1) & 1], scales, g - 1, d, s, groups, rows);                      \
    }                                                                                                        \
  }
KVSERVE_MIN5_STEP(0, 3)
KVSERVE_MIN5_STEP(3, 0)
#undef KVSERVE_MIN5_STEP

template <int Bits, bool KQuant>
void min5_matmul_amx(const int8_t* q, const float* d, const float* s, int64_t m, int64_t k, const uint8_t* qp,
                     const uint8_t* sp, float* o, int64_t v, int64_t vectors) {
  const int64_t groups = k / 32, vector_bytes = groups * (Bits == 4 ? kMin4Bytes : kMin5Bytes);
  const int64_t scale_bytes = KQuant ? k / 256 * kK5ScaleBytes : groups * 64;
  at::parallel_for(0, vectors, 1, [&](int64_t begin, int64_t end) {
    load_int8_tile_config();
    std::vector<uint8_t> b(k * 16);  // a vector's codes a byte each
    alignas(64) int32_t c[2][256];
    for (int64_t vec = begin; vec < end; ++vec) {
      const int64_t cols = std::min<int64_t>(16, v - vec * 16);
      if (cols <= 0) continue;
      for (int64_t g = 0; g < groups; ++g) {
        __m512i codes[8];
        load_codes<Bits>(qp + vec * vector_bytes, g, codes);
        for (int j = 0; j < 8; ++j) _mm512_storeu_si512(b.data() + (g * 8 + j) * 64, codes[j]);
      }
      const uint8_t* vs = sp + vec * scale_bytes;
      for (int64_t r0 = 0; r0 < m; r0 += 16) {
        const int64_t rows = std::min<int64_t>(16, m - r0);
        const int8_t* qr = q + r0 * k;
        const float* dr = d + r0 * groups;
        const float* sr = s + r0 * groups;
        __m512 total[16];
        for (int r = 0; r < 16; ++r) total[r] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
          if (g & 1) {
            min5_step_3<KQuant>(g, qr, k, b.data(), c, total, vs, dr, sr, groups, rows);
          } else {
            min5_step_0<KQuant>(g, qr, k, b.data(), c, total, vs, dr, sr, groups, rows);
          }
        }
        const int64_t last = groups - 1;
        if (last & 1) {
          _tile_stored(3, c[last & 1], 64);
        } else {
          _tile_stored(0, c[last & 1], 64);
        }
        min5_epilogue<KQuant>(total, c[last & 1], vs, last, dr, sr, groups, rows);
        for (int64_t r = 0; r < rows; ++r) store_outputs(o + (r0 + r) * v + vec * 16, total[r], cols);
      }
    }
    _tile_release();
  });
}

#endif

}  // namespace

at::Tensor int8_quads_matmul(at::Tensor x, at::Tensor quads, at::Tensor quad_scales, int64_t v) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "int8_quads_matmul: x [M, K] with K a multiple of 32");
  const int64_t m = x.size(0), k = x.size(1), groups = k / 32, vectors = quads.size(0);
  const bool eight = quads.dim() == 4, six = quads.dim() == 3 && quads.size(2) == kK6Bytes;
  const bool four = quads.dim() == 3 && quads.size(2) == kMin4Bytes;
  TORCH_CHECK(quads.scalar_type() == at::kByte && quads.is_contiguous() && vectors * 16 >= v &&
                  (eight ? quads.size(1) * 4 == k && quads.size(2) == 16 && quads.size(3) == 4
                         : quads.dim() == 3 && quads.size(1) == groups && (quads.size(2) == 320 || six || four)),
              "int8_quads_matmul: quads [V / 16, K / 4, 16, 4] (8 bits), [V / 16, K / 32, 320] (5 bits), "
              "[V / 16, K / 32, 256] (4 bits) or [V / 16, K / 32, 384] (6 bits) uint8");
  // 5 or 4 bits with a min per group: Q5_1's (and 4-bit codes') float16 scales and mins
  // [V / 16, K / 32, 2, 16], or Q5_K's K-quant scales [V / 16, K / 256, 320] uint8
  const bool q5_k = !eight && !six && quad_scales.scalar_type() == at::kByte;
  const bool q5_1 = !eight && !six && quad_scales.scalar_type() == at::kHalf && quad_scales.dim() == 4;
  TORCH_CHECK(!four || q5_1 || q5_k, "int8_quads_matmul: 4-bit quads take a scale and a min per group");
  if (q5_k) {
    TORCH_CHECK(k % 256 == 0 && quad_scales.is_contiguous() && quad_scales.numel() == vectors * (k / 256) * kK5ScaleBytes,
                "int8_quads_matmul: Q5_K's quads take K-quant scales [V / 16, K / 256, 320] uint8");
  } else if (q5_1) {
    TORCH_CHECK(quad_scales.is_contiguous() && quad_scales.numel() == vectors * groups * 32,
                "int8_quads_matmul: Q5_1's quads take scales and mins [V / 16, K / 32, 2, 16] float16");
  } else if (six) {
    TORCH_CHECK(k % 256 == 0 && quad_scales.scalar_type() == at::kByte && quad_scales.is_contiguous() &&
                    quad_scales.numel() == vectors * (k / 256) * kK6ScaleBytes,
                "int8_quads_matmul: 6-bit quads take K-quant scales [V / 16, K / 256, 288] uint8");
  } else {
    TORCH_CHECK((quad_scales.scalar_type() == at::kFloat || quad_scales.scalar_type() == at::kHalf) &&
                    quad_scales.is_contiguous() && quad_scales.numel() == vectors * 16 * groups,
                "int8_quads_matmul: quad_scales [V / 16, K / 32, 16] float32 or float16");
  }
  const int32_t offset = eight ? kEightOffset : six ? 32 : q5_k || q5_1 ? 0 : 16;
  const at::Tensor xf = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  const int64_t padded = (m + 15) / 16 * 16;  // whole tiles of rows for AMX, zero past m
  thread_local std::vector<int8_t> q_buffer;
  thread_local std::vector<float> d_buffer, sums_buffer;
  thread_local std::vector<int32_t> start_buffer, start2_buffer;
  int8_t* const q = scratch(q_buffer, padded * k);
  std::fill(q + m * k, q + padded * k, 0);
  float* const d = scratch(d_buffer, padded * groups);
  float* const sums = scratch(sums_buffer, padded * groups);
  int32_t* const start = scratch(start_buffer, padded * groups);
  int32_t* const start2 = scratch(start2_buffer, six ? m * groups * 2 : 0);
  std::fill(d + m * groups, d + padded * groups, 0.f);  // the padding rows: zero inputs, scales and sums
  std::fill(sums + m * groups, sums + padded * groups, 0.f);
  std::fill(start + m * groups, start + padded * groups, 0);
  with_compute_type(xf.scalar_type(), [&](auto input) {  // bfloat16 widened in quantize_group: the same values
    const auto* xp = xf.data_ptr<decltype(input)>();
    at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        quantize_group(xp + i * 32, q + i * 32, &d[i], &sums[i]);
        if (offset == 0) {  // the 8-bit codes on AVX2 and the forms with a min: no offset to take back
          start[i] = 0;
          continue;
        }
        int32_t total = 0;
        for (int j = 0; j < 32; ++j) total += q[i * 32 + j];
        start[i] = -offset * total;
        if (six) {
          int32_t first = 0;
          for (int j = 0; j < 16; ++j) first += q[i * 32 + j];
          start2[2 * i] = -offset * first;
          start2[2 * i + 1] = -offset * (total - first);
        }
      }
    });
  });
  at::Tensor out = at::empty({m, v}, x.options().dtype(at::kFloat));
  const uint8_t* qp = quads.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  if (q5_k || q5_1) {  // from kAmxQuadRows rows on tiles where usable, else vpdpbusd: the same bits
    const uint8_t* sp = reinterpret_cast<const uint8_t*>(quad_scales.data_ptr());
#if KVSERVE_HAS_AMX_INT8
    if (m >= kAmxQuadRows && amx_usable()) {
      (four ? (q5_k ? min5_matmul_amx<4, true> : min5_matmul_amx<4, false>)
            : (q5_k ? min5_matmul_amx<5, true> : min5_matmul_amx<5, false>))(q, d, sums, m, k, qp, sp, o, v,
                                                                               vectors);
      return out;
    }
#endif
    (four ? (q5_k ? min5_matmul<4, true> : min5_matmul<4, false>)
          : (q5_k ? min5_matmul<5, true> : min5_matmul<5, false>))(q, d, sums, m, k, qp, sp, o, v, vectors);
    return out;
  }
  if (six) {  // vpdpbusd for every row count (two TDPBSUD of 16 inputs a group measured no faster)
    k6_matmul(q, d, start2, m, k, qp, quad_scales.data_ptr<uint8_t>(), o, v, vectors);
    return out;
  }
  const bool half = quad_scales.scalar_type() == at::kHalf;
#if KVSERVE_HAS_AMX_INT8
  const bool tiles = m >= kAmxQuadRows && amx_usable();
#else
  const bool tiles = false;
#endif
#define KVSERVE_QUADS(BITS, S)                                                                              \
  if (tiles) {                                                                                              \
    KVSERVE_QUADS_AMX(BITS, S)                                                                              \
  } else {                                                                                                  \
    quads_matmul<BITS, S>(q, d, start, m, k, qp, quad_scales.data_ptr<S>(), o, v, vectors); \
  }
#if KVSERVE_HAS_AMX_INT8
#define KVSERVE_QUADS_AMX(BITS, S) \
  quads_matmul_amx<BITS, S>(q, d, start, m, k, qp, quad_scales.data_ptr<S>(), o, v, vectors);
#else
#define KVSERVE_QUADS_AMX(BITS, S)
#endif
  if (eight && !half) {
    KVSERVE_QUADS(8, float)
  } else if (eight) {
    KVSERVE_QUADS(8, at::Half)
  } else if (!half) {
    KVSERVE_QUADS(5, float)
  } else {
    KVSERVE_QUADS(5, at::Half)
  }
#undef KVSERVE_QUADS
#undef KVSERVE_QUADS_AMX
  return out;
}
#else
at::Tensor int8_quads_matmul(at::Tensor, at::Tensor, at::Tensor, int64_t) {
  TORCH_CHECK(false, "int8_quads_matmul needs AVX2, FMA and F16C");
}
#endif

}  // namespace kvserve
