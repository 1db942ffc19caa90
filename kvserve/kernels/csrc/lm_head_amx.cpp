// The lm_head (lm_head.cpp's int8_group_matmul) on AMX, for bfloat16 inputs: a tile multiply
// (TDPBF16PS: a 16 x 32 by 32 x 16 bfloat16 product summed in float32, per instruction) computes
// each group of 32 inputs for 16 vocabulary rows and 16 rows of x. The int8 codes are exact in
// bfloat16 (8-bit significands), so are x's bfloat16 values, and their products are exact in
// float32: the group's sum is float32 as in the float tiles, only summed in another order. Each
// group's sums are then scaled by the code rows' scales into float32 totals, as the float tiles do.
// Per block of 16 vocabulary rows the codes are widened to bfloat16 once (16 rows x 32 inputs per
// tile, row-major as stored: tile A); x is laid out once per call as the pairs of inputs that tile B
// wants ([block of 16 rows][group][input pair][row of the block]). The tiles' results are 16
// vocabulary rows x 16 rows of x, transposed into out when written.

#include "kernels.h"

#if KVSERVE_HAS_AMX_BF16
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>
#endif

namespace kvserve {

#if KVSERVE_HAS_AMX_BF16
bool amx_usable() {
  static const bool usable = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // Linux: ask for the tile state
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 and 3 (C: 16 x 16 float32, alternating by group), 1 (A: 16 x 32 bfloat16) and 2 (B: 16
// input pairs x 16 x 2 bfloat16).
inline void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 4; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// total[r] += scale(r) * c[r] for 16 rows of 16 floats.
inline void scale_rows(__m512* total, const float* c, const float* scales, int64_t stride, int64_t rows) {
  for (int r = 0; r < 16; ++r) {
    const __m512 scale = _mm512_set1_ps(r < rows ? scales[r * stride] : 0.f);
    total[r] = _mm512_fmadd_ps(scale, _mm512_load_ps(c + r * 16), total[r]);
  }
}

// Group g of a block: its multiply into C tile 0 or 3 (by g's parity), then the previous group's
// products stored from the other C tile, then those of the group before it scaled into total. A tile
// store waits for its multiply to finish and a load of stored products waits for the store (tens of
// cycles each), so each waits on work issued an iteration earlier.
// (GCC's tile intrinsics paste the tile number into the instruction: literals only, hence a macro.)
#define KVSERVE_AMX_GROUP_STEP(TILE, OTHER)                                                  \
  inline void amx_group_step_##TILE(int64_t g, const __m512i* a, const uint32_t* xb, float(*c)[256], \
                                    __m512* total, const float* scales, int64_t groups, int64_t rows) { \
    _tile_zero(TILE);                                                                        \
    _tile_loadd(1, a + g * 16, 64);                                                          \
    _tile_loadd(2, xb + g * 256, 64);                                                        \
    _tile_dpbf16ps(TILE, 1, 2);                                                              \
    if (g >= 1) _tile_stored(OTHER, c[(g - 1) & 1], 64);                                     \
    if (g >= 2) scale_rows(total, c[g & 1], scales + g - 2, groups, rows);                   \
  }
KVSERVE_AMX_GROUP_STEP(0, 3)
KVSERVE_AMX_GROUP_STEP(3, 0)
#undef KVSERVE_AMX_GROUP_STEP

}  // namespace

void int8_group_matmul_amx(const c10::BFloat16* x, const int8_t* codes, const float* scales, float* out, int64_t m,
                           int64_t k, int64_t v) {
  const int64_t groups = k / 32, row_blocks = (m + 15) / 16;
  // xb[((b * groups + g) * 16 + p) * 16 + i]: inputs 2p, 2p + 1 of group g of x's row 16 b + i (zero past m)
  std::vector<uint32_t> xb(row_blocks * groups * 256, 0);
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < k / 2; ++j) {
      xb[((r / 16 * groups + j / 16) * 16 + j % 16) * 16 + r % 16] = pairs[r * k / 2 + j];
    }
  }
  at::parallel_for(0, (v + 15) / 16, 8, [&](int64_t begin, int64_t end) {
    load_tile_config();
    std::vector<__m512i> a(groups * 16);  // [group][16 code rows] of 32 bfloat16
    alignas(64) float c[2][256];          // two groups' products, see amx_group_step
    for (int64_t block = begin; block < end; ++block) {
      const int64_t v0 = block * 16, rows = std::min<int64_t>(16, v - v0);
      for (int64_t r = 0; r < 16; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
          if (r >= rows) {
            a[g * 16 + r] = _mm512_setzero_si512();
            continue;
          }
          const int8_t* src = codes + (v0 + r) * k + g * 32;
          const __m512 low =
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
          const __m512 high =
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
          a[g * 16 + r] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
        }
      }
      const float* block_scales = scales + v0 * groups;
      for (int64_t b = 0; b < row_blocks; ++b) {
        __m512 total[16];
        for (int r = 0; r < 16; ++r) total[r] = _mm512_setzero_ps();
        const uint32_t* xblock = xb.data() + b * groups * 256;
        for (int64_t g = 0; g < groups; ++g) {
          if (g & 1) {
            amx_group_step_3(g, a.data(), xblock, c, total, block_scales, groups, rows);
          } else {
            amx_group_step_0(g, a.data(), xblock, c, total, block_scales, groups, rows);
          }
        }
        // the last group's products, then the last two groups' scaling
        if (groups & 1) {
          _tile_stored(0, c[(groups - 1) & 1], 64);
        } else {
          _tile_stored(3, c[(groups - 1) & 1], 64);
        }
        if (groups >= 2) scale_rows(total, c[groups & 1], block_scales + groups - 2, groups, rows);
        scale_rows(total, c[(groups - 1) & 1], block_scales + groups - 1, groups, rows);
        alignas(64) float t[256];  // [vocabulary row][16 rows of x]
        for (int r = 0; r < 16; ++r) _mm512_store_ps(t + r * 16, total[r]);
        const int64_t xrows = std::min<int64_t>(16, m - b * 16);
        const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(16), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                                           10, 11, 12, 13, 14, 15));
        for (int64_t i = 0; i < xrows; ++i) {
          float* o = out + (b * 16 + i) * v + v0;
          if (rows == 16) {
            _mm512_storeu_ps(o, _mm512_i32gather_ps(column, t + i, 4));  // t[r * 16 + i] for r < 16
          } else {
            for (int64_t r = 0; r < rows; ++r) o[r] = t[r * 16 + i];
          }
        }
      }
    }
    _tile_release();
  });
}
#else
bool amx_usable() { return false; }

void int8_group_matmul_amx(const c10::BFloat16*, const int8_t*, const float*, float*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "int8_group_matmul_amx: this build has no AMX tiles");
}
#endif

}  // namespace kvserve
