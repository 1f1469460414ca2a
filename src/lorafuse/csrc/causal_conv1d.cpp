// Causal depthwise conv1d with optional SiLU, per packed example, forward and backward; contract:
// ops/causal_conv1d.py's _torch_forward / _torch_backward.
//   z[t, c] = bias[c] + Σ_j w[c, j]·x̃[t - K + 1 + j, c],  y = act(z)
// where x̃ reads the example's initial state (its K - 1 inputs before the start) before its start.
//
// Shapes: x (B, D, T) (the kernels run on channels adjacent in memory, the models' layout:
// in_proj's output transposed; another layout is copied into it once); weight (D, K); bias (D,);
// states (N, D, K - 1). y has x's shape with channels adjacent in memory (y.transpose(1, 2) is
// contiguous). Math fp32, one rounding to x's dtype; every value is computed by the same
// instructions wherever it sits, so a packed example's outputs equal its own run's bit for bit.
// Forward: tasks of (example, 256 channels), tokens in order. Backward: tasks of 64 channels over
// every example (dweight and dbias sum inside the task: no reduction across threads), tokens in
// reverse, so dx[p] = Σ_j w_j dz[p + K - 1 - j] is complete when p is reached; the pre-activation
// is recomputed.
#include <cmath>
#include <string>
#include <vector>

#include "common.h"

