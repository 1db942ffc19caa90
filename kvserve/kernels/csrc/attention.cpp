// Attention of the layer loop: decode_attention, for rows of any sequences, each reading its own
// keys and values through its block table from the paged KV cache (a row's cost is its own context,
// whatever the other rows hold); prefill_attention, causal attention of fresh prompts over their
// own keys and values.

#include <ATen/ops/ones.h>
#include <ATen/ops/scaled_dot_product_attention.h>

#include <atomic>
#include <vector>

#include "kernels.h"

namespace kvserve {
namespace {

// s[i] = exp(s[i] - max(s)) for i < n (softmax's numerators); returns their sum. With AVX2, eight
// at a time through exp8 (which gives 0 where expf's results are subnormal, under 1.2e-38 of the
// largest term); else std::exp one at a time.
inline float exp_sum(float* s, int64_t n) {
  const float peak = row_peak(s, n);
  float total = 0.f;
  int64_t i = 0;
#if KVSERVE_HAS_AVX2_FMA
  __m256 sum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(peak)));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  total = hsum8(sum);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - peak);
    total += s[i];
  }
  return total;
}

#if KVSERVE_HAS_AVX2_FMA
// out[r * ldo + c] = x[r] . panel column c, for R rows of x and the first `cols` (<= 16) columns of a
// panel of k rows of 16 floats, ldp apart: a GEMM's register tile. Its 12 accumulators, 2 panel
// vectors and the broadcast x value fit in AVX2's 16 registers. Prefill attention's keys
// (transposed) and values are such panels.
template <int R>
inline void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t k, float* out,
                       int64_t ldo, int64_t cols) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_loadu_ps(panel + i * ldp), w1 = _mm256_loadu_ps(panel + i * ldp + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (cols == 16) {
      _mm256_storeu_ps(out + r * ldo, acc[r][0]);
      _mm256_storeu_ps(out + r * ldo + 8, acc[r][1]);
    } else {
      float lanes[16];
      _mm256_storeu_ps(lanes, acc[r][0]);
      _mm256_storeu_ps(lanes + 8, acc[r][1]);
      std::memcpy(out + r * ldo, lanes, cols * sizeof(float));
    }
  }
}

// panel_tile for up to 6 rows (rows known at run time).
inline void panel_tile_rows(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t k,
                            float* out, int64_t ldo, int64_t cols) {
  switch (rows) {
#define KVSERVE_ROWS(R)                                           \
  case R:                                                         \
    return panel_tile<R>(x, ldx, panel, ldp, k, out, ldo, cols);
    KVSERVE_ROWS(1) KVSERVE_ROWS(2) KVSERVE_ROWS(3) KVSERVE_ROWS(4) KVSERVE_ROWS(5) KVSERVE_ROWS(6)
#undef KVSERVE_ROWS
    default:
      TORCH_CHECK(false, "panel_tile: bad row tile");
  }
}
#endif

// decode_attention's inputs: row b of qkv attends to its own seq_lens[b] keys (the last `window`;
// 0: all) through its own block table (a row is a decode token or one token of a prompt).
template <typename T, typename C>  // T: the compute type, C: the KV cache's element type
struct Paged {
  const T* qkv;
  const C* k_cache;
  const C* v_cache;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  T* out;
  int64_t num_seqs, max_blocks, block_size, num_heads, num_kv_heads, head_dim, window;
  float scale;

  int64_t group() const { return num_heads / num_kv_heads; }
  int64_t row() const { return (num_heads + 2 * num_kv_heads) * head_dim; }  // of qkv
  int64_t kv_row() const { return num_kv_heads * head_dim; }                 // of a cache slot
};

// Row b's keys: positions [key_range(a, b).first, .second) of its sequence (the last `window` of them).
template <typename T, typename C>
std::pair<int64_t, int64_t> key_range(const Paged<T, C>& a, int64_t b) {
  const int64_t end = a.seq_lens[b];
  return {a.window > 0 ? std::max<int64_t>(0, end - a.window) : 0, end};
}

