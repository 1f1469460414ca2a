// The chunk math shared by the gated delta rule's forward (gated_delta.cpp) and backward
// (gated_delta_backward.cpp): BLAS products, strided inputs, a task's scratch, and the chunk-local
// terms both recompute. Contract and notation: ops/gated_delta_chunks.py.
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "common.h"

namespace lorafuse {
namespace gated_delta_detail {

constexpr int64_t C = 64;  // tokens per chunk: ops/gated_delta_chunks.CHUNK

// Fortran BLAS sgemm (column-major, 32-bit ints) of the libtorch_cpu this extension runs in (MKL or
// OpenBLAS; common.h's torch_cpu_symbol), as attention.cpp calls it; ATen's own cpublas::gemm
// is not exported for fp32. gated_delta_available() self-tests it once; without it the op runs
// torch (backends.CPP_SELF_TEST).
using sgemm_t = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                         const float*, const int*, const float*, const int*, const float*, float*,
                         const int*);

inline sgemm_t sgemm_fn() {
  static const sgemm_t fn = reinterpret_cast<sgemm_t>(torch_cpu_symbol("sgemm_"));
  return fn;
}

// Row-major c (m x n) = alpha·op(a)·op(b) + beta·c (BLAS is column-major: it computes cᵀ).
inline void mm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char opa = tb ? 'T' : 'N', opb = ta ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int LA = static_cast<int>(ldb), LB = static_cast<int>(lda), LC = static_cast<int>(ldc);
  sgemm_fn()(&opa, &opb, &M, &N, &K, &alpha, b, &LA, a, &LB, &beta, c, &LC);
}

