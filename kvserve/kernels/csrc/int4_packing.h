// The int4 weight layout both int4 kernel families read (int4_mm.cpp, int4_int8.cpp): that of
// aten::_convert_weight_to_int4pack_for_cpu. Blocks of block_n output rows (64 where PyTorch's
// kernel runs AVX-512, 32 on AVX2); in a block, byte (k * block_n / 2 + i) holds row i (low
// nibble) and row i + block_n / 2 (high nibble) at input k. The block size is found at run time by
// checking dequantize_int4 against the op itself (kvserve/layers/quantized.py); no match disables
// these kernels. A weight is w = code * scale + min with (scale, min) per group of inputs, stored
// as scales_mins [K / g, 2, N] in float16 or float32.
#pragma once

#include "common.h"

namespace kvserve {

// Runs f(S*) with the data of an Int4Linear's scales_mins, float16 or float32.
template <typename F>
inline void with_scales_mins(const at::Tensor& scales_mins, F&& f) {
  if (scales_mins.scalar_type() == at::kHalf) {
    f(scales_mins.data_ptr<c10::Half>());
  } else {
    TORCH_CHECK(scales_mins.scalar_type() == at::kFloat, "int4 scales and mins are float16 or float32");
    f(scales_mins.data_ptr<float>());
  }
}

}  // namespace kvserve
