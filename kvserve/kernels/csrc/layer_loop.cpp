// The layer loop of a decoder (Llama, Qwen2/3, Gemma 3, Phi-3, Mistral) on the CPU: a whole step in
// one call from Python.
//
// In eager PyTorch a step of a 30-layer model is over a thousand small operator calls, each paying
// Python and dispatcher overhead: on a small model, more than the matmuls themselves. Here the
// layer loop runs in C++: the matmuls are those the Python path uses (int4_mm or a GEMM over the
// dequantized weight for int4, ATen's kernels for int8 and float), and the glue between them
// (RMSNorm with the residual add, RoPE, the KV-cache write, attention, SiLU*up) is fused loops over
// the batch.
//
// Numerics follow the Python path (kvserve/models/llama.py): activations are stored in the
// compute dtype (bfloat16 or float32) between operations, arithmetic is done in float32.

#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/stack.h>
#include <c10/core/InferenceMode.h>

#include <vector>

#include "kernels.h"

namespace kvserve {
namespace {

// x @ W.T + bias by the layer's kind: int4 by the policy (int4_mm for up to few_rows rows, else a
// float GEMM over the dequantized weight; PyTorch's int4 kernel for an unknown packing layout).
at::Tensor linear(const at::Tensor& x, const Linear& l, const Int4Policy& int4) {
  at::Tensor out;
  const int64_t n = l.weight.size(0);  // every kind stores [N, ...]
  switch (l.kind) {
    case LinearKind::Int4:
      if (int4.block_rows > 0 && n % int4.block_rows == 0) {
        if (x.size(0) <= int4.few_rows || int4.int8_activations) {
          out = int4_mm(x, l.weight, l.scales, n, int4.group_size, int4.block_rows, int4.int8_activations);
        } else {
          out = at::mm(x, dequantize_int4(l.weight, l.scales, n, x.size(1), int4.group_size, int4.block_rows,
                                          x.scalar_type()));
        }
      } else {
        // PyTorch's kernel computes (code - 8) * scale + zero: zero = min + 8 * scale (Int4Linear's
        // kernel_scales_and_zeros).
        const at::Tensor scales = l.scales.select(1, 0).to(at::kFloat), mins = l.scales.select(1, 1).to(at::kFloat);
        out = at::_weight_int4pack_mm_for_cpu(x, l.weight, int4.group_size,
                                              at::stack({scales, mins.add(scales.mul(8))}, -1).to(x.scalar_type()));
      }
      break;
    case LinearKind::Int8:
      out = at::_weight_int8pack_mm(x, l.weight, l.scales);
      break;
    case LinearKind::Int8Groups:
      if (int4.int8_activations) {
        out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
        int8_group_matmul_int8(x.to(at::kFloat).contiguous(), l.weight, l.scales, out);
      } else {  // the lm_head's kernel, AMX from one row where usable (as batch-invariant)
        out = int8_group_matmul(x, l.weight, l.scales, 1);
      }
      out = out.to(x.scalar_type());
      break;
    case LinearKind::Int8Quads:  // the inputs are quantized to int8 (int8 activations)
      out = int8_quads_matmul(x, l.weight, l.scales, n * 16).to(x.scalar_type());
      break;
    case LinearKind::Float:
      out = at::linear(x, l.weight);
      break;
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
        int64_t i = 0;
#if KVSERVE_HAS_AVX512
        if constexpr (std::is_same_v<T, c10::BFloat16>) {  // 16 at a time, rounded as from_float rounds
          for (; i + 16 <= dim; i += 16) store16(x + i, _mm512_add_ps(load16_bf16(x + i), load16_bf16(d + i)));
        }
#endif
        for (; i < dim; ++i) x[i] = from_float<T>(to_float(x[i]) + to_float(d[i]));
      }
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) {
        float v = to_float(x[i]);
        sum += v * v;
      }
      float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
      T* o = out + r * dim;
      int64_t i = 0;
#if KVSERVE_HAS_AVX512
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        const __m512 scale = _mm512_set1_ps(inv);
        for (; i + 16 <= dim; i += 16) {
          const __m512 normed = round16_bf16(_mm512_mul_ps(load16_bf16(x + i), scale));
          store16(o + i, _mm512_mul_ps(load16_bf16(weight + i), normed));
        }
      }
#endif
      for (; i < dim; ++i) {
        float normed = to_float(from_float<T>(to_float(x[i]) * inv));
        o[i] = from_float<T>(to_float(weight[i]) * normed);
      }
    }
  });
}

