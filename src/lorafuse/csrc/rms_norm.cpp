// RMSNorm (HF Llama semantics):
//   h = float(x); rstd = 1/sqrt(mean(h², -1) + eps); y = w * to_dtype(h * rstd)
// and rounded once (Gemma, Qwen3.5, OLMo 3...: the weight multiply in fp32, an fp32 weight):
//   y = to_dtype(h * rstd * w)                                   (rms_norm_once_*)
// Forward: one pass per row writes y and rstd (N,) fp32.  Backward: one pass per row writes dx
// and accumulates dw into a per-block fp32 buffer (blocks of rows, one per thread, summed at the
// end in a fixed order, so results do not depend on scheduling).
#include "common.h"

#include <cmath>
#include <type_traits>
#include <vector>

namespace lorafuse {
namespace {

// w: the weight as stored (x's dtype: the ops call this kernel with equal dtypes only), converted
// in registers; an fp32 copy per call cost ~4 µs of a one-row decoding call.
template <typename T, typename W, bool kRoundOnce>
void forward_rows(const T* x, const W* w, T* y, float* rstd, int64_t N, int64_t d, float eps) {
  parallel_rows(N, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xr = x + i * d;
      T* yr = y + i * d;
      fVec acc(0.f);
      int64_t j = 0;
      for (; j + kW <= d; j += kW) {
        fVec v = load_f(xr + j);
        acc = at::vec::fmadd(v, v, acc);
      }
      float ss = hsum(acc);
      for (; j < d; ++j) {
        float v = static_cast<float>(xr[j]);
        ss += v * v;
      }
      const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
      rstd[i] = r;
      const fVec rv(r);
      for (j = 0; j + kW <= d; j += kW) {
        // Llama rounds the normalised row to x's dtype before the weight multiply; the
        // rounded-once norms multiply in fp32 and round the product.
        fVec n = load_f(xr + j) * rv;
        if constexpr (!kRoundOnce) n = round_to<T>(n);
        store_f(yr + j, load_f(w + j) * n);
      }
      for (; j < d; ++j) {
        float n = static_cast<float>(xr[j]) * r;
        if constexpr (!kRoundOnce) n = round_to_s<T>(n);
        yr[j] = static_cast<T>(static_cast<float>(w[j]) * n);
      }
    }
  });
}

// dx_j = rstd * (dn_j - n_j * mean(dn·n)), dn = g*w, n = h*rstd;  dw_j += g_j * to_dtype(n_j)
// (rounded once: dw_j += g_j * n_j, the fp32 value the forward multiplied)
template <typename T, bool kRoundOnce>
void backward_row(const T* gr, const T* xr, const float* w, float r, int64_t d, T* dxr,
                  float* dwacc) {
  const fVec rv(r);
  if (dxr != nullptr) {
    fVec acc(0.f);
    int64_t j = 0;
    for (; j + kW <= d; j += kW) {
      fVec dn = load_f(gr + j) * fVec::loadu(w + j);
      acc = at::vec::fmadd(dn, load_f(xr + j) * rv, acc);
    }
    float dot = hsum(acc);
    for (; j < d; ++j) {
      dot += static_cast<float>(gr[j]) * w[j] * static_cast<float>(xr[j]) * r;
    }
    const float c = dot / static_cast<float>(d);
    const fVec cv(c);
    for (j = 0; j + kW <= d; j += kW) {
      fVec dn = load_f(gr + j) * fVec::loadu(w + j);
      fVec n = load_f(xr + j) * rv;
      store_f(dxr + j, rv * (dn - n * cv));
    }
    for (; j < d; ++j) {
      float n = static_cast<float>(xr[j]) * r;
      dxr[j] = static_cast<T>(r * (static_cast<float>(gr[j]) * w[j] - n * c));
    }
  }
  if (dwacc != nullptr) {
    int64_t j = 0;
    for (; j + kW <= d; j += kW) {
      fVec n = load_f(xr + j) * rv;
      if constexpr (!kRoundOnce) n = round_to<T>(n);
      at::vec::fmadd(load_f(gr + j), n, fVec::loadu(dwacc + j)).store(dwacc + j);
    }
    for (; j < d; ++j) {
      float n = static_cast<float>(xr[j]) * r;
      if constexpr (!kRoundOnce) n = round_to_s<T>(n);
      dwacc[j] += static_cast<float>(gr[j]) * n;
    }
  }
}

template <typename T, bool kRoundOnce>
void backward_rows(const T* g, const T* x, const float* w, const float* rstd, int64_t N,
                   int64_t d, T* dx, float* dwbuf, int64_t nblocks) {
  if (!dwbuf) {  // no weight gradient (a frozen norm): rows independent, dealt by parallel_rows
    return parallel_rows(N, row_grain(d), [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        backward_row<T, kRoundOnce>(g + i * d, x + i * d, w, rstd[i], d, dx + i * d, nullptr);
      }
    });
  }
  at::parallel_for(0, nblocks, 1, [&](int64_t bb, int64_t be) {
    for (int64_t blk = bb; blk < be; ++blk) {
      const int64_t r0 = N * blk / nblocks, r1 = N * (blk + 1) / nblocks;
      float* acc = dwbuf ? dwbuf + blk * d : nullptr;
      for (int64_t i = r0; i < r1; ++i) {
        backward_row<T, kRoundOnce>(g + i * d, x + i * d, w, rstd[i], d, dx ? dx + i * d : nullptr, acc);
      }
    }
  });
}

