// Greedy sampling: each row's first index of its largest value, as torch.argmax, but vectorized
// (row_peak) and over rows in parallel where torch.argmax's CPU kernel runs scalar. NaN counts as
// the largest, as there: a row holding one takes the scalar loop.

#include "kernels.h"

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

}  // namespace kvserve
