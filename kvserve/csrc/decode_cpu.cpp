// A whole decode step of a Llama-family model on the CPU, in one call from Python.
//
// In eager PyTorch a decode step of a 30-layer model is ~1,200 small operator calls, each paying
// microseconds of Python and dispatcher overhead: more than the matmuls themselves on a small
// model. Here the layer loop runs in C++: the matmuls are the same ATen weight-only kernels the
// Python path calls (int4 / int8 / float), and the glue between them (RMSNorm with the residual
// add, RoPE, the KV-cache write, paged attention, SiLU*up) is fused loops over the batch.
//
// Attention reads each sequence's keys through its own block table up to its own length: the
// cost of a sequence is its own context, whatever the other sequences in the batch hold.
//
// Numerics follow the Python path (kvserve/models/llama.py): activations are stored in the
// compute dtype (bfloat16 or float32) between operations, arithmetic is done in float32.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// ----- scalar conversions (bfloat16 kept as raw bits so loops vectorize) ----------------------
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) { return c10::BFloat16(x); }  // round to nearest even

// Round-to-nearest-even float -> T without a NaN branch, so that loops over weights vectorize
// (weights are finite; activations use from_float, which keeps NaN handling).
template <typename T>
inline T weight_from_float(float x);
template <>
inline float weight_from_float<float>(float x) { return x; }
template <>
inline c10::BFloat16 weight_from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

struct Linear {
  int64_t kind;  // 0 float (weight [N, K]), 1 int4 packed (+ scales_and_zeros), 2 int8 (+ scales)
  at::Tensor weight, scales, bias;
};

at::Tensor linear(const at::Tensor& x, const Linear& l, int64_t group_size) {
  at::Tensor out;
  if (l.kind == 1) {
    out = at::_weight_int4pack_mm_for_cpu(x, l.weight, group_size, l.scales);
  } else if (l.kind == 2) {
    out = at::_weight_int8pack_mm(x, l.weight, l.scales);
  } else {
    out = at::linear(x, l.weight);
  }
  if (l.bias.defined()) out.add_(l.bias);
  return out;
}

// residual += delta (rounded to T, as a T + T add does), then out = w * T(rms_norm(residual)).
template <typename T>
void add_rms_norm(T* residual, const T* delta, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = residual + r * dim;
      float sum = 0.f;
      if (delta != nullptr) {
        const T* d = delta + r * dim;
        for (int64_t i = 0; i < dim; ++i) x[i] = from_float<T>(to_float(x[i]) + to_float(d[i]));
      }
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) {
        float v = to_float(x[i]);
        sum += v * v;
      }
      float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        float normed = to_float(from_float<T>(to_float(x[i]) * inv));
        o[i] = from_float<T>(to_float(weight[i]) * normed);
      }
    }
  });
}

// Rotate q and k (the first num_heads + num_kv_heads heads of each qkv row) in place, then write
// k and v into the caches at each token's slot.
template <typename T>
void rope_and_cache(T* qkv, const T* cos, const T* sin_signed, const int64_t* slots, T* k_cache, T* v_cache,
                    int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t kv_row = num_kv_heads * head_dim;
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * head_dim;
      const T* s = sin_signed + t * head_dim;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        T* x = qkv + t * row + h * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) {
          float rolled = to_float(x[i < half ? i + half : i - half]);
          // x * cos (rounded, as the Python path's first multiply), + rolled * sin_signed
          tmp[i] = to_float(from_float<T>(to_float(x[i]) * to_float(c[i]))) + rolled * to_float(s[i]);
        }
        for (int64_t i = 0; i < head_dim; ++i) x[i] = from_float<T>(tmp[i]);
      }
      const T* k = qkv + t * row + num_heads * head_dim;
      std::memcpy(k_cache + slots[t] * kv_row, k, kv_row * sizeof(T));
      std::memcpy(v_cache + slots[t] * kv_row, k + kv_row, kv_row * sizeof(T));
    }
  });
}