inline float dot(const float* a, const float* b, int64_t n) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) acc = at::vec::fmadd(fVec::loadu(a + i), fVec::loadu(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {  // y += a·x
  int64_t i = 0;
  for (; i + kW <= n; i += kW)
    at::vec::fmadd(fVec(a), fVec::loadu(x + i), fVec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += a * x[i];
}

inline void scale_rows(const float* s, const float* x, float* y, int64_t rows,
                       int64_t n) {  // y = s·x
  for (int64_t r = 0; r < rows; ++r) {
    int64_t i = 0;
    for (; i + kW <= n; i += kW) (fVec(s[r]) * fVec::loadu(x + r * n + i)).store(y + r * n + i);
    for (; i < n; ++i) y[r * n + i] = s[r] * x[r * n + i];
  }
}

// One (B, T, H, D) input with its strides (the last dim contiguous).
template <typename T>
struct Rows {
  const T* p;
  int64_t sb, st, sh;
  const T* at(int64_t b, int64_t t, int64_t h) const { return p + b * sb + t * st + h * sh; }
};
template <typename T>
Rows<T> rows_of(const at::Tensor& x) {
  return {x.const_data_ptr<T>(), x.stride(0), x.stride(1), x.stride(2)};
}

struct Span {  // one example: its row, first token, length and first chunk in `states`
  int64_t row, start, len, chunk0;
};

template <typename T>
struct Call {
  Rows<T> q, k, v;
  const float *g, *beta;  // (B, T, Hv) fp32 contiguous
  int64_t T_, Hv, Dk, Dv, rep;
  float scale;
  bool l2norm;
};

// x row (D) as fp32, L2-normalised (x·rsqrt(Σx² + 1e-6), FLA's eps) where asked, times `scale`.
template <typename T>
void load_row(const T* src, float* dst, int64_t d, bool l2norm, float scale) {
  int64_t i = 0;
  for (; i + kW <= d; i += kW) load_f(src + i).store(dst + i);
  for (; i < d; ++i) dst[i] = static_cast<float>(src[i]);
  if (l2norm) scale /= std::sqrt(dot(dst, dst, d) + 1e-6f);
  if (scale != 1.f) scale_rows(&scale, dst, dst, 1, d);
}

// The scratch of one task: a chunk's inputs and every chunk-local term, fp32.
struct Work {
  int64_t Dk, Dv;
  std::vector<float> buf;
  float *q, *k, *v, *gam, *e, *f, *beta, *dm, *m, *p, *tinv, *vb, *kbg, *u, *w, *vn, *qg, *kd, *o;
  float *dgam, *dO = nullptr, *dvn = nullptr, *dS0 = nullptr, *dp = nullptr, *dq = nullptr;
  float *dk = nullptr, *dw = nullptr, *dvb = nullptr, *dkbg = nullptr, *dmd = nullptr;
  float *kb = nullptr, *dkb = nullptr, *dkt = nullptr, *dbeta = nullptr;
  Work(int64_t dk_, int64_t dv_, bool backward) : Dk(dk_), Dv(dv_) {
    const int64_t K = C * Dk, V = C * Dv, CC = C * C, S = Dk * Dv;
    buf.assign(6 * K + 5 * V + 5 * C + 4 * CC + (backward ? 7 * K + 3 * V + 2 * CC + S + C : 0),
               0.f);
    float* x = buf.data();
    auto take = [&](int64_t n) {
      float* r = x;
      x += n;
      return r;
    };
    q = take(K), k = take(K), qg = take(K), kd = take(K), kbg = take(K), w = take(K);
    v = take(V), vb = take(V), u = take(V), vn = take(V), o = take(V);
    gam = take(C), e = take(C), f = take(C), beta = take(C), dgam = take(C);
    dm = take(CC), m = take(CC), p = take(CC), tinv = take(CC);
    if (backward) {
      dq = take(K), dk = take(K), dw = take(K), dkbg = take(K), kb = take(K), dkb = take(K);
      dkt = take(K), dO = take(V), dvn = take(V), dvb = take(V);
      dp = take(CC), dmd = take(CC), dS0 = take(S), dbeta = take(C);
    }
  }
};

// Loads chunk tokens [t0, t0 + L) of example `sp`, head h, and computes every chunk-local term:
// γ, e, f, D, M, P = (Q Kᵀ) ⊙ D, (I + M)⁻¹, U, W, e⊙Q, f⊙K.
template <typename T>
void intra(const Call<T>& c, const Span& sp, int64_t t0, int64_t L, int64_t h, Work& w) {
  const int64_t Dk = c.Dk, Dv = c.Dv, hk = h / c.rep;
  float acc = 0.f;
  for (int64_t i = 0; i < L; ++i) {
    const int64_t t = sp.start + t0 + i, gi = (sp.row * c.T_ + t) * c.Hv + h;
    load_row(c.q.at(sp.row, t, hk), w.q + i * Dk, Dk, c.l2norm, c.scale);
    load_row(c.k.at(sp.row, t, hk), w.k + i * Dk, Dk, c.l2norm, 1.f);
    load_row(c.v.at(sp.row, t, h), w.v + i * Dv, Dv, false, 1.f);
    acc += c.g[gi];
    w.gam[i] = acc, w.beta[i] = c.beta[gi];
  }
  for (int64_t i = 0; i < L; ++i) w.e[i] = std::exp(w.gam[i]), w.f[i] = std::exp(acc - w.gam[i]);
  mm(false, true, L, L, Dk, 1.f, w.k, Dk, w.k, Dk, 0.f, w.m, C);  // K Kᵀ
  mm(false, true, L, L, Dk, 1.f, w.q, Dk, w.k, Dk, 0.f, w.p, C);  // Q Kᵀ
  for (int64_t t = 0; t < L; ++t) {
    float *dm = w.dm + t * C, *m = w.m + t * C, *p = w.p + t * C, *ti = w.tinv + t * C;
    int64_t s = 0;
    for (; s + kW <= t + 1; s += kW) (fVec(w.gam[t]) - fVec::loadu(w.gam + s)).exp().store(dm + s);
    for (; s <= t; ++s) dm[s] = std::exp(w.gam[t] - w.gam[s]);
    for (s = 0; s <= t; ++s) m[s] = s < t ? w.beta[t] * m[s] * dm[s] : 0.f, p[s] *= dm[s];
    for (s = t + 1; s < L; ++s) dm[s] = m[s] = p[s] = 0.f;
    // (I + M)⁻¹ by forward substitution: row t = e_t - Σ_{r<t} M[t][r]·row r.
    std::fill(ti, ti + L, 0.f);
    for (int64_t r = 0; r < t; ++r) axpy(-m[r], w.tinv + r * C, ti, r + 1);
    ti[t] = 1.f;
  }
  scale_rows(w.beta, w.v, w.vb, L, Dv);
  for (int64_t i = 0; i < L; ++i) {
    const float be = w.beta[i] * w.e[i];
    scale_rows(&be, w.k + i * Dk, w.kbg + i * Dk, 1, Dk);
  }
  mm(false, false, L, Dv, L, 1.f, w.tinv, C, w.vb, Dv, 0.f, w.u, Dv);   // U = (I+M)⁻¹ diag(β) V
  mm(false, false, L, Dk, L, 1.f, w.tinv, C, w.kbg, Dk, 0.f, w.w, Dk);  // W = (I+M)⁻¹ diag(βe) K
  scale_rows(w.e, w.q, w.qg, L, Dk);
  scale_rows(w.f, w.k, w.kd, L, Dk);
}

// Every example's span, its chunks numbered example after example (`states` rows).
inline std::vector<Span> spans_of(const OptTensor& cu_seqlens, int64_t B, int64_t T) {
  std::vector<Span> out;
  int64_t chunk = 0;
  auto add = [&](int64_t row, int64_t s, int64_t e) {
    out.push_back({row, s, e - s, chunk});
    chunk += (e - s + C - 1) / C;
  };
  if (!cu_seqlens.has_value()) {
    for (int64_t b = 0; b < B; ++b) add(b, 0, T);
    return out;
  }
  const at::Tensor cu = cu_seqlens->to(at::kLong).contiguous();
  const int64_t* p = cu.const_data_ptr<int64_t>();
  TORCH_CHECK(B == 1 && cu.dim() == 1 && cu.numel() >= 2 && p[0] == 0 && p[cu.numel() - 1] == T,
              "gated_delta: cu_seqlens must run from 0 to T = ", T, " over one row");
  for (int64_t i = 0; i + 1 < cu.numel(); ++i) {
    TORCH_CHECK(p[i + 1] >= p[i], "gated_delta: cu_seqlens must not decrease");
    add(0, p[i], p[i + 1]);
  }
  return out;
}

// Rows of the chunk states buffer: ops/gated_delta_chunks.max_chunks.
inline int64_t max_chunks(int64_t B, int64_t T, int64_t N, bool varlen) {
  return varlen ? (T + C - 1) / C + N : B * ((T + C - 1) / C);
}

// x with its last dim contiguous (a copy only where it is not).
inline at::Tensor last_dim_contiguous(const at::Tensor& x) {
  return x.stride(-1) == 1 ? x : x.contiguous();
}

// Example indices, longest first (parallel_tasks deals the costliest tasks first).
inline std::vector<int64_t> longest_first(const std::vector<Span>& spans) {
  std::vector<int64_t> order(spans.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return spans[a].len > spans[b].len; });
  return order;
}

inline void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& g, const at::Tensor& beta) {
  TORCH_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && v.dim() == 4 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1) && v.size(2) % q.size(2) == 0,
              "gated_delta: q ", q.sizes(), " and k ", k.sizes(), " must be (B, T, Hk, Dk), v ",
              v.sizes(), " (B, T, Hv, Dv) with Hv a multiple of Hk");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "gated_delta: q, k, v must share a dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(g.sizes() == v.sizes().slice(0, 3) && beta.sizes() == g.sizes(), "gated_delta: g ",
              g.sizes(), " and beta ", beta.sizes(), " must be (B, T, Hv)");
}

template <typename T>
Call<T> call_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& g32, const at::Tensor& beta32, bool l2norm) {
  const int64_t Dk = q.size(3);
  return {rows_of<T>(q),
          rows_of<T>(k),
          rows_of<T>(v),
          g32.const_data_ptr<float>(),
          beta32.const_data_ptr<float>(),
          v.size(1),
          v.size(2),
          Dk,
          v.size(3),
          v.size(2) / q.size(2),
          1.f / std::sqrt(static_cast<float>(Dk)),
          l2norm};
}

template <typename T>
void store_rows(const float* src, T* out, const Call<T>& c, const Span& sp, int64_t t0, int64_t L,
                int64_t h, int64_t d) {
  for (int64_t i = 0; i < L; ++i) {
    T* dst = out + ((sp.row * c.T_ + sp.start + t0 + i) * c.Hv + h) * d;
    int64_t j = 0;
    for (; j + kW <= d; j += kW) store_f(dst + j, fVec::loadu(src + i * d + j));
    for (; j < d; ++j) dst[j] = static_cast<T>(src[i * d + j]);
  }
}

}  // namespace gated_delta_detail
}  // namespace lorafuse