// out = w * T(rms_norm(x)) for one row of `dim` (out may be x), rounded as add_rms_norm rounds it:
// the q/k head norms.
template <typename T>
inline void rms_norm_row(const T* x, const T* weight, T* out, int64_t dim, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < dim; ++i) {
    float v = to_float(x[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) {
    out[i] = from_float<T>(to_float(weight[i]) * to_float(from_float<T>(to_float(x[i]) * inv)));
  }
}

// Per token: normalize each q and k head (with q_norm / k_norm, where given), rotate the first
// rotary_dim dimensions of each (rotate-half RoPE), then write k and v into the caches at its slot.
template <typename T, typename C>  // C: the KV cache's element type
void rope_and_cache(T* qkv, const T* cos, const T* sin_signed, const int64_t* slots, C* k_cache, C* v_cache,
                    int64_t tokens, const LayerShape& s, const T* q_norm, const T* k_norm) {
  const int64_t num_heads = s.num_heads, num_kv_heads = s.num_kv_heads, head_dim = s.head_dim;
  const int64_t rot = s.rotary_dim, half = rot / 2;
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t kv_row = num_kv_heads * head_dim;
  const float eps = static_cast<float>(s.rms_norm_eps);
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(rot);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * rot;
      const T* sn = sin_signed + t * rot;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        T* x = qkv + t * row + h * head_dim;
        const T* norm = h < num_heads ? q_norm : k_norm;
        if (norm != nullptr) rms_norm_row<T>(x, norm, x, head_dim, eps);
        for (int64_t i = 0; i < rot; ++i) {
          float rolled = to_float(x[i < half ? i + half : i - half]);
          // x * cos (rounded, as the Python path's first multiply), + rolled * sin_signed
          tmp[i] = to_float(from_float<T>(to_float(x[i]) * to_float(c[i]))) + rolled * to_float(sn[i]);
        }
        for (int64_t i = 0; i < rot; ++i) x[i] = from_float<T>(tmp[i]);
      }
      const T* k = qkv + t * row + num_heads * head_dim;
      if constexpr (std::is_same_v<T, C>) {
        std::memcpy(k_cache + slots[t] * kv_row, k, kv_row * sizeof(T));
        std::memcpy(v_cache + slots[t] * kv_row, k + kv_row, kv_row * sizeof(T));
      } else {  // rounded to the cache's type, as the Python path's copy into it does
        for (int64_t i = 0; i < kv_row; ++i) {
          k_cache[slots[t] * kv_row + i] = from_float<C>(to_float(k[i]));
          v_cache[slots[t] * kv_row + i] = from_float<C>(to_float(k[kv_row + i]));
        }
      }
    }
  });
}

// out = T(act(gate)) * up, rounded like F.silu(gate) * up. Both activations are x * sigmoid(a(x)):
// SiLU's a(x) = x, GELU-tanh's a(x) = 2 sqrt(2 / pi) (x + 0.044715 x^3), since 0.5 (1 + tanh(y)) =
// sigmoid(2 y). With AVX2, eight at a time through exp8 rather than std::exp one at a time, a
// visible share of a step.
template <typename T>
void gated_mul(const T* gate_up, T* out, int64_t rows, int64_t inter, Activation activation) {
  const bool gelu = activation == Activation::GeluTanh;
  constexpr float kGeluScale = 1.5957691216057308f, kGeluCubic = 0.044715f;  // 2 sqrt(2 / pi)
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#if KVSERVE_HAS_AVX512
      // 16 at a time: the 8-wide loop's operations per lane, so the same bits.
      const auto sigmoid_arg16 = [&](__m512 x) {
        if (!gelu) return x;
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        return _mm512_mul_ps(_mm512_set1_ps(kGeluScale), _mm512_fmadd_ps(_mm512_set1_ps(kGeluCubic), cube, x));
      };
      const auto sigmoid16 = [&](__m512 x) {  // x / (1 + exp(-a(x)))
        const __m512 negated = _mm512_castsi512_ps(
            _mm512_xor_si512(_mm512_castps_si512(sigmoid_arg16(x)), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
        return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(negated)));
      };
      if constexpr (std::is_same_v<T, float>) {
        for (; i + 16 <= inter; i += 16) {
          const __m512 act = sigmoid16(_mm512_loadu_ps(g + i));
          _mm512_storeu_ps(o + i, _mm512_mul_ps(act, _mm512_loadu_ps(u + i)));
        }
      } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (; i + 16 <= inter; i += 16) {
          const __m512 act = round16_bf16(sigmoid16(load16_bf16(g + i)));
          store16(o + i, _mm512_mul_ps(act, load16_bf16(u + i)));
        }
      }