// The tasks of decode attention: (tile of rows, KV head) pairs, taken by whichever thread is free,
// tiles from both ends in turn (a prompt's rows attend over 1 to n keys). A tile is up to MaxRows
// consecutive rows with the same block table (a prompt's rows in one step; a decode row is a tile of
// its own), fewer where there would be under 4 tasks a thread, so that a task reads their shared keys
// once for all of them. fn(b, rows, kvh, slots, first, pace) computes rows [b, b + rows) for one KV
// head: slots are the cache slots of positions first, first + 1, ... up to the tile's last key, and row
// b + r's keys are those of key_range(a, b + r). The cache rows are scattered over blocks and mostly
// in DRAM, so while a thread works on one task it fetches the rows of the next one it has claimed into
// L2, spread over the work: fn calls pace(done, work) as it goes, `done` more units of its `work` (key
// x query head products) being done.
template <int64_t MaxRows, typename T, typename C, typename F>
void for_each_attention_task(const Paged<T, C>& a, F&& fn) {
  const int64_t kv_row = a.kv_row();
  // at least 4 tasks a thread where the rows allow, for the threads to finish together
  const int64_t tile_rows = std::clamp<int64_t>(a.num_seqs * a.num_kv_heads / (4 * at::get_num_threads()), 1, MaxRows);
  std::vector<int64_t> tiles{0};  // each tile's first row, then num_seqs
  for (int64_t b = 1; b < a.num_seqs; ++b) {
    const int64_t* table = a.block_tables + b * a.max_blocks;
    const bool same_table = std::memcmp(table - a.max_blocks, table, a.max_blocks * sizeof(int64_t)) == 0;
    if (b - tiles.back() >= tile_rows || !same_table) tiles.push_back(b);
  }
  tiles.push_back(a.num_seqs);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size()) - 1, num_tasks = num_tiles * a.num_kv_heads;
  std::atomic<int64_t> next{0};
  const auto task_tile = [&](int64_t task) {
    const int64_t i = task / a.num_kv_heads;
    return i % 2 == 0 ? i / 2 : num_tiles - 1 - i / 2;
  };
  // the tile's slots (walking its block table) from its first key's position, which it returns
  const auto task_slots = [&](int64_t task, std::vector<int64_t>& slots) -> int64_t {
    slots.clear();
    if (task >= num_tasks) return 0;
    const int64_t t = task_tile(task);
    int64_t first = INT64_MAX, end = 0;
    for (int64_t b = tiles[t]; b < tiles[t + 1]; ++b) {
      const auto [lo, hi] = key_range(a, b);
      first = std::min(first, lo);
      end = std::max(end, hi);
    }
    const int64_t* table = a.block_tables + tiles[t] * a.max_blocks;
    for (int64_t pos = first; pos < end;) {
      const int64_t block = pos / a.block_size, stop = std::min((block + 1) * a.block_size, end);
      const int64_t base = (table[block] - block) * a.block_size;
      for (; pos < stop; ++pos) slots.push_back(base + pos);
    }
    return first;
  };
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<int64_t> slots, next_slots;
    int64_t task = next.fetch_add(1);
    int64_t first = task_slots(task, slots);
    while (task < num_tasks) {
      const int64_t claimed = next.fetch_add(1);
      const int64_t next_first = task_slots(claimed, next_slots);
      const int64_t head = claimed % a.num_kv_heads * a.head_dim, total = static_cast<int64_t>(next_slots.size());
      int64_t fetched = 0;
      const auto prefetch = [&](int64_t rows) {
        for (const int64_t stop = std::min(fetched + rows, total); fetched < stop; ++fetched) {
          const char* k = reinterpret_cast<const char*>(a.k_cache + next_slots[fetched] * kv_row + head);
          const char* v = reinterpret_cast<const char*>(a.v_cache + next_slots[fetched] * kv_row + head);
          for (int64_t byte = 0; byte < a.head_dim * static_cast<int64_t>(sizeof(C)); byte += 64) {
            __builtin_prefetch(k + byte, 0, 2);
            __builtin_prefetch(v + byte, 0, 2);
          }
        }
      };
      const auto pace = [&](int64_t done, int64_t work) {  // done of work units: their share of the rows
        prefetch((total * done + work - 1) / std::max<int64_t>(1, work));
      };
      const int64_t t = task_tile(task);
      fn(tiles[t], tiles[t + 1] - tiles[t], task % a.num_kv_heads, slots, first, pace);
      prefetch(total);
      std::swap(slots, next_slots);
      task = claimed;
      first = next_first;
    }
  });
}