// out[b, h] = softmax(q[b, h] . K[b]^T * scale) V[b] over the sequence's own seq_lens[b] keys.
template <typename T>
void decode_attention(const T* qkv, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                      const int64_t* seq_lens, T* out, int64_t num_seqs, int64_t max_blocks, int64_t block_size,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t kv_row = num_kv_heads * head_dim;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, q(group * head_dim), acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      scores.resize(group * len);
      for (int64_t i = 0; i < group * head_dim; ++i) q[i] = to_float(qkv[b * row + kvh * group * head_dim + i]);
      for (int64_t j = 0; j < len; ++j) {
        const T* key = k_cache + (table[j / block_size] * block_size + j % block_size) * kv_row + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < head_dim; ++i) dot += qg[i] * to_float(key[i]);
          scores[g * len + j] = dot * scale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        float peak = -INFINITY;
        for (int64_t j = 0; j < len; ++j) peak = std::max(peak, sg[j]);
        float total = 0.f;
        for (int64_t j = 0; j < len; ++j) {
          sg[j] = std::exp(sg[j] - peak);
          total += sg[j];
        }
        const float inv = 1.f / total;
        for (int64_t j = 0; j < len; ++j) sg[j] *= inv;
      }
      for (int64_t j = 0; j < len; ++j) {
        const T* value = v_cache + (table[j / block_size] * block_size + j % block_size) * kv_row + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + j];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) a[i] += p * to_float(value[i]);
        }
      }
      T* o = out + b * num_heads * head_dim + kvh * group * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) o[i] = from_float<T>(acc[i]);
    }
  });
}

// out = T(silu(gate)) * up, rounded like F.silu(gate) * up.
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        float x = to_float(g[i]);
        float s = to_float(from_float<T>(x / (1.f + std::exp(-x))));
        o[i] = from_float<T>(s * to_float(u[i]));
      }
    }
  });
}

template <typename T>
at::Tensor forward_impl(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin_signed,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        const std::vector<at::Tensor>& norms, const std::vector<Linear>& linears,
                        const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
                        double scale, int64_t group_size) {
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  const int64_t block_size = k_caches[0].size(1);
  at::Tensor residual = x.contiguous().clone();
  at::Tensor normed = at::empty_like(residual);
  at::Tensor attn = at::empty({tokens, num_heads * head_dim}, x.options());
  at::Tensor act = at::empty({tokens, intermediate}, x.options());
  at::Tensor delta;  // the previous sub-layer's output, added to the residual by the next norm
  for (int64_t l = 0; l < num_layers; ++l) {
    add_rms_norm<T>(residual.data_ptr<T>(), delta.defined() ? delta.data_ptr<T>() : nullptr,
                    norms[2 * l].data_ptr<T>(), normed.data_ptr<T>(), tokens, hidden, static_cast<float>(eps));
    at::Tensor qkv = linear(normed, linears[4 * l], group_size).contiguous();
    rope_and_cache<T>(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin_signed.data_ptr<T>(), slot_mapping.data_ptr<int64_t>(),
                      k_caches[l].data_ptr<T>(), v_caches[l].data_ptr<T>(), tokens, num_heads, num_kv_heads,
                      head_dim);
    decode_attention<T>(qkv.data_ptr<T>(), k_caches[l].data_ptr<T>(), v_caches[l].data_ptr<T>(),
                        block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), attn.data_ptr<T>(), tokens,
                        block_tables.size(1), block_size, num_heads, num_kv_heads, head_dim,
                        static_cast<float>(scale));
    delta = linear(attn, linears[4 * l + 1], group_size).contiguous();
    add_rms_norm<T>(residual.data_ptr<T>(), delta.data_ptr<T>(), norms[2 * l + 1].data_ptr<T>(),
                    normed.data_ptr<T>(), tokens, hidden, static_cast<float>(eps));
    at::Tensor gate_up = linear(normed, linears[4 * l + 2], group_size).contiguous();
    silu_mul<T>(gate_up.data_ptr<T>(), act.data_ptr<T>(), tokens, intermediate);
    delta = linear(act, linears[4 * l + 3], group_size).contiguous();
  }
  add_rms_norm<T>(residual.data_ptr<T>(), delta.data_ptr<T>(), norms[2 * num_layers].data_ptr<T>(),
                  normed.data_ptr<T>(), tokens, hidden, static_cast<float>(eps));
  return normed;
}

}  // namespace