#endif
#if KVSERVE_HAS_AVX2_FMA
      const auto sigmoid_arg = [&](__m256 x) {
        if (!gelu) return x;
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        return _mm256_mul_ps(_mm256_set1_ps(kGeluScale), _mm256_fmadd_ps(_mm256_set1_ps(kGeluCubic), cube, x));
      };
      if constexpr (std::is_same_v<T, float>) {
        for (; i + 8 <= inter; i += 8) {
          const __m256 x = _mm256_loadu_ps(g + i);
          const __m256 act = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(-sigmoid_arg(x))));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(act, _mm256_loadu_ps(u + i)));
        }
      } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (; i + 8 <= inter; i += 8) {
          const __m256 x = load8_bf16(g + i);
          const __m256 act =
              round8_bf16(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(-sigmoid_arg(x)))));
          store8_bf16(o + i, round8_bf16(_mm256_mul_ps(act, load8_bf16(u + i))));
        }
      }
#endif
      for (; i < inter; ++i) {
        const float x = to_float(g[i]);
        const float a = gelu ? kGeluScale * (x + kGeluCubic * x * x * x) : x;
        const float act = to_float(from_float<T>(x / (1.f + std::exp(-a))));
        o[i] = from_float<T>(act * to_float(u[i]));
      }
    }
  });
}

}  // namespace

LayerStack::LayerStack(std::vector<at::Tensor> norms, std::vector<Linear> linears, std::vector<at::Tensor> k_caches,
                       std::vector<at::Tensor> v_caches, LayerShape shape, Int4Policy int4,
                       std::vector<int64_t> windows, std::vector<int64_t> rope_tables, bool final_norm)
    : norms_(std::move(norms)),
      linears_(std::move(linears)),
      k_caches_(std::move(k_caches)),
      v_caches_(std::move(v_caches)),
      shape_(shape),
      int4_(int4),
      windows_(std::move(windows)),
      rope_tables_(std::move(rope_tables)),
      norms_per_layer_(2 + 2 * shape.sandwich_norms + 2 * shape.qk_norm),
      final_norm_(final_norm) {
  const size_t num_layers = k_caches_.size();
  TORCH_CHECK(num_layers > 0 && v_caches_.size() == num_layers && linears_.size() == 4 * num_layers &&
                  norms_.size() == norms_per_layer_ * num_layers + final_norm && windows_.size() == num_layers &&
                  rope_tables_.size() == num_layers,
              "LayerStack: per layer its norms, 4 linears, a K and a V cache, a window and a RoPE table; and the "
              "final norm where the stack has one");
  const at::ScalarType dtype = norms_[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "LayerStack: norms in float32 or bfloat16");
  for (const at::Tensor& norm : norms_) {
    TORCH_CHECK(norm.scalar_type() == dtype && norm.is_contiguous(), "LayerStack: contiguous norms of one dtype");
  }
  const at::Tensor& first = k_caches_[0];
  TORCH_CHECK(first.dim() == 4 && first.size(2) == shape_.num_kv_heads && first.size(3) == shape_.head_dim,
              "LayerStack: KV caches [num_blocks, block_size, num_kv_heads, head_dim]");
  for (size_t l = 0; l < num_layers; ++l) {
    for (const at::Tensor& cache : {k_caches_[l], v_caches_[l]}) {
      TORCH_CHECK(cache.scalar_type() == first.scalar_type() && cache.sizes() == first.sizes() &&
                      cache.is_contiguous(),
                  "LayerStack: the KV caches must be contiguous and of one dtype and shape");
    }
    TORCH_CHECK(windows_[l] >= 0 && rope_tables_[l] >= 0, "LayerStack: windows and RoPE tables are >= 0");
  }
  with_cache_type(first.scalar_type(), [](auto) {});  // checks the dtype
  TORCH_CHECK(shape_.num_heads % shape_.num_kv_heads == 0, "LayerStack: num_heads a multiple of num_kv_heads");
  TORCH_CHECK(shape_.rotary_dim > 0 && shape_.rotary_dim <= shape_.head_dim && shape_.rotary_dim % 2 == 0,
              "LayerStack: rotary_dim even and within head_dim");
}

