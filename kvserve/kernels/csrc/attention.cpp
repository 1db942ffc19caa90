// Attention of the layer loop: decode_attention, for rows of any sequences, each reading its own
// keys and values through its block table from the paged KV cache (a row's cost is its own context,
// whatever the other rows hold); prefill_attention, causal attention of fresh prompts over their
// own keys and values.

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

// out[b, h] = softmax(q[b, h] . K[b]^T * scale) V[b] over row b's own seq_lens[b] keys, through its
// own block table (a row is a decode token or one token of a prompt). Each (row, kv head) is one
// task. Its positions' cache rows are listed once (walking the block table a block at a time).
// Where head_dim is a multiple of the vector width, keys' dot products run side by side
// (independent chains, one load of q for all): kLanes at a time with a vector FMA, their sums
// reduced together into one vector of scores, else four. The softmax's exponentials go eight at a
// time (exp_sum), and the query heads' weighted sums of values are built in registers, kDimVecs
// vectors of dimensions at a time, rather than in memory one key at a time. What is left is mostly
// reading the cache.
template <typename T, typename C>  // C: the KV cache's element type
void decode_attention_impl(const T* qkv, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                           const int64_t* seq_lens, T* out, int64_t num_seqs, int64_t max_blocks, int64_t block_size,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window) {
  constexpr int kDimVecs = kLanes < 64 ? 64 / kLanes : 1, kKeys = 4;  // 64 dimensions at a time
  constexpr int kHeadsPerPass = kLanes == 16 ? 4 : 1;  // query heads summed over the values together
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t kv_row = num_kv_heads * head_dim;
  const bool vectors = head_dim % kLanes == 0;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, q(group * head_dim);
    std::vector<int64_t> slots;
    for (int64_t task = begin; task < end; ++task) {
      // Rows taken from both ends in turn (0, n-1, 1, n-2, ...): parallel_for gives each thread a
      // contiguous range of tasks, and a prompt's rows attend over 1 to n keys, so each range then
      // holds as many long rows as short ones.
      const int64_t i = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t b = i % 2 == 0 ? i / 2 : num_seqs - 1 - i / 2;
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0;
      const int64_t len = seq_lens[b] - first_key;  // the keys it sees: positions first_key.. on
      const int64_t* table = block_tables + b * max_blocks;
      const C* keys = k_cache + kvh * head_dim;
      const C* values = v_cache + kvh * head_dim;
      slots.resize(len);
      for (int64_t pos = first_key; pos < seq_lens[b];) {  // a block at a time; blocks before the window unread
        const int64_t block = pos / block_size, end = std::min((block + 1) * block_size, seq_lens[b]);
        const int64_t base = (table[block] - block) * block_size;
        for (; pos < end; ++pos) slots[pos - first_key] = base + pos;
      }
      scores.resize(group * len);
      for (int64_t i = 0; i < group * head_dim; ++i) q[i] = to_float(qkv[b * row + kvh * group * head_dim + i]);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q.data() + g * head_dim;
        float* sg = scores.data() + g * len;
        int64_t j = 0;
#if KVSERVE_HAS_VEC_FMA
        // kLanes keys at a time (8 on AVX2, 16 on AVX-512): their sums reduced together into one
        // vector of scores (sum_lanes_each), cheaper than a scalar sum of each key's lanes.
        for (; vectors && j + kLanes <= len; j += kLanes) {
          Vec acc[kLanes];
          const C* key[kLanes];
          for (int i = 0; i < kLanes; ++i) {
            acc[i] = Vec{};
            key[i] = keys + slots[j + i] * kv_row;
          }
          for (int64_t d = 0; d < head_dim; d += kLanes) {
            const Vec qv = load_floats(qg + d);
            for (int i = 0; i < kLanes; ++i) acc[i] = fused_multiply_add(qv, load_floats(key[i] + d), acc[i]);
          }
          const Vec scaled = sum_lanes_each(acc) * scale;
          std::memcpy(sg + j, &scaled, sizeof(scaled));
        }
#endif
        for (; vectors && j + kKeys <= len; j += kKeys) {
          Vec acc[kKeys] = {};
          for (int64_t d = 0; d < head_dim; d += kLanes) {
            const Vec qv = load_floats(qg + d);
            for (int i = 0; i < kKeys; ++i) acc[i] += qv * load_floats(keys + slots[j + i] * kv_row + d);
          }
          for (int i = 0; i < kKeys; ++i) sg[j + i] = sum_lanes(acc[i]) * scale;
        }
        for (; j < len; ++j) {
          const C* key = keys + slots[j] * kv_row;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < head_dim; ++i) dot += qg[i] * to_float(key[i]);
          sg[j] = dot * scale;
        }
        const float inv = 1.f / exp_sum(sg, len);
        for (j = 0; j < len; ++j) sg[j] *= inv;
      }
      T* o = out + b * num_heads * head_dim + kvh * group * head_dim;
      // kHeadsPerPass query heads at a time share each value vector's load and widening (on AVX-512
      // their 4 x 4 accumulators fit its 32 registers; AVX2's 16 hold one head's 8).
      for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
        const int64_t heads = std::min<int64_t>(kHeadsPerPass, group - g0);
        int64_t d0 = 0;
        for (; d0 + kDimVecs * kLanes <= head_dim; d0 += kDimVecs * kLanes) {
          Vec acc[kHeadsPerPass][kDimVecs] = {};
          for (int64_t j = 0; j < len; ++j) {
            const C* value = values + slots[j] * kv_row + d0;
            Vec vv[kDimVecs];
            for (int v = 0; v < kDimVecs; ++v) vv[v] = load_floats(value + v * kLanes);
            for (int h = 0; h < kHeadsPerPass; ++h) {
              if (h < heads) {
                const float p = scores[(g0 + h) * len + j];
                for (int v = 0; v < kDimVecs; ++v) acc[h][v] += p * vv[v];
              }
            }
          }
          for (int64_t h = 0; h < heads; ++h) {
            float lanes[kDimVecs * kLanes];
            std::memcpy(lanes, acc[h], sizeof(lanes));
            for (int64_t i = 0; i < kDimVecs * kLanes; ++i) o[(g0 + h) * head_dim + d0 + i] = from_float<T>(lanes[i]);
          }
        }
        for (int64_t g = g0; g < g0 + heads && d0 < head_dim; ++g) {
          // the dimensions left over (head_dim not a multiple of kDimVecs vectors)
          const float* sg = scores.data() + g * len;
          std::vector<float> acc(head_dim - d0, 0.f);
          for (int64_t j = 0; j < len; ++j) {
            const C* value = values + slots[j] * kv_row + d0;
            for (int64_t i = 0; i < head_dim - d0; ++i) acc[i] += sg[j] * to_float(value[i]);
          }
          for (int64_t i = 0; i < head_dim - d0; ++i) o[g * head_dim + d0 + i] = from_float<T>(acc[i]);
        }
      }
    }
  });
}

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
      decode_attention_impl<T, C>(qkv.data_ptr<T>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
                                  block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<T>(),
                                  qkv.size(0), block_tables.size(1), k_cache.size(1), shape.num_heads,
                                  shape.num_kv_heads, shape.head_dim, static_cast<float>(shape.scale), window);
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
