// The entry points of each kernel family, and the types the layer loop shares with Python.
// Shapes: x [M, K] activations, weights [N, K] (or packed), results [M, N].
#pragma once

#include <vector>

#include "common.h"

namespace kvserve {

// ----- int4_mm.cpp: int4 weights (int4_packing.h) times float inputs ----------------------------
// x @ W.T, out [M, N] in x's dtype; with int8_activations (and kInt8Activations, groups of
// kInt8Group), x's rows quantized to int8 per group (int4_int8_mm).
at::Tensor int4_mm(at::Tensor x, at::Tensor packed, at::Tensor scales_mins, int64_t n, int64_t group_size,
                   int64_t block_n, bool int8_activations);
// The transposed weight W.T [K, N] in `dtype` (float32 or bfloat16), for a GEMM over many rows.
at::Tensor dequantize_int4(at::Tensor packed, at::Tensor scales_mins, int64_t n, int64_t k, int64_t group_size,
                           int64_t block_n, at::ScalarType dtype);

// ----- int4_int8.cpp: int4 weights times int8-quantized activations -----------------------------
constexpr bool kInt8Activations = KVSERVE_HAS_INT8_ACTIVATIONS;
constexpr int64_t kInt8Group = 32;  // inputs per int8 scale, and the int4 group size this path takes
// A buffer (thread_local at the caller) of at least n elements, kept between calls and only grown:
// no allocation and no zero fill per call (callers zero what they pad).
template <typename T>
inline T* scratch(std::vector<T>& buffer, size_t n) {
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}
// out = x @ W.T for float32 x [M, K], int4 groups of kInt8Group, block_n 32 or 64; out float32 or
// bfloat16 [M, N]. Needs kInt8Activations.
void int4_int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_mins, int64_t n,
                  int64_t block_n, at::Tensor& out);

// ----- int8_int8.cpp: int8 codes with a scale per group of 32 times int8-quantized activations --
// out [M, V] float32 = x @ (codes * scales).T for float32 x [M, K], its rows quantized per group of
// kInt8Group (codes in -127..127, as GGML's Q8_0 and Q5_0). Needs kInt8Activations.
void int8_group_matmul_int8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, at::Tensor& out);

// ----- int8_pairs.cpp: the same codes stored 16 output rows x 2 inputs interleaved -----------------
// Whether this build has int8_pairs_matmul (AVX512-BF16).
bool int8_pairs_usable();
// x @ (codes * scales).T in float32 [M, v] for bfloat16 x [M, K]; pairs [V / 16, K / 2, 16, 2] int8
// and pair_scales [V / 16, K / 32, 16] float32 (V >= v, rows past v zero).
at::Tensor int8_pairs_matmul(at::Tensor x, at::Tensor pairs, at::Tensor pair_scales, int64_t v);

// ----- int8_quads.cpp: the same codes stored 16 output rows x 4 inputs interleaved -----------------
// Whether this build has int8_quads_matmul (AVX2, FMA and F16C; vpdpbusd on AVX512-VNNI).
bool int8_quads_usable();
// x @ (codes * scales).T in float32 [M, v], x quantized to int8 per group of 32 as
// int8_group_matmul_int8 quantizes it; quads [V / 16, K / 4, 16, 4] uint8 (8 bits, each code + 128)
// or [V / 16, K / 32, 320] uint8 (5 bits, nibbles and fifth-bit masks), quad_scales
// [V / 16, K / 32, 16] float32 or float16; or GGML's Q6_K: quads [V / 16, K / 32, 384] uint8 (6 bits)
// with K-quant scales [V / 16, K / 256, 288] uint8 (layers/quads.py).
at::Tensor int8_quads_matmul(at::Tensor x, at::Tensor quads, at::Tensor quad_scales, int64_t v);

#if KVSERVE_HAS_AMX_INT8
// The AMX tiles of the int8 kernels (int8_quads.cpp, int4_int8.cpp): 0, 3, 4 and 5 C, 16 rows x 16
// outputs int32; 1 A, 16 rows x 32 int8 inputs; 2 and 6 B, 8 rows of 16 outputs x 4 inputs (one
// group's codes).
// For this thread, before its first tile instruction.
inline void load_int8_tile_config() {
  struct alignas(64) Config {
    uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int c : {0, 3, 4, 5}) {
    config.rows[c] = 16;
    config.colsb[c] = 64;
  }
  config.rows[1] = 16;
  config.colsb[1] = 32;
  for (int b : {2, 6}) {
    config.rows[b] = 8;
    config.colsb[b] = 64;
  }
  asm volatile("" ::: "memory");  // the stores above before ldtilecfg, which reads them
  _tile_loadconfig(&config);
}
#endif