template <typename T, typename C>  // T: the compute type, C: the KV cache's element type
at::Tensor LayerStack::forward_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed,
                                    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                    const at::Tensor& seq_lens, const std::vector<int64_t>& prefill_starts) const {
  const LayerShape& s = shape_;
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t num_layers = static_cast<int64_t>(k_caches_.size());
  const int64_t table_size = tokens * s.rotary_dim;  // one cos/sin table's elements
  const float eps = static_cast<float>(s.rms_norm_eps);
  at::Tensor residual = x.clone();
  at::Tensor normed = at::empty_like(residual);
  at::Tensor attn = at::empty({tokens, s.num_heads * s.head_dim}, x.options());
  at::Tensor act = at::empty({tokens, s.intermediate_size}, x.options());
  at::Tensor delta;  // the previous sub-layer's output, added to the residual by the next norm
  const auto out_norm = [&](const at::Tensor& weight) {  // a sandwich norm, on delta in place
    T* d = delta.data_ptr<T>();
    add_rms_norm<T>(d, nullptr, weight.data_ptr<T>(), d, tokens, hidden, eps);
  };
  for (int64_t l = 0; l < num_layers; ++l) {
    // this layer's norms: attention in, MLP in, [attention out, MLP out], [q heads, k heads]
    const at::Tensor* norms = norms_.data() + norms_per_layer_ * l;
    const at::Tensor* qk_norms = norms + (s.sandwich_norms ? 4 : 2);
    add_rms_norm<T>(residual.data_ptr<T>(), delta.defined() ? delta.data_ptr<T>() : nullptr, norms[0].data_ptr<T>(),
                    normed.data_ptr<T>(), tokens, hidden, eps);
    at::Tensor qkv = linear(normed, linears_[4 * l], int4_).contiguous();  // [B, (H + 2 Hkv) D]
    const int64_t table = rope_tables_[l] * table_size;
    rope_and_cache<T, C>(qkv.data_ptr<T>(), cos.data_ptr<T>() + table, sin_signed.data_ptr<T>() + table,
                         slot_mapping.data_ptr<int64_t>(), k_caches_[l].data_ptr<C>(), v_caches_[l].data_ptr<C>(),
                         tokens, s, s.qk_norm ? qk_norms[0].data_ptr<T>() : nullptr,
                         s.qk_norm ? qk_norms[1].data_ptr<T>() : nullptr);
    if (prefill_starts.empty()) {
      decode_attention(qkv, k_caches_[l], v_caches_[l], block_tables, seq_lens, attn, s, windows_[l]);
    } else {
      prefill_attention(qkv, attn, prefill_starts, s, windows_[l]);
    }
    delta = linear(attn, linears_[4 * l + 1], int4_).contiguous();
    if (s.sandwich_norms) out_norm(norms[2]);
    add_rms_norm<T>(residual.data_ptr<T>(), delta.data_ptr<T>(), norms[1].data_ptr<T>(), normed.data_ptr<T>(),
                    tokens, hidden, eps);
    at::Tensor gate_up = linear(normed, linears_[4 * l + 2], int4_).contiguous();  // [B, 2 I]
    gated_mul<T>(gate_up.data_ptr<T>(), act.data_ptr<T>(), tokens, s.intermediate_size, s.activation);
    delta = linear(act, linears_[4 * l + 3], int4_).contiguous();
    if (s.sandwich_norms) out_norm(norms[3]);
  }
  if (!final_norm_) {  // a pipeline stage: the residual stream, its last output added as the next norm would
    T* r = residual.data_ptr<T>();
    const T* d = delta.data_ptr<T>();
    at::parallel_for(0, tokens * hidden, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) r[i] = from_float<T>(to_float(r[i]) + to_float(d[i]));
    });
    return residual;
  }
  add_rms_norm<T>(residual.data_ptr<T>(), delta.data_ptr<T>(), norms_.back().data_ptr<T>(), normed.data_ptr<T>(),
                  tokens, hidden, eps);
  return normed;
}

at::Tensor LayerStack::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const std::vector<int64_t>& prefill_starts) const {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [B, hidden] tensor");
  TORCH_CHECK(x.scalar_type() == norms_[0].scalar_type(), "x must be in the norms' dtype");
  const int64_t tokens = x.size(0);
  int64_t tables = 0;
  for (int64_t t : rope_tables_) tables = std::max(tables, t + 1);
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) >= tables && cos.size(1) == tokens && cos.size(2) == shape_.rotary_dim &&
                  cos.sizes() == sin_signed.sizes() && cos.is_contiguous() && sin_signed.is_contiguous() &&
                  cos.scalar_type() == x.scalar_type() && sin_signed.scalar_type() == x.scalar_type(),
              "cos and sin_signed must be contiguous [tables, B, rotary_dim] tensors in x's dtype");
  TORCH_CHECK(slot_mapping.numel() == tokens && slot_mapping.is_contiguous(), "slot_mapping must hold a slot per row");
  if (prefill_starts.empty()) {
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == tokens && block_tables.is_contiguous() &&
                    seq_lens.numel() == tokens && seq_lens.is_contiguous(),
                "block_tables must be a contiguous [B, max_blocks] and seq_lens a [B] tensor");
  } else {
    TORCH_CHECK(prefill_starts.front() == 0 && prefill_starts.back() == tokens,
                "prefill_starts must run from 0 to the number of rows");
  }
  c10::InferenceMode guard;
  return with_compute_type(x.scalar_type(), [&](auto compute) {
    return with_cache_type(k_caches_[0].scalar_type(), [&](auto stored) {
      return forward_impl<decltype(compute), decltype(stored)>(x, cos, sin_signed, slot_mapping, block_tables,
                                                                seq_lens, prefill_starts);
    });
  });
}

}  // namespace kvserve