// out[b, h] = softmax(q[b, h] . K[b]^T * scale) V[b] for one task. Where head_dim is a multiple of
// the vector width, keys' dot products run side by side (independent chains, one load of q for all):
// kLanes at a time with a vector FMA, their sums reduced together into one vector of scores, else
// four. The softmax's exponentials go eight at a time (exp_sum), and the query heads' weighted sums
// of values are built in registers, kDimVecs vectors of dimensions at a time, rather than in memory
// one key at a time.
// A task's keys and values (up to 512 KB each in float32 at 512 positions of 256 dimensions) come from
// L2 or further, and all of its rows and query heads read them. So the task walks them a chunk at a
// time (kKeyChunk keys, kValueChunk values' kDimVecs vectors: 16 KB each in Gemma 3's shapes, 4 and
// 16 KB in SmolLM2's), each row's and head's share of the chunk in turn, then the next chunk: a chunk
// comes from L2 or L3 once and from L1 for the rest. A row's scores wait in `scores`, and the
// accumulators of a head's weighted sum in `sums`, between chunks. Every product and sum of a row and
// head is the one it would be alone, in the same order: the chunks only reorder which row and head
// goes when.
template <typename T, typename C>
void decode_attention_impl(const Paged<T, C>& a) {
  constexpr int kDimVecs = kLanes < 64 ? 64 / kLanes : 1, kKeys = 4;  // 64 dimensions at a time
  constexpr int kHeadsPerPass = kLanes == 16 ? 4 : 1;  // query heads summed over the values together
  constexpr int64_t kTileRows = 16, kKeyChunk = 16, kValueChunk = 64;
  const int64_t group = a.group(), head_dim = a.head_dim, kv_row = a.kv_row();
  const bool vectors = head_dim % kLanes == 0;
  for_each_attention_task<kTileRows>(a, [&](int64_t b0, int64_t rows, int64_t kvh, const std::vector<int64_t>& slots,
                                            int64_t first, auto pace) {
    thread_local std::vector<float> scores, q;  // [rows][group][span] (a row's own keys from 0), [rows][group][D]
    thread_local std::vector<Vec> sums;         // [rows][group][kDimVecs]
    const int64_t span = static_cast<int64_t>(slots.size());
    const C* keys = a.k_cache + kvh * head_dim;
    const C* values = a.v_cache + kvh * head_dim;
    scratch(scores, rows * group * span);
    scratch(q, rows * group * head_dim);
    scratch(sums, rows * group * kDimVecs);
    int64_t lo[kTileRows], len[kTileRows], whole[kTileRows], work = 0;  // row r's keys: slots[lo, lo + len)
    for (int64_t r = 0; r < rows; ++r) {
      const auto [begin, end] = key_range(a, b0 + r);
      lo[r] = begin - first;
      len[r] = end - begin;
      whole[r] = 0;  // its keys scored kLanes at a time, every head
      work += group * len[r];
      const T* qkv = a.qkv + (b0 + r) * a.row() + kvh * group * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) q[r * group * head_dim + i] = to_float(qkv[i]);
    }
    const auto row_scores = [&](int64_t r, int64_t g) { return scores.data() + (r * group + g) * span; };
#if KVSERVE_HAS_VEC_FMA
    // kLanes keys at a time (8 on AVX2, 16 on AVX-512): their sums reduced together into one vector
    // of scores (sum_lanes_each), cheaper than a scalar sum of each key's lanes. A row's pass of
    // kLanes keys goes with the chunk its first key is in.
    for (int64_t c1 = kKeyChunk; vectors && c1 < span + kKeyChunk; c1 += kKeyChunk) {
      for (int64_t r = 0; r < rows; ++r) {
        for (; whole[r] + kLanes <= len[r] && lo[r] + whole[r] < c1; whole[r] += kLanes) {
          const C* key[kLanes];
          for (int i = 0; i < kLanes; ++i) key[i] = keys + slots[lo[r] + whole[r] + i] * kv_row;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = q.data() + (r * group + g) * head_dim;
            Vec acc[kLanes];
            for (int i = 0; i < kLanes; ++i) acc[i] = Vec{};
            for (int64_t d = 0; d < head_dim; d += kLanes) {
              const Vec qv = load_floats(qg + d);
              for (int i = 0; i < kLanes; ++i) acc[i] = fused_multiply_add(qv, load_floats(key[i] + d), acc[i]);
            }
            const Vec scaled = sum_lanes_each(acc) * a.scale;
            std::memcpy(row_scores(r, g) + whole[r], &scaled, sizeof(scaled));
          }
          pace(kLanes * group, work);
        }
      }
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t* row_slots = slots.data() + lo[r];
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q.data() + (r * group + g) * head_dim;
        float* sg = row_scores(r, g);
        int64_t j = whole[r];
        for (; vectors && j + kKeys <= len[r]; j += kKeys) {
          Vec acc[kKeys] = {};
          for (int64_t d = 0; d < head_dim; d += kLanes) {
            const Vec qv = load_floats(qg + d);
            for (int i = 0; i < kKeys; ++i) acc[i] += qv * load_floats(keys + row_slots[j + i] * kv_row + d);
          }
          for (int i = 0; i < kKeys; ++i) sg[j + i] = sum_lanes(acc[i]) * a.scale;
          pace(kKeys, work);
        }
        for (; j < len[r]; ++j) {
          const C* key = keys + row_slots[j] * kv_row;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < head_dim; ++i) dot += qg[i] * to_float(key[i]);
          sg[j] = dot * a.scale;
        }
        const float inv = 1.f / exp_sum(sg, len[r]);
        for (j = 0; j < len[r]; ++j) sg[j] *= inv;
      }
    }
    const auto out = [&](int64_t r, int64_t g) {
      return a.out + (b0 + r) * a.num_heads * head_dim + (kvh * group + g) * head_dim;
    };
    int64_t d0 = 0;
    for (; d0 + kDimVecs * kLanes <= head_dim; d0 += kDimVecs * kLanes) {
      std::fill_n(sums.begin(), rows * group * kDimVecs, Vec{});
      for (int64_t c0 = 0; c0 < span; c0 += kValueChunk) {
        for (int64_t r = 0; r < rows; ++r) {
          // row r's keys j0 .. j1 - 1 lie in this chunk
          const int64_t j0 = std::max<int64_t>(c0 - lo[r], 0), j1 = std::min(c0 + kValueChunk - lo[r], len[r]);
          // kHeadsPerPass query heads at a time share each value vector's load and widening (on
          // AVX-512 their 4 x 4 accumulators fit its 32 registers; AVX2's 16 hold one head's 8).
          for (int64_t g0 = 0; g0 < group && j0 < j1; g0 += kHeadsPerPass) {
            const int64_t heads = std::min<int64_t>(kHeadsPerPass, group - g0);
            Vec* held = sums.data() + (r * group + g0) * kDimVecs;
            Vec acc[kHeadsPerPass][kDimVecs] = {};
            for (int64_t h = 0; h < heads; ++h) std::memcpy(acc[h], held + h * kDimVecs, sizeof(acc[h]));
            for (int64_t j = j0; j < j1; ++j) {
              const C* value = values + slots[lo[r] + j] * kv_row + d0;
              Vec vv[kDimVecs];
              for (int v = 0; v < kDimVecs; ++v) vv[v] = load_floats(value + v * kLanes);
              for (int h = 0; h < kHeadsPerPass; ++h) {
                if (h < heads) {
                  const float p = row_scores(r, g0 + h)[j];
                  for (int v = 0; v < kDimVecs; ++v) acc[h][v] += p * vv[v];
                }
              }
            }
            for (int64_t h = 0; h < heads; ++h) std::memcpy(held + h * kDimVecs, acc[h], sizeof(acc[h]));
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          float lanes[kDimVecs * kLanes];
          std::memcpy(lanes, sums.data() + (r * group + g) * kDimVecs, sizeof(lanes));
          for (int64_t i = 0; i < kDimVecs * kLanes; ++i) out(r, g)[d0 + i] = from_float<T>(lanes[i]);
        }
      }
    }
    for (int64_t r = 0; r < rows && d0 < head_dim; ++r) {
      for (int64_t g = 0; g < group; ++g) {
        // the dimensions left over (head_dim not a multiple of kDimVecs vectors)
        const float* sg = row_scores(r, g);
        std::vector<float> acc(head_dim - d0, 0.f);
        for (int64_t j = 0; j < len[r]; ++j) {
          const C* value = values + slots[lo[r] + j] * kv_row + d0;
          for (int64_t i = 0; i < head_dim - d0; ++i) acc[i] += sg[j] * to_float(value[i]);
        }
        for (int64_t i = 0; i < head_dim - d0; ++i) out(r, g)[d0 + i] = from_float<T>(acc[i]);
      }
    }
  });
}