void check_inputs(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  check_2d(x, op, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), op, ": weight must be (",
              x.size(1), ",), got ", weight.sizes());
}

template <bool kRoundOnce>
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& x, const at::Tensor& weight,
                                                double eps, const char* op) {
  check_inputs(x, weight, op);
  // Llama semantics: the weight in x's dtype (the ops call it with equal dtypes only); rounded
  // once: any float weight, read as fp32 (Gemma's (1 + w) is formed in fp32).
  TORCH_CHECK(kRoundOnce || weight.scalar_type() == x.scalar_type(), op, ": weight dtype ",
              weight.scalar_type(), " differs from x dtype ", x.scalar_type());
  const int64_t N = x.size(0), d = x.size(1);
  at::Tensor w = kRoundOnce ? weight.to(at::kFloat).contiguous() : weight.contiguous();
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({N}, x.options().dtype(at::kFloat));
  LORAFUSE_DISPATCH(x.scalar_type(), "rms_fwd", [&] {
    using W = std::conditional_t<kRoundOnce, float, scalar_t>;
    forward_rows<scalar_t, W, kRoundOnce>(
        x.const_data_ptr<scalar_t>(), w.const_data_ptr<W>(), y.mutable_data_ptr<scalar_t>(),
        rstd.mutable_data_ptr<float>(), N, d, static_cast<float>(eps));
  });
  return {y, rstd};
}

template <bool kRoundOnce>
std::tuple<at::Tensor, at::Tensor> backward_impl(const at::Tensor& g, const at::Tensor& x,
                                                 const at::Tensor& weight,
                                                 const at::Tensor& rstd,
                                                 std::tuple<bool, bool> needs, const char* op) {
  check_inputs(x, weight, op);
  check_2d(g, op, "grad_output");
  TORCH_CHECK(g.sizes() == x.sizes(), op, ": grad_output ", g.sizes(), " != x ", x.sizes());
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == x.size(0) &&
                  rstd.is_contiguous(),
              op, ": rstd must be contiguous fp32 (", x.size(0), ",), got ",
              rstd.scalar_type(), " ", rstd.sizes());
  auto [need_dx, need_dw] = needs;
  const int64_t N = x.size(0), d = x.size(1);
  at::Tensor gc = g.scalar_type() == x.scalar_type() ? g : g.to(x.scalar_type());
  at::Tensor w = weight.to(at::kFloat).contiguous();
  at::Tensor dx, dw, dwbuf;
  if (need_dx) dx = at::empty_like(x);
  // One fp32 partial-sum row per block of rows; blocks >= threads, each >= 8 rows.
  const int64_t nblocks =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (N + 7) / 8));
  if (need_dw) dwbuf = at::zeros({nblocks, d}, x.options().dtype(at::kFloat));
  if (need_dx || need_dw) {
    LORAFUSE_DISPATCH(x.scalar_type(), "rms_bwd", [&] {
      backward_rows<scalar_t, kRoundOnce>(
          gc.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
          w.const_data_ptr<float>(), rstd.const_data_ptr<float>(), N, d,
          need_dx ? dx.mutable_data_ptr<scalar_t>() : nullptr,
          need_dw ? dwbuf.mutable_data_ptr<float>() : nullptr, nblocks);
    });
  }
  if (need_dw) dw = dwbuf.sum(0).to(weight.scalar_type());  // (d,)
  return {dx, dw};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x,
                                                    const at::Tensor& weight, double eps) {
  LORAFUSE_PROFILE_RANGE("rms_norm_forward");
  return forward_impl<false>(x, weight, eps, "rms_norm");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& g, const at::Tensor& x,
                                                     const at::Tensor& weight,
                                                     const at::Tensor& rstd,
                                                     std::tuple<bool, bool> needs) {
  LORAFUSE_PROFILE_RANGE("rms_norm_backward");
  return backward_impl<false>(g, x, weight, rstd, needs, "rms_norm backward");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_once_forward(const at::Tensor& x,
                                                         const at::Tensor& weight, double eps) {
  LORAFUSE_PROFILE_RANGE("rms_norm_once_forward");
  return forward_impl<true>(x, weight, eps, "rms_norm (rounded once)");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_once_backward(const at::Tensor& g,
                                                          const at::Tensor& x,
                                                          const at::Tensor& weight,
                                                          const at::Tensor& rstd,
                                                          std::tuple<bool, bool> needs) {
  LORAFUSE_PROFILE_RANGE("rms_norm_once_backward");
  return backward_impl<true>(g, x, weight, rstd, needs, "rms_norm (rounded once) backward");
}

}  // namespace lorafuse