namespace lorafuse {
namespace {

struct Span {
  int64_t row, start, end;
};

std::vector<Span> spans_of(const OptTensor& cu_seqlens, int64_t B, int64_t T) {
  std::vector<Span> out;
  if (!cu_seqlens.has_value()) {
    for (int64_t b = 0; b < B; ++b) out.push_back({b, 0, T});
    return out;
  }
  const at::Tensor cu = cu_seqlens->to(at::kLong).contiguous();
  const int64_t* p = cu.const_data_ptr<int64_t>();
  TORCH_CHECK(B == 1 && cu.dim() == 1 && cu.numel() >= 2 && p[0] == 0 && p[cu.numel() - 1] == T,
              "causal_conv1d: cu_seqlens must run from 0 to T = ", T, " over one row");
  for (int64_t i = 0; i + 1 < cu.numel(); ++i) {
    TORCH_CHECK(p[i + 1] >= p[i], "causal_conv1d: cu_seqlens must not decrease");
    out.push_back({0, p[i], p[i + 1]});
  }
  return out;
}

// y[i] += a[i]·b[i] (b null: y[i] += a[i]) over n values.
inline void axpy_f(const float* a, const float* b, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const fVec av = fVec::loadu(a + i);
    (b ? at::vec::fmadd(av, fVec::loadu(b + i), fVec::loadu(y + i)) : av + fVec::loadu(y + i))
        .store(y + i);
  }
  for (; i < n; ++i) y[i] += b ? a[i] * b[i] : a[i];
}

inline fVec sigmoid(const fVec& z) { return fVec(1.f) / (fVec(1.f) + z.neg().exp()); }
inline float sigmoid_s(float z) { return 1.f / (1.f + std::exp(-z)); }

// The call's operands: x and y as (B, T, D) rows (channel stride 1), fp32 weight (K, D) and bias.
template <typename T>
struct Conv {
  const T* x;
  int64_t sb, st;                 // x's strides of b and t
  const float *w, *bias, *state;  // w (K, D); bias (D,) or null; state (N, D, K-1) or null
  int64_t T_, D, K;
  bool silu;
  // x̃[p, c] of example n (span sp): x at p >= start, else its state (zero without one).
  float at(const Span& sp, int64_t n, int64_t p, int64_t c) const {
    if (p >= sp.start) return static_cast<float>(x[sp.row * sb + p * st + c]);
    return state ? state[(n * D + c) * (K - 1) + (K - 1 - (sp.start - p))] : 0.f;
  }
};

// x̃ rows p - K + 1 .. p of channels [c0, c0 + n) into win (K x 256, fp32).
template <typename T>
void window(const Conv<T>& cv, const Span& sp, int64_t n, int64_t p, int64_t c0, int64_t cn,
            float* win) {
  for (int64_t j = 0; j < cv.K; ++j) {
    const int64_t q = p - cv.K + 1 + j;
    float* dst = win + j * 256;
    if (q >= sp.start) {
      const T* src = cv.x + sp.row * cv.sb + q * cv.st + c0;
      int64_t i = 0;
      for (; i + kW <= cn; i += kW) load_f(src + i).store(dst + i);
      for (; i < cn; ++i) dst[i] = static_cast<float>(src[i]);
    } else {
      for (int64_t i = 0; i < cn; ++i) dst[i] = cv.at(sp, n, q, c0 + i);
    }
  }
}

// z (pre-activation) of channels [c0, c0 + cn) at one token from its window.
template <typename T>
void preact(const Conv<T>& cv, int64_t c0, int64_t cn, const float* win, float* z) {
  int64_t i = 0;
  for (; i + kW <= cn; i += kW) {
    fVec acc = cv.bias ? fVec::loadu(cv.bias + c0 + i) : fVec(0.f);
    for (int64_t j = 0; j < cv.K; ++j) {
      acc = at::vec::fmadd(fVec::loadu(cv.w + j * cv.D + c0 + i), fVec::loadu(win + j * 256 + i),
                           acc);
    }
    acc.store(z + i);
  }
  for (; i < cn; ++i) {
    float acc = cv.bias ? cv.bias[c0 + i] : 0.f;
    for (int64_t j = 0; j < cv.K; ++j)
      acc = std::fma(cv.w[j * cv.D + c0 + i], win[j * 256 + i], acc);
    z[i] = acc;
  }
}

template <typename T>
void forward_block(const Conv<T>& cv, const Span& sp, int64_t n, int64_t c0, int64_t cn, T* y,
                   T* final) {
  std::vector<float> win(cv.K * 256), z(256);
  for (int64_t t = sp.start; t < sp.end; ++t) {
    window(cv, sp, n, t, c0, cn, win.data());
    preact(cv, c0, cn, win.data(), z.data());
    T* dst = y + (sp.row * cv.T_ + t) * cv.D + c0;
    int64_t i = 0;
    for (; i + kW <= cn; i += kW) {
      fVec v = fVec::loadu(z.data() + i);
      store_f(dst + i, cv.silu ? v * sigmoid(v) : v);
    }
    for (; i < cn; ++i) dst[i] = static_cast<T>(cv.silu ? z[i] * sigmoid_s(z[i]) : z[i]);
  }
  for (int64_t i = 0; i + 1 < cv.K; ++i) {  // the last K - 1 inputs: the next call's state
    for (int64_t c = 0; c < cn; ++c) {
      final[(n * cv.D + c0 + c) * (cv.K - 1) + i] =
          static_cast<T>(cv.at(sp, n, sp.end - cv.K + 1 + i, c0 + c));
    }
  }
}

template <typename T>
void backward_block(const Conv<T>& cv, const std::vector<Span>& spans, const T* dy, int64_t dsb,
                    int64_t dst, const float* dfinal, int64_t c0, int64_t cn, T* dx, float* dstate,
                    float* dw, float* db) {
  const int64_t K = cv.K, D = cv.D;
  std::vector<float> win(K * 256), z(256), ring(K * 256), dwacc(K * 256, 0.f), dbacc(256, 0.f);
  std::vector<float> g(256);
  // x̃[p]'s gradient of channels [c0, c0 + cn) from the outputs that read it (ring holds dz[q] at
  // slot q mod K) and from the final state; outputs before `lo` are not this example's.
  auto dxt = [&](const Span& sp, int64_t n, int64_t p, float* out) {
    std::fill(out, out + cn, 0.f);
    for (int64_t m = 0; m < K; ++m) {
      const int64_t q = p + m;
      if (q < sp.start || q >= sp.end) continue;
      const float* dz = ring.data() + (q % K) * 256;
      const float* w = cv.w + (K - 1 - m) * D + c0;
      for (int64_t i = 0; i < cn; ++i) out[i] = std::fma(w[i], dz[i], out[i]);
    }
    if (dfinal && p >= sp.end - K + 1) {
      for (int64_t i = 0; i < cn; ++i)
        out[i] += dfinal[(n * D + c0 + i) * (K - 1) + p - (sp.end - K + 1)];
    }
  };
  for (size_t n = 0; n < spans.size(); ++n) {
    const Span& sp = spans[n];
    std::fill(ring.begin(), ring.end(), 0.f);
    for (int64_t t = sp.end - 1; t >= sp.start; --t) {
      window(cv, sp, n, t, c0, cn, win.data());
      float* dz = ring.data() + (t % K) * 256;
      const T* src = dy + sp.row * dsb + t * dst + c0;
      for (int64_t i = 0; i < cn; ++i) dz[i] = static_cast<float>(src[i]);
      if (cv.silu) {  // d silu(z)/dz = s·(1 + z·(1 - s)), z recomputed
        preact(cv, c0, cn, win.data(), z.data());
        for (int64_t i = 0; i < cn; ++i) {
          const float s = sigmoid_s(z[i]);
          dz[i] *= s * (1.f + z[i] * (1.f - s));
        }
      }
      if (dw) {
        for (int64_t j = 0; j < K; ++j)
          axpy_f(dz, win.data() + j * 256, dwacc.data() + j * 256, cn);
      }
      if (db) axpy_f(dz, nullptr, dbacc.data(), cn);
      if (dx) {
        dxt(sp, n, t, g.data());
        T* o = dx + (sp.row * cv.T_ + t) * D + c0;
        for (int64_t i = 0; i < cn; ++i) o[i] = static_cast<T>(g[i]);
      }
    }
    if (dstate) {
      for (int64_t p = sp.start - K + 1; p < sp.start; ++p) {
        dxt(sp, n, p, g.data());
        for (int64_t i = 0; i < cn; ++i)
          dstate[(n * D + c0 + i) * (K - 1) + K - 1 - (sp.start - p)] = g[i];
      }
    }
  }
  for (int64_t j = 0; dw && j < K; ++j)
    std::copy(dwacc.data() + j * 256, dwacc.data() + j * 256 + cn, dw + j * D + c0);
  if (db) std::copy(dbacc.data(), dbacc.data() + cn, db + c0);
}

// x as (B, T, D) rows with the channel stride 1 (a channels-adjacent copy where it is not).
at::Tensor channels_last(const at::Tensor& x) {
  const at::Tensor r = x.transpose(1, 2);
  return r.stride(2) == 1 ? r : r.contiguous();
}

struct Prepared {
  at::Tensor xr, w, bias, state;
  std::vector<Span> spans;
};

Prepared prepare(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                 const OptTensor& initial_state, const OptTensor& cu_seqlens, int64_t n) {
  TORCH_CHECK(x.dim() == 3 && weight.dim() == 2 && weight.size(0) == x.size(1), "causal_conv1d: x ",
              x.sizes(), " must be (B, D, T), weight ", weight.sizes(), " (D, K)");
  const int64_t D = x.size(1), K = weight.size(1);
  TORCH_CHECK(K >= 1 && K <= 256, "causal_conv1d: kernel length ", K, " not in [1, 256]");
  Prepared p{channels_last(x),
             weight.to(at::kFloat).t().contiguous(),
             {},
             {},
             spans_of(cu_seqlens, x.size(0), x.size(2))};
  TORCH_CHECK(static_cast<int64_t>(p.spans.size()) == n, "causal_conv1d: ", p.spans.size(),
              " examples, told ", n);
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == D, "causal_conv1d: bias ", bias->sizes(), " must be (", D, ",)");
    p.bias = bias->to(at::kFloat).contiguous();
  }
  if (initial_state.has_value()) {
    TORCH_CHECK(initial_state->dim() == 3 && initial_state->size(0) == n &&
                    initial_state->size(1) == D && initial_state->size(2) == K - 1,
                "causal_conv1d: initial_state ", initial_state->sizes(), " must be (N, D, K-1)");
    p.state = initial_state->to(at::kFloat).contiguous();
  }
  return p;
}