// One decode step (one new token per sequence) through every layer and the final norm.
// x: [B, hidden] embeddings; cos, sin_signed: [B, head_dim]; slot_mapping, seq_lens: [B] int64;
// block_tables: [B, max_blocks] int64; norms: 2 per layer + the final one; linears: 4 per layer
// (qkv, o, gate_up, down) as (kind, weight, scales, bias) with undefined tensors where unused.
at::Tensor decode_forward(at::Tensor x, at::Tensor cos, at::Tensor sin_signed, at::Tensor slot_mapping,
                          at::Tensor block_tables, at::Tensor seq_lens, std::vector<at::Tensor> norms,
                          std::vector<int64_t> kinds, std::vector<at::Tensor> weights,
                          std::vector<std::optional<at::Tensor>> scales, std::vector<std::optional<at::Tensor>> biases,
                          std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale,
                          int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [B, hidden] tensor");
  TORCH_CHECK(k_caches.size() * 4 == kinds.size() && norms.size() == 2 * k_caches.size() + 1, "bad layer lists");
  std::vector<Linear> linears;
  for (size_t i = 0; i < kinds.size(); ++i) {
    linears.push_back({kinds[i], weights[i], scales[i].has_value() ? *scales[i] : at::Tensor(),
                       biases[i].has_value() ? *biases[i] : at::Tensor()});
  }
  c10::InferenceMode guard;
  if (x.scalar_type() == at::kBFloat16) {
    return forward_impl<c10::BFloat16>(x, cos, sin_signed, slot_mapping, block_tables, seq_lens, norms, linears,
                                       k_caches, v_caches, num_heads, num_kv_heads, head_dim, intermediate, eps,
                                       scale, group_size);
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat, "decode_forward runs in float32 or bfloat16");
  return forward_impl<float>(x, cos, sin_signed, slot_mapping, block_tables, seq_lens, norms, linears, k_caches,
                             v_caches, num_heads, num_kv_heads, head_dim, intermediate, eps, scale, group_size);
}

// ----- dequantization, for matmuls over many rows (prefill, large batches) ----------------------
// The weight-only kernels re-read the weights for every row; a bf16 GEMM reuses them. For many
// rows it is faster to dequantize a layer's weight into a temporary and call the GEMM.

template <typename T>
void dequantize_int4_impl(const uint8_t* packed, const T* scales_and_zeros, T* out, int64_t n, int64_t k,
                          int64_t group_size) {
  // Layout of aten::_convert_weight_to_int4pack_for_cpu: blocks of 64 output rows; in a block, byte
  // (k * 32 + i) holds row i (low nibble) and row i + 32 (high nibble) at input k. Checked at run
  // time against the op itself (kvserve/layers/quantized.py), so a different layout disables this.
  // Writes the transposed weight [K, N], so every store and every byte load is contiguous.
  at::parallel_for(0, k / group_size, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(n), zero(n);
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t j = 0; j < n; ++j) {
        scale[j] = to_float(scales_and_zeros[(g * n + j) * 2]);
        zero[j] = to_float(scales_and_zeros[(g * n + j) * 2 + 1]) - 8.f * scale[j];
      }
      for (int64_t c = g * group_size; c < (g + 1) * group_size; ++c) {
        T* o = out + c * n;
        for (int64_t nb = 0; nb < n / 64; ++nb) {
          const uint8_t* bytes = packed + nb * 64 * (k / 2) + c * 32;
          const float* sc = scale.data() + nb * 64;
          const float* zr = zero.data() + nb * 64;
          T* ob = o + nb * 64;
#pragma omp simd
          for (int64_t i = 0; i < 32; ++i) {
            ob[i] = weight_from_float<T>(static_cast<float>(bytes[i] & 0xF) * sc[i] + zr[i]);
            ob[i + 32] = weight_from_float<T>(static_cast<float>(bytes[i] >> 4) * sc[i + 32] + zr[i + 32]);
          }
        }
      }
    }
  });
}