#if KVSERVE_HAS_AVX512_BF16
// decode_attention_impl for a bfloat16 query and cache (head_dim a multiple of 32) on AVX512-BF16's
// vdpbf16ps, which multiplies pairs of bfloat16 values exactly and adds both products to a float32
// lane: q . k for 16 keys takes head_dim / 32 instructions per key (the FMA kernel widens each key
// and runs head_dim / 16 FMAs per query head), each key's lanes summed by sum_lanes_each (a tail of
// fewer keys beside zeros, so a key's score does not depend on how many keys share its pass). The
// probabilities are rounded to bfloat16, as transformers' eager attention rounds them to the
// query's dtype, and multiply two keys' values at once: the value rows interleaved (unpack lo/hi
// puts the dimension pairs (v_j[d], v_j+1[d]) in float lanes) against (p_j, p_j+1) in every lane.
// A row's arithmetic depends only on its own keys.
void decode_attention_bf16(const Paged<c10::BFloat16, c10::BFloat16>& a) {
  constexpr int kHeadsPerPass = 4;
  const int64_t group = a.group(), head_dim = a.head_dim, kv_row = a.kv_row(), dim_vecs = head_dim / 32;
  const auto raw = [](const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); };
  // The values' dimension pairs land in the accumulators' lanes as unpack lo/hi place them: lo lane
  // 4L + i is dimension 8L + i, hi lane 4L + i is 8L + 4 + i (L, i < 4); these put them back in order.
  const __m512i dims_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i dims_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  // tiles of one row: slots are row b's keys (first, its first position, unused)
  for_each_attention_task<1>(a, [&](int64_t b, int64_t /*rows*/, int64_t kvh, const std::vector<int64_t>& slots,
                                    int64_t /*first*/, auto pace) {
    thread_local std::vector<float> scores;
    thread_local std::vector<uint16_t> probs;  // per query head, padded with zeros to an even count
    const int64_t len = static_cast<int64_t>(slots.size()), padded = len + (len & 1);
    const uint16_t* keys = raw(a.k_cache) + kvh * head_dim;
    const uint16_t* values = raw(a.v_cache) + kvh * head_dim;
    const uint16_t* q = raw(a.qkv) + b * a.row() + kvh * group * head_dim;
    scratch(scores, len + 16);  // room for a last whole vector of scores
    scratch(probs, group * padded + 16);
    for (int64_t g = 0; g < group; ++g) {
      const uint16_t* qg = q + g * head_dim;
      for (int64_t j = 0; j < len; j += 16) {
        Vec acc[16] = {};
        const auto dots = [&](auto count) {  // 16 (unrolled), or the tail's count
          for (int64_t d = 0; d < dim_vecs; ++d) {
            const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qg + 32 * d));
            for (int64_t k = 0; k < count; ++k) {
              const __m512i key = _mm512_loadu_si512(keys + slots[j + k] * kv_row + 32 * d);
              acc[k] = reinterpret_cast<Vec>(
                  _mm512_dpbf16_ps(reinterpret_cast<__m512>(acc[k]), qv, reinterpret_cast<__m512bh>(key)));
            }
          }
        };
        if (j + 16 <= len) {
          dots(std::integral_constant<int64_t, 16>{});
        } else {
          dots(len - j);
        }
        const Vec scaled = sum_lanes_each(acc) * a.scale;
        std::memcpy(scores.data() + j, &scaled, sizeof(scaled));
        pace(16, group * len);
      }
      const __m512 inv = _mm512_set1_ps(1.f / exp_sum(scores.data(), len));
      uint16_t* pg = probs.data() + g * padded;
      for (int64_t j = 0; j < padded; j += 16) {  // scores past len read as 0
        const __mmask16 live = len - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - j)) - 1);
        const __mmask16 kept = padded - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (padded - j)) - 1);
        const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, scores.data() + j), inv);
        _mm256_mask_storeu_epi16(pg + j, kept, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
      }
    }
    uint16_t* o = reinterpret_cast<uint16_t*>(a.out) + b * a.num_heads * head_dim + kvh * group * head_dim;
    for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
      const int64_t heads = std::min<int64_t>(kHeadsPerPass, group - g0);
      for (int64_t d = 0; d < dim_vecs; d += 2) {
        const int64_t nv = std::min<int64_t>(2, dim_vecs - d);  // 32-dimension vectors in this pass
        __m512 acc[kHeadsPerPass][4];
        for (auto& h : acc) h[0] = h[1] = h[2] = h[3] = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; j += 2) {
          const uint16_t* v0 = values + slots[j] * kv_row + 32 * d;
          const uint16_t* v1 = j + 1 < len ? values + slots[j + 1] * kv_row + 32 * d : nullptr;
          __m512bh pairs[4];
          for (int64_t v = 0; v < nv; ++v) {
            const __m512i first = _mm512_loadu_si512(v0 + 32 * v);
            const __m512i second = v1 != nullptr ? _mm512_loadu_si512(v1 + 32 * v) : _mm512_setzero_si512();
            pairs[2 * v] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(first, second));
            pairs[2 * v + 1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(first, second));
          }
          for (int64_t h = 0; h < heads; ++h) {
            int32_t pair;  // (p_j, p_j+1)
            std::memcpy(&pair, probs.data() + (g0 + h) * padded + j, sizeof(pair));
            const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
            for (int64_t v = 0; v < 2 * nv; ++v) acc[h][v] = _mm512_dpbf16_ps(acc[h][v], pairs[v], p);
          }
        }
        for (int64_t h = 0; h < heads; ++h) {
          uint16_t* oh = o + (g0 + h) * head_dim + 32 * d;
          for (int64_t v = 0; v < nv; ++v) {
            const __m512 low = _mm512_permutex2var_ps(acc[h][2 * v], dims_lo, acc[h][2 * v + 1]);
            const __m512 high = _mm512_permutex2var_ps(acc[h][2 * v], dims_hi, acc[h][2 * v + 1]);
            _mm512_storeu_si512(oh + 32 * v, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
          }
        }
      }
    }
  });
}
#endif