template <typename T>
Conv<T> conv_of(const Prepared& p, int64_t D, int64_t K, bool silu) {
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<float>() : nullptr; };
  return {p.xr.const_data_ptr<T>(),
          p.xr.stride(0),
          p.xr.stride(1),
          p.w.const_data_ptr<float>(),
          ptr(p.bias),
          ptr(p.state),
          p.xr.size(1),
          D,
          K,
          silu};
}

bool is_silu(const c10::optional<std::string>& activation) {
  if (!activation.has_value()) return false;
  TORCH_CHECK(*activation == "silu", "causal_conv1d: activation '", *activation,
              "' is not None or 'silu'");
  return true;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> causal_conv1d_forward(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
    const c10::optional<std::string>& activation, const OptTensor& initial_state,
    const OptTensor& cu_seqlens, int64_t n) {
  LORAFUSE_PROFILE_RANGE("causal_conv1d_forward");
  const bool silu = is_silu(activation);
  const Prepared p = prepare(x, weight, bias, initial_state, cu_seqlens, n);
  const int64_t B = x.size(0), D = x.size(1), T = x.size(2), K = weight.size(1);
  at::Tensor y = at::empty({B, T, D}, x.options());  // returned as (B, D, T)
  at::Tensor final = at::empty({n, D, K - 1}, x.options());
  const int64_t blocks = (D + 255) / 256;
  LORAFUSE_DISPATCH(x.scalar_type(), "causal_conv1d_forward", [&] {
    const Conv<scalar_t> cv = conv_of<scalar_t>(p, D, K, silu);
    scalar_t *yp = y.mutable_data_ptr<scalar_t>(), *fp = final.mutable_data_ptr<scalar_t>();
    parallel_tasks(
        n * blocks,
        [&](int64_t task) {
          const int64_t e = task / blocks, c0 = task % blocks * 256;
          forward_block(cv, p.spans[e], e, c0, std::min<int64_t>(256, D - c0), yp, fp);
        },
        [] {});
  });
  return {y.transpose(1, 2), final};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> causal_conv1d_backward(
    const at::Tensor& dy, const OptTensor& dfinal, const at::Tensor& x, const at::Tensor& weight,
    const OptTensor& bias, const c10::optional<std::string>& activation,
    const OptTensor& initial_state, const OptTensor& cu_seqlens, int64_t n,
    std::tuple<bool, bool, bool, bool> needs) {
  LORAFUSE_PROFILE_RANGE("causal_conv1d_backward");
  const auto [need_x, need_w, need_b, need_h] = needs;
  const bool silu = is_silu(activation);
  const Prepared p = prepare(x, weight, bias, initial_state, cu_seqlens, n);
  const int64_t B = x.size(0), D = x.size(1), T = x.size(2), K = weight.size(1);
  TORCH_CHECK(dy.sizes() == x.sizes(), "causal_conv1d backward: grad ", dy.sizes(), " != x ",
              x.sizes());
  const at::Tensor dyr = channels_last(dy.to(x.scalar_type()));
  at::Tensor dfin;
  if (dfinal.has_value()) dfin = dfinal->to(at::kFloat).contiguous();
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor dx, dw, db, dh;
  if (need_x) dx = at::empty({B, T, D}, x.options());
  if (need_w) dw = at::empty({K, D}, f32);
  if (need_b && bias.has_value()) db = at::empty({D}, f32);
  if (need_h && initial_state.has_value()) dh = at::empty({n, D, K - 1}, f32);
  auto ptr = [](at::Tensor& t) { return t.defined() ? t.mutable_data_ptr<float>() : nullptr; };
  const int64_t blocks = (D + 63) / 64;
  LORAFUSE_DISPATCH(x.scalar_type(), "causal_conv1d_backward", [&] {
    const Conv<scalar_t> cv = conv_of<scalar_t>(p, D, K, silu);
    scalar_t* dxp = dx.defined() ? dx.mutable_data_ptr<scalar_t>() : nullptr;
    const float* dfp = dfin.defined() ? dfin.const_data_ptr<float>() : nullptr;
    parallel_tasks(
        blocks,
        [&](int64_t blk) {
          backward_block(cv, p.spans, dyr.const_data_ptr<scalar_t>(), dyr.stride(0), dyr.stride(1),
                         dfp, blk * 64, std::min<int64_t>(64, D - blk * 64), dxp, ptr(dh), ptr(dw),
                         ptr(db));
        },
        [] {});
  });
  if (dx.defined()) dx = dx.transpose(1, 2);
  if (dw.defined()) dw = dw.t().contiguous().to(weight.scalar_type());
  if (db.defined()) db = db.to(bias->scalar_type());
  if (dh.defined()) dh = dh.to(initial_state->scalar_type());
  return {dx, dw, db, dh};
}

}  // namespace lorafuse