#if KVSERVE_HAS_AVX2_FMA
// float32 rounded to bfloat16 as c10::BFloat16 rounds (to nearest even; NaN to 0x7FC0), kept in a
// float whose low 16 bits are zero (load8_bf16, the other way, is in common.h).
inline __m256 round8_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                                           _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                          _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
inline void store8_bf16(c10::BFloat16* p, __m256 rounded) {  // rounded: round8_bf16's output
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// 8 outputs to dst rounded to O as from_float<O> rounds them (float16 one at a time).
template <typename O>
inline void store8(O* dst, __m256 values) {
  if constexpr (std::is_same_v<O, float>) {
    _mm256_storeu_ps(dst, values);
  } else if constexpr (std::is_same_v<O, c10::BFloat16>) {
    store8_bf16(dst, round8_bf16(values));
  } else {
    float lanes[8];
    _mm256_storeu_ps(lanes, values);
    for (int i = 0; i < 8; ++i) dst[i] = from_float<O>(lanes[i]);
  }
}
#endif

#if KVSERVE_HAS_AVX512
// exp8 (common.h) 16 lanes at a time: the same operations per lane, so the same bits.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n));
}

// round8_bf16 16 lanes at a time (c10::BFloat16's rounding, kept in a float).
inline __m512 round16_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                                           _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(rounded), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                            _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

#endif

// 16 float outputs to dst, or its first `cols` where fewer (a last vector of rows).
#if KVSERVE_HAS_AVX512
inline void store_outputs(float* dst, __m512 values, int64_t cols) {
  if (cols == 16) {
    _mm512_storeu_ps(dst, values);
  } else {
    _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << cols) - 1), values);
  }
}

// 16 outputs to dst rounded to O as from_float<O> rounds them: bfloat16 to nearest even with NaN as
// 0x7FC0 (c10::BFloat16's rounding, in integer lanes), float16 one at a time.
template <typename O>
inline void store16(O* dst, __m512 values) {
  if constexpr (std::is_same_v<O, float>) {
    _mm512_storeu_ps(dst, values);
  } else if constexpr (std::is_same_v<O, c10::BFloat16>) {
    const __m512i bits = _mm512_castps_si512(values);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i high = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    high = _mm512_mask_mov_epi32(high, _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(high));
  } else {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, values);
    for (int i = 0; i < 16; ++i) dst[i] = from_float<O>(lanes[i]);
  }
}
#endif

// ----- lm_head.cpp: int8 codes with a scale per group of 32 (GGML's Q8_0), and float weights -----
constexpr int64_t kAmxMinRows = 4;  // where the AMX tiles overtake the float tiles
// x @ (codes * scales).T in float32 [M, V]; bfloat16 x from amx_min_rows rows on AMX where usable.
at::Tensor int8_group_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t amx_min_rows);
// x @ weight.T in float32 for a float32 or bfloat16 weight [V, K], int8_group_matmul's arithmetic.
at::Tensor float32_matmul(at::Tensor x, at::Tensor weight);
// Rows [begin, end) of codes * scales, [end - begin, K] in `dtype`.
at::Tensor dequantize_int8_groups(at::Tensor codes, at::Tensor scales, int64_t begin, int64_t end,
                                  at::ScalarType dtype);

// ----- lm_head_amx.cpp: int8_group_matmul on AMX tiles ------------------------------------------
// Whether this build has AMX tiles and Linux grants this process their state.
bool amx_usable();
// out [m, v] = x [m, k] @ (codes * scales).T; only where amx_usable().
void int8_group_matmul_amx(const c10::BFloat16* x, const int8_t* codes, const float* scales, float* out, int64_t m,
                           int64_t k, int64_t v);

// ----- the layer loop's types (layer_loop.cpp; built from Python by kvserve/kernels/ops.py) -------
// How a linear layer's weight is stored, and so multiplied.
enum class LinearKind : int64_t {
  Float = 0,  // weight [N, K] in the compute dtype
  Int4 = 1,   // int4 packed (int4_packing.h), scales = scales_mins
  Int8 = 2,   // int8 [N, K] with a scale per row (scales [N])
  Int8Groups = 3,  // int8 [N, K] with a scale per 32 inputs (scales [N, K / 32] float32): Q8_0, Q5_0
  Int8Quads = 4,   // the same as int8_quads_matmul lays them out (weight [N / 16, ...] uint8 in 8, 5 or
                   // 6 bits, and its scales), for int8 inputs
};

struct Linear {
  LinearKind kind;
  at::Tensor weight, scales, bias;  // scales, bias: undefined where unused
};

// The MLP's gate: act(gate) * up.
enum class Activation : int64_t {
  SiLU = 0,      // Llama, Qwen, Phi-3, Mistral
  GeluTanh = 1,  // Gemma (GELU, tanh approximation)
};

