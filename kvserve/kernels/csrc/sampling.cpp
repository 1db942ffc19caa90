// Greedy sampling: each row's first index of its largest value, as torch.argmax, but vectorized
// (row_peak) and over rows in parallel where torch.argmax's CPU kernel runs scalar. NaN counts as
// the largest, as there: a row holding one takes the scalar loop.
// Structured output: a grammar's token bitmask applied to its own row's logits.

#include "kernels.h"

#include <limits>

namespace kvserve {

at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "argmax_rows: float32 [B, V] logits");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "argmax_rows: empty rows");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * vocab;
      bool nan = false;
      const float best = row_peak(row, vocab, &nan);
      int64_t index = 0;
      if (nan) {
        while (!std::isnan(row[index])) ++index;
      } else {
        while (row[index] != best) ++index;
      }
      o[r] = index;
    }
  });
  return out;
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "apply_token_bitmask: contiguous float32 [B, V] logits");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask: contiguous int32 [R, W] bitmask");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: int64 [R] row indices, one per bitmask row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), num_rows = rows.size(0);
  float* x = logits.data_ptr<float>();
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_rows; ++i) TORCH_CHECK(0 <= row_ids[i] && row_ids[i] < logits.size(0), "row out of range");
  const float forbidden = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = x + row_ids[i] * vocab;
      const uint32_t* mask = masks + i * words;
      for (int64_t word = 0; word * 32 < vocab; ++word) {
        const uint32_t bits = word < words ? mask[word] : 0u;
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t last = std::min<int64_t>(32, vocab - word * 32);
        for (int64_t bit = 0; bit < last; ++bit) {
          if (!((bits >> bit) & 1u)) row[word * 32 + bit] = forbidden;
        }
      }
    }
  });
}

}  // namespace kvserve
