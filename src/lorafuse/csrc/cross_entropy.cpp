// Cross-entropy chunk kernels, used by the fused linear cross-entropy per token chunk.
//
// fp32 logits (n, V), in place: per row max, sum of exp, loss = lse - logit[target], then the row
// is overwritten with grad_scale * (softmax - onehot(target)); ignored rows get loss 0 and a zero
// gradient. Pass 2 stores exp(x - max) while summing, so pass 3 is only a multiply.
//
// bf16 / fp16 logits (n, V) (the native low-precision GEMM's output), in place: the same math in
// fp32 on the upcast values (exactly `logits.float()`), and the gradient rounded to the logits'
// dtype once on the way out (exactly `grad.to(dtype)`), so no fp32 (n, V) tensor exists. Each
// task upcasts one row into a V-long fp32 buffer of its own (V=49152: 192 KiB, with the 96 KiB
// bf16 row it stays in L2), so the row is read from and written to memory once.
#include "common.h"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace lorafuse {
namespace {

// Rows of `x` (fp32, in place): exp(x - max) stored, returns (max, sum of exp).
inline std::pair<float, float> exp_in_place(float* x, int64_t V) {
  int64_t j = 0;
  fVec mv(-std::numeric_limits<float>::infinity());
  for (; j + kW <= V; j += kW) mv = at::vec::maximum(mv, fVec::loadu(x + j));
  float m = hmax(mv);
  for (; j < V; ++j) m = std::max(m, x[j]);
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
  return {m, s};
}

// Row `x` (V of T, in place) with `f` its fp32 values (`x` itself for fp32, else a V-float
// buffer): loss = lse - x[t], x <- scale * (softmax - onehot(t)) rounded to T once.
template <typename T>
float row_loss_and_grad(T* x, float* f, int64_t V, int64_t t, float scale) {
  if constexpr (!std::is_same_v<T, float>) {
    int64_t j = 0;
    for (; j + kW <= V; j += kW) load_f<T>(x + j).store(f + j);
    for (; j < V; ++j) f[j] = static_cast<float>(x[j]);
  }
  const float xt = f[t];  // read before the row is overwritten
  const auto [m, s] = exp_in_place(f, V);
  const float et = f[t];
  const float fac = scale / s;
  const fVec fv(fac);
  int64_t j = 0;
  for (; j + kW <= V; j += kW) store_f<T>(x + j, fVec::loadu(f + j) * fv);
  for (; j < V; ++j) x[j] = static_cast<T>(f[j] * fac);
  x[t] = static_cast<T>(et * fac - scale);  // fp32 `grad[t] -= scale`, then one rounding
  return m + std::log(s) - xt;
}

// Every row of `logits` (n, V) of T: loss per row into `lp`, gradient in place.
template <typename T>
void chunk_rows(T* xp, const int64_t* tp, float* lp, int64_t n, int64_t V,
                int64_t ignore_index, float scale) {
  parallel_rows(n, row_grain(V), [&](int64_t b, int64_t e) {
    thread_local std::vector<float> buf;  // a row in fp32; kept: dealt chunks come ~16 a thread
    buf.resize(std::is_same_v<T, float> ? 0 : V);
    for (int64_t i = b; i < e; ++i) {
      T* x = xp + i * V;
      float* f = std::is_same_v<T, float> ? reinterpret_cast<float*>(x) : buf.data();
      if (tp[i] == ignore_index) {
        std::fill(x, x + V, static_cast<T>(0.f));
        lp[i] = 0.f;
        continue;
      }
      lp[i] = row_loss_and_grad<T>(x, f, V, tp[i], scale);
    }
  });
}

void check_targets(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  check_2d(logits, "cross_entropy chunk", "logits");
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
}

}  // namespace

at::Tensor cross_entropy_chunk_forward_backward(at::Tensor& logits, const at::Tensor& targets,
                                                int64_t ignore_index, double grad_scale) {
  LORAFUSE_PROFILE_RANGE("cross_entropy_chunk");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "cross_entropy chunk: logits must be fp32, got ",
              logits.scalar_type());
  check_targets(logits, targets, ignore_index);
  at::Tensor loss = at::empty({logits.size(0)}, logits.options());
  chunk_rows<float>(logits.mutable_data_ptr<float>(), targets.const_data_ptr<int64_t>(),
                    loss.mutable_data_ptr<float>(), logits.size(0), logits.size(1), ignore_index,
                    static_cast<float>(grad_scale));
  return loss;
}

at::Tensor cross_entropy_chunk_forward_backward_lowp(at::Tensor& logits, const at::Tensor& targets,
                                                     int64_t ignore_index, double grad_scale) {
  LORAFUSE_PROFILE_RANGE("cross_entropy_chunk");
  const auto st = logits.scalar_type();
  TORCH_CHECK(st == at::kBFloat16 || st == at::kHalf,
              "cross_entropy chunk (low precision): logits must be bf16 or fp16, got ", st);
  check_targets(logits, targets, ignore_index);
  at::Tensor loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  const int64_t* tp = targets.const_data_ptr<int64_t>();
  float* lp = loss.mutable_data_ptr<float>();
  const float scale = static_cast<float>(grad_scale);
  if (st == at::kBFloat16) {
    chunk_rows<at::BFloat16>(logits.mutable_data_ptr<at::BFloat16>(), tp, lp, logits.size(0),
                             logits.size(1), ignore_index, scale);
  } else {
    chunk_rows<at::Half>(logits.mutable_data_ptr<at::Half>(), tp, lp, logits.size(0),
                         logits.size(1), ignore_index, scale);
  }
  return loss;
}

}  // namespace lorafuse