// A decoder layer's sizes (Hugging Face config names), its attention's softmax scale, and the named
// differences between the families it serves (kvserve/models/config.py).
struct LayerShape {
  int64_t num_heads, num_kv_heads, head_dim, intermediate_size;
  double rms_norm_eps, scale;
  int64_t rotary_dim;  // the leading dimensions of each head that RoPE rotates (head_dim unless partial)
  Activation activation;
  bool qk_norm;         // an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
  bool sandwich_norms;  // RMSNorms on the attention's and the MLP's outputs too (Gemma 3)
};

// How the int4 layers multiply: up to few_rows rows int4_mm, more a float GEMM over the
// dequantized weight; block_rows is the packing's rows per block (0: unknown, PyTorch's kernel).
// One setting for every int4 layer.
struct Int4Policy {
  int64_t group_size, few_rows, block_rows;
  bool int8_activations;
};

// The layers of a decoder (norms, linears, KV caches) held between steps, and a step through them:
// see forward.
class LayerStack {
 public:
  // norms, per layer: the attention's and the MLP's input norms, then with sandwich_norms their
  // output norms, then with qk_norm the q and k head norms ([head_dim]); and, with final_norm, the
  // final norm last. linears: 4 per layer (qkv, o, gate_up, down); k_caches, v_caches: one [num_blocks, block_size,
  // num_kv_heads, head_dim] per layer, all float32, bfloat16 or float16 (the KV cache dtype, which
  // may differ from the compute dtype: keys and values are rounded to it when written). windows:
  // per layer, how many positions back a query sees (its own included; 0: all); rope_tables: per
  // layer, which of forward's cos/sin tables rotates its q and k. Without final_norm the stack is
  // a pipeline stage's share of a model's layers, and forward returns the residual stream instead.
  LayerStack(std::vector<at::Tensor> norms, std::vector<Linear> linears, std::vector<at::Tensor> k_caches,
             std::vector<at::Tensor> v_caches, LayerShape shape, Int4Policy int4, std::vector<int64_t> windows,
             std::vector<int64_t> rope_tables, bool final_norm);

  // Hidden states [B, hidden] after every layer and the final norm (without final_norm: the
  // residual stream after the last layer, its last output added, for the next stage's x), for B tokens of any sequences
  // (decode tokens, prompts, chunks): row b is a token at its position with its sequence's block
  // table, attending to its first seq_lens[b] keys (its own included; the last `window` of them in
  // a layer with a window), whose K/V are written before attention reads them. x: [B, hidden]
  // embeddings (or the previous stage's residual stream) in the norms' dtype; cos, sin_signed: [tables, B, rotary_dim]; slot_mapping,
  // seq_lens: [B] int64; block_tables: [B, max_blocks] int64.
  // With prefill_starts (S + 1 row offsets), the rows are instead the whole prompts of S fresh
  // sequences (no earlier context; block_tables and seq_lens unused): prefill_attention's step.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const std::vector<int64_t>& prefill_starts) const;

 private:
  template <typename T, typename C>
  at::Tensor forward_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const std::vector<int64_t>& prefill_starts) const;

  std::vector<at::Tensor> norms_;
  std::vector<Linear> linears_;
  std::vector<at::Tensor> k_caches_, v_caches_;
  LayerShape shape_;
  Int4Policy int4_;
  std::vector<int64_t> windows_, rope_tables_;
  int64_t norms_per_layer_;
  bool final_norm_;
};

// ----- attention.cpp ------------------------------------------------------------------------------
// out[b] = softmax(q[b] . K[b]^T * scale) V[b] over row b's own seq_lens[b] keys (the last `window`
// of them; 0: all), read through its own block table; qkv [B, (H + 2 Hkv) D] (the rotated q, k, v),
// out [B, H D].
void decode_attention(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
                      const LayerShape& shape, int64_t window);
// Causal attention of fresh prompts: rows [starts[s], starts[s + 1]) of qkv are sequence s's tokens,
// its keys and values their own; each query sees the last `window` positions (0: all).
void prefill_attention(const at::Tensor& qkv, at::Tensor& out, const std::vector<int64_t>& starts,
                       const LayerShape& shape, int64_t window);

// ----- sampling.cpp -------------------------------------------------------------------------------
// Each row's first index of its largest value (NaN counts as largest), [B] int64, as torch.argmax.
at::Tensor argmax_rows(at::Tensor logits);
// A draw from each row rows[i] of float32 [B, V] logits (filters applied) at inverse temperature
// inv_temperatures[i] under its int64 seed seeds[i]: argmax_v exp((l_v - max) / T) / -log(U_v), U_v a
// hash of the seed and v; [R] int64.
at::Tensor sample_rows(at::Tensor logits, const at::Tensor& rows, const at::Tensor& inv_temperatures,
                       const at::Tensor& seeds);
// In place: logits[rows[i], t] = -inf wherever bit t % 32 of bitmask[i, t / 32] is clear (its grammar
// forbids token t; ids past 32 W too). Each row only its own: no row's values depend on another's.
void apply_token_bitmask(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask);

}  // namespace kvserve
