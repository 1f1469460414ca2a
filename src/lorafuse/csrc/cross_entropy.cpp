// Cross-entropy chunk kernel, used by the fused linear cross-entropy per token chunk.
// Per row of logits (n, V) fp32, in place: max, sum of exp, loss = lse - logit[target], then the
// row is overwritten with grad_scale * (softmax - onehot(target)); ignored rows get loss 0 and a
// zero gradient. Pass 2 stores exp(x - max) while summing, so pass 3 is only a multiply.
#include "common.h"

#include <cmath>
#include <limits>

namespace lorafuse {
namespace {

float row_loss_and_grad(float* x, int64_t V, int64_t t, float scale) {
  int64_t j = 0;
  fVec mv(-std::numeric_limits<float>::infinity());
  for (; j + kW <= V; j += kW) mv = at::vec::maximum(mv, fVec::loadu(x + j));
  float m = hmax(mv);
  for (; j < V; ++j) m = std::max(m, x[j]);
  const float xt = x[t];  // read before the row is overwritten
  const fVec mvec(m);
  fVec sv(0.f);
  for (j = 0; j + kW <= V; j += kW) {
    fVec e = (fVec::loadu(x + j) - mvec).exp();
    e.store(x + j);
    sv = sv + e;
  }
  float s = hsum(sv);
  for (; j < V; ++j) {
    x[j] = std::exp(x[j] - m);
    s += x[j];
  }
  const float lse = m + std::log(s);
  const float f = scale / s;
  const fVec fv(f);
  for (j = 0; j + kW <= V; j += kW) (fVec::loadu(x + j) * fv).store(x + j);
  for (; j < V; ++j) x[j] *= f;
  x[t] -= scale;
  return lse - xt;
}

}  // namespace

at::Tensor cross_entropy_chunk_forward_backward(at::Tensor& logits, const at::Tensor& targets,
                                                int64_t ignore_index, double grad_scale) {
  check_2d(logits, "cross_entropy chunk", "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "cross_entropy chunk: logits must be fp32, got ",
              logits.scalar_type());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0) &&
                  targets.scalar_type() == at::kLong && targets.is_contiguous(),
              "cross_entropy chunk: targets must be contiguous int64 (", logits.size(0),
              ",), got ", targets.scalar_type(), " ", targets.sizes());
  const int64_t n = logits.size(0), V = logits.size(1);
  const int64_t* tp = targets.const_data_ptr<int64_t>();
  // Validate every target before touching logits, so an error leaves them unchanged.
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tp[i];
    // ValueError in Python, as the torch path raises.
    TORCH_CHECK_VALUE(t == ignore_index || (t >= 0 && t < V), "cross_entropy: target ", t,
                " at row ", i, " is outside [0, ", V, ") and is not ignore_index (",
                ignore_index, ")");
  }
  at::Tensor loss = at::empty({n}, logits.options());
  float* lp = loss.mutable_data_ptr<float>();
  float* xp = logits.mutable_data_ptr<float>();
  const float scale = static_cast<float>(grad_scale);
  at::parallel_for(0, n, row_grain(V), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* x = xp + i * V;
      if (tp[i] == ignore_index) {
        std::fill(x, x + V, 0.f);
        lp[i] = 0.f;
      } else {
        lp[i] = row_loss_and_grad(x, V, tp[i], scale);
      }
    }
  });
  return loss;
}

}  // namespace lorafuse