// Causal attention of fresh prompts (no earlier context): rows [starts[s], starts[s + 1]) of qkv are
// sequence s's tokens, its keys and values their own.
//
// With AVX2 (and head_dim a multiple of 16), as a blocked GEMM that skips the keys past the diagonal.
// Each task is 32 positions of one sequence times the query heads of one KV head, their rows ordered
// position-major, so a tile of 6 rows spans two positions. Keys transposed into panels of 16 (K^T,
// once per layer) give the tile's scores up to its last position; each row's softmax runs over its
// own keys (exp_sum) with the rest zeroed; the tile's outputs are then the probabilities times the
// values up to its last position, 16 dimensions at a time. Both products are panel_tile's, so about
// the causal half of the work is all that is done. Tasks run longest first, taken by whichever
// thread is free.
//
// Elsewhere (and where a window leaves out keys) PyTorch's flash kernel, in query chunks of
// kPrefillChunk, each over the keys up to its own last token (a mask for the diagonal block and the
// window): it does not skip the keys past the diagonal.
#if KVSERVE_HAS_AVX2_FMA
template <typename T>
void causal_attention_avx2(const T* qkv, T* out, const std::vector<int64_t>& starts, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, float scale) {
  constexpr int64_t kPositions = 32, kTileRows = 6, kPanel = 16;
  const int64_t group = num_heads / num_kv_heads, dim = head_dim, kv_dim = num_kv_heads * head_dim;
  const int64_t row_len = num_heads * head_dim + 2 * kv_dim, rows_per_task = group * kPositions;
  const int64_t num_seqs = static_cast<int64_t>(starts.size()) - 1;
  // Per sequence and KV head: keys as panels [position / 16][dim][16] (zero past the end), values
  // as [position][dim], in float32.
  std::vector<int64_t> panel_base(num_seqs + 1, 0), value_base(num_seqs + 1, 0);
  struct Task {
    int64_t seq, first, head, cost;
  };
  std::vector<Task> tasks;
  int64_t widest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = starts[s + 1] - starts[s], padded = (len + kPanel - 1) / kPanel * kPanel;
    panel_base[s + 1] = panel_base[s] + num_kv_heads * padded * dim;
    value_base[s + 1] = value_base[s] + num_kv_heads * len * dim;
    widest = std::max(widest, padded);
    for (int64_t first = 0; first < len; first += kPositions) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        tasks.push_back({s, first, h, std::min(kPositions, len - first) * (first + kPositions)});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::vector<float> keys(panel_base[num_seqs], 0.f), values(value_base[num_seqs]);
  at::parallel_for(0, starts.back(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = std::upper_bound(starts.begin(), starts.end(), t) - starts.begin() - 1;
      const int64_t pos = t - starts[s], len = starts[s + 1] - starts[s];
      const int64_t padded = (len + kPanel - 1) / kPanel * kPanel;
      const T* k = qkv + t * row_len + num_heads * head_dim;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        float* panel = keys.data() + panel_base[s] + (h * padded + pos / kPanel * kPanel) * dim + pos % kPanel;
        float* value = values.data() + value_base[s] + (h * len + pos) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          panel[d * kPanel] = to_float(k[h * dim + d]);
          value[d] = to_float(k[kv_dim + h * dim + d]);
        }
      }
    }
  });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> q(rows_per_task * dim), scores(rows_per_task * widest), o(rows_per_task * dim);
    std::vector<float> inverse_sum(rows_per_task);
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      const Task& task = tasks[i];
      const int64_t len = starts[task.seq + 1] - starts[task.seq], padded = (len + kPanel - 1) / kPanel * kPanel;
      const int64_t positions = std::min(kPositions, len - task.first), rows = positions * group;
      const T* first_row = qkv + (starts[task.seq] + task.first) * row_len;
      for (int64_t r = 0; r < rows; ++r) {  // row r: position r / group, query head task.head * group + r % group
        const T* src = first_row + r / group * row_len + (task.head * group + r % group) * dim;
        for (int64_t d = 0; d < dim; ++d) q[r * dim + d] = to_float(src[d]) * scale;
      }
      const float* k_panels = keys.data() + panel_base[task.seq] + task.head * padded * dim;
      const float* v_rows = values.data() + value_base[task.seq] + task.head * len * dim;
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
        const int64_t tile_rows = std::min(kTileRows, rows - r0);
        const int64_t last = task.first + (r0 + tile_rows - 1) / group;  // the tile's last position
        float* s = scores.data() + r0 * widest;
        for (int64_t p = 0; p <= last / kPanel; ++p) {
          panel_tile_rows(tile_rows, q.data() + r0 * dim, dim, k_panels + p * kPanel * dim, kPanel, dim,
                          s + p * kPanel, widest, kPanel);
        }
        for (int64_t r = r0; r < r0 + tile_rows; ++r) {
          const int64_t pos = task.first + r / group;
          float* row = scores.data() + r * widest;
          inverse_sum[r] = 1.f / exp_sum(row, pos + 1);
          std::fill(row + pos + 1, row + last + 1, 0.f);
        }
        for (int64_t c = 0; c < dim; c += kPanel) {
          panel_tile_rows(tile_rows, s, widest, v_rows + c, dim, last + 1, o.data() + r0 * dim + c, dim, kPanel);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = starts[task.seq] + task.first + r / group;
        T* dst = out + token * num_heads * dim + (task.head * group + r % group) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = from_float<T>(o[r * dim + d] * inverse_sum[r]);
      }
    }
  });
}
#endif