// The transposed weight of an Int4Linear, [K, N], in the dtype of its scales.
at::Tensor dequantize_int4(at::Tensor packed, at::Tensor scales_and_zeros, int64_t n, int64_t k, int64_t group_size) {
  TORCH_CHECK(n % 64 == 0 && k % group_size == 0, "dequantize_int4 takes whole blocks of 64 rows");
  at::Tensor out = at::empty({k, n}, scales_and_zeros.options());
  if (out.scalar_type() == at::kBFloat16) {
    dequantize_int4_impl<c10::BFloat16>(packed.data_ptr<uint8_t>(), scales_and_zeros.data_ptr<c10::BFloat16>(),
                                        out.data_ptr<c10::BFloat16>(), n, k, group_size);
  } else {
    dequantize_int4_impl<float>(packed.data_ptr<uint8_t>(), scales_and_zeros.data_ptr<float>(),
                                out.data_ptr<float>(), n, k, group_size);
  }
  return out;
}

// ----- int8 with a scale per group of 32 (GGML's Q8_0 layout): the tied lm_head -------------------
// out[m, v] = sum_k x[m, k] * codes[v, k] * scales[v, k / 32], float32 out. The codes are read
// once per call whatever M is; meant for the few rows a decode step samples.
template <typename T>
void int8_group_matmul_impl(const T* x, const int8_t* codes, const float* scales, float* out, int64_t m, int64_t k,
                            int64_t v) {
  constexpr int64_t kGroup = 32;
  const int64_t groups = k / kGroup;
  std::vector<float> xf(m * k);
  for (int64_t i = 0; i < m * k; ++i) xf[i] = to_float(x[i]);
  at::parallel_for(0, v, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int8_t* c = codes + row * k;
      const float* s = scales + row * groups;
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = xf.data() + r * k;
        // 16 lanes of partial sums (one AVX-512 register), one horizontal sum per row at the end
        float lanes[16] = {0.f};
        for (int64_t g = 0; g < groups; ++g) {
          const float sg = s[g];
          const float* xg = xr + g * kGroup;
          const int8_t* cg = c + g * kGroup;
#pragma omp simd
          for (int64_t j = 0; j < 16; ++j) lanes[j] += xg[j] * sg * static_cast<float>(cg[j]);
#pragma omp simd
          for (int64_t j = 0; j < 16; ++j) lanes[j] += xg[16 + j] * sg * static_cast<float>(cg[16 + j]);
        }
        float acc = 0.f;
        for (int64_t j = 0; j < 16; ++j) acc += lanes[j];
        out[r * v + row] = acc;
      }
    }
  });
}

at::Tensor int8_group_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1) && codes.size(1) % 32 == 0,
              "int8_group_matmul: x [M, K], codes [V, K] with K a multiple of 32");
  x = x.contiguous();
  at::Tensor out = at::empty({x.size(0), codes.size(0)}, x.options().dtype(at::kFloat));
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

// rows [begin, end) of codes * scales (a scale per 32 values), as [end - begin, K] in `dtype`.
at::Tensor dequantize_int8_groups(at::Tensor codes, at::Tensor scales, int64_t begin, int64_t end,
                                  at::ScalarType dtype) {
  const int64_t k = codes.size(1), groups = k / 32;
  at::Tensor out = at::empty({end - begin, k}, codes.options().dtype(dtype));
  const int8_t* c = codes.data_ptr<int8_t>() + begin * k;
  const float* s = scales.data_ptr<float>() + begin * groups;
  auto run = [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    at::parallel_for(0, end - begin, 64, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
          const float sg = s[r * groups + g];
#pragma omp simd
          for (int64_t j = 0; j < 32; ++j) o[r * k + g * 32 + j] = weight_from_float<T>(sg * c[r * k + g * 32 + j]);
        }
      }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize_int8_groups", &dequantize_int8_groups, "rows of an int8-groups weight, [rows, K]");
  m.def("int8_group_matmul", &int8_group_matmul, "x @ (codes * group scales).T in float32, [M, V]");
  m.def("decode_forward", &decode_forward, "one decode step of a Llama model");
  m.def("dequantize_int4", &dequantize_int4, "an Int4Linear's transposed weight in its compute dtype, [K, N]");
}