constexpr int64_t kPrefillChunk = 128;  // query rows per SDPA call where the blocked kernel does not run

}  // namespace

void decode_attention(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
                      const LayerShape& shape, int64_t window) {
  with_compute_type(qkv.scalar_type(), [&](auto compute) {
    with_cache_type(k_cache.scalar_type(), [&](auto stored) {
      using T = decltype(compute);
      using C = decltype(stored);
      const Paged<T, C> args{qkv.data_ptr<T>(),
                             k_cache.data_ptr<C>(),
                             v_cache.data_ptr<C>(),
                             block_tables.data_ptr<int64_t>(),
                             seq_lens.data_ptr<int64_t>(),
                             out.data_ptr<T>(),
                             qkv.size(0),
                             block_tables.size(1),
                             k_cache.size(1),
                             shape.num_heads,
                             shape.num_kv_heads,
                             shape.head_dim,
                             window,
                             static_cast<float>(shape.scale)};
#if KVSERVE_HAS_AVX512_BF16
      if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) {
        if (shape.head_dim % 32 == 0) return decode_attention_bf16(args);
      }
#endif
      decode_attention_impl<T, C>(args);
    });
  });
}

void prefill_attention(const at::Tensor& qkv, at::Tensor& out, const std::vector<int64_t>& starts,
                       const LayerShape& shape, int64_t window) {
  const int64_t num_heads = shape.num_heads, num_kv_heads = shape.num_kv_heads, head_dim = shape.head_dim;
  int64_t longest = 0;
  for (size_t s = 0; s + 1 < starts.size(); ++s) longest = std::max(longest, starts[s + 1] - starts[s]);
  const bool windowed = window > 0 && longest > window;  // else the window holds every key
#if KVSERVE_HAS_AVX2_FMA
  if (head_dim % 16 == 0 && num_heads % num_kv_heads == 0 && !windowed) {
    with_compute_type(qkv.scalar_type(), [&](auto compute) {
      using T = decltype(compute);
      causal_attention_avx2<T>(qkv.data_ptr<T>(), out.data_ptr<T>(), starts, num_heads, num_kv_heads, head_dim,
                               static_cast<float>(shape.scale));
    });
    return;
  }
#endif
  const int64_t qd = num_heads * head_dim, kd = num_kv_heads * head_dim;
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    const int64_t begin = starts[s], len = starts[s + 1] - starts[s];
    const at::Tensor rows = qkv.narrow(0, begin, len);
    const at::Tensor k = rows.narrow(1, qd, kd).view({len, num_kv_heads, head_dim}).transpose(0, 1).unsqueeze(0);
    const at::Tensor v = rows.narrow(1, qd + kd, kd).view({len, num_kv_heads, head_dim}).transpose(0, 1).unsqueeze(0);
    for (int64_t c = 0; c < len; c += kPrefillChunk) {
      const int64_t end = std::min(c + kPrefillChunk, len);
      const at::Tensor q = rows.narrow(0, c, end - c).narrow(1, 0, qd).view({end - c, num_heads, head_dim});
      at::Tensor mask = at::ones({end - c, end}, qkv.options().dtype(at::kBool)).tril(c);
      if (windowed) mask.logical_and_(mask.triu(c - window + 1));  // query c + i sees keys > c + i - window
      const at::Tensor o = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.narrow(2, 0, end),
                                                            v.narrow(2, 0, end), mask, 0.0, false, shape.scale,
                                                            num_heads != num_kv_heads);  // [1, H, chunk, D]
      out.narrow(0, begin + c, end - c).view({end - c, num_heads, head_dim}).copy_(o[0].transpose(0, 1));
    }
  }
}

}  // namespace kvserve
