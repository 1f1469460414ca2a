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

// Row-major c (m x n) = alpha·op(a)·op(b) + beta·c: common.h's blas_gemm (the BLAS sgemm of
// torch's own libraries, self-tested once by blas_gemm_available; without it the op runs torch,
// backends.CPP_SELF_TEST).
inline void mm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  blas_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
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

// One call's inputs, fp32 and head-major (a head's tokens adjacent, so a chunk is one block): q
// (B, Hk, T, Dk) L2-normalised and scaled, k (B, Hk, T, Dk) L2-normalised, v (B, Hv, T, Dv), g and
// beta (B, Hv, T). Written once per call by head_major (the norms computed once per key head, not
// per value head and chunk visit).
struct Call {
  const float *q, *k, *v, *g, *beta;
  int64_t Hk, T_, Hv, Dk, Dv, rep;
  float scale;  // Dk^-1/2, already in q (the backward's dq needs it)
  const float* qrow(int64_t b, int64_t h, int64_t t) const {
    return q + ((b * Hk + h / rep) * T_ + t) * Dk;
  }
  const float* krow(int64_t b, int64_t h, int64_t t) const {
    return k + ((b * Hk + h / rep) * T_ + t) * Dk;
  }
  const float* vrow(int64_t b, int64_t h, int64_t t) const {
    return v + ((b * Hv + h) * T_ + t) * Dv;
  }
  int64_t gate(int64_t b, int64_t h, int64_t t) const { return (b * Hv + h) * T_ + t; }
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

// x (B, T, H, D), the last dim contiguous, any floating dtype -> (B, H, T, D) fp32, each row
// normalised where asked and times `scale` (load_row): the strided rows read once, in parallel,
// instead of by every task on every chunk visit.
inline at::Tensor head_major(const at::Tensor& x, bool l2norm, float scale) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  at::Tensor out = at::empty({B, H, T, D}, x.options().dtype(at::kFloat));
  float* o = out.mutable_data_ptr<float>();
  LORAFUSE_DISPATCH(x.scalar_type(), "gated_delta_head_major", [&] {
    const Rows<scalar_t> r = rows_of<scalar_t>(x);
    parallel_rows(B * T * H, row_grain(D), [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        const int64_t b = i / (T * H), t = i / H % T, h = i % H;
        load_row(r.at(b, t, h), o + ((b * H + h) * T + t) * D, D, l2norm, scale);
      }
    });
  });
  return out;
}

// g or beta (B, T, Hv) -> (B, Hv, T) fp32.
inline at::Tensor gate_major(const at::Tensor& x) {
  return x.to(at::kFloat).transpose(1, 2).contiguous();
}

// The scratch of one task: every chunk-local term, fp32 (q, k, v, dO point into the call's
// head-major inputs).
struct Work {
  int64_t Dk, Dv;
  std::vector<float> buf;
  const float *q = nullptr, *k = nullptr, *v = nullptr, *dO = nullptr;
  float *gam, *e, *f, *beta, *dm, *m, *p, *tinv, *vb, *kbg, *u, *w, *vn, *qg, *kd, *o, *dgam;
  float *dvn = nullptr, *dS0 = nullptr, *dp = nullptr, *dq = nullptr, *dk = nullptr;
  float *dw = nullptr, *dvb = nullptr, *dkbg = nullptr, *dmd = nullptr, *kb = nullptr;
  float *dkb = nullptr, *dkt = nullptr, *dbeta = nullptr;
  Work(int64_t dk_, int64_t dv_, bool backward) : Dk(dk_), Dv(dv_) {
    const int64_t K = C * Dk, V = C * Dv, CC = C * C, S = Dk * Dv;
    buf.assign(4 * K + 4 * V + 5 * C + 4 * CC + (backward ? 7 * K + 2 * V + 2 * CC + S + C : 0),
               0.f);
    float* x = buf.data();
    auto take = [&](int64_t n) {
      float* r = x;
      x += n;
      return r;
    };
    qg = take(K), kd = take(K), kbg = take(K), w = take(K);
    vb = take(V), u = take(V), vn = take(V), o = take(V);
    gam = take(C), e = take(C), f = take(C), beta = take(C), dgam = take(C);
    dm = take(CC), m = take(CC), p = take(CC), tinv = take(CC);
    if (backward) {
      dq = take(K), dk = take(K), dw = take(K), dkbg = take(K), kb = take(K), dkb = take(K);
      dkt = take(K), dvn = take(V), dvb = take(V);
      dp = take(CC), dmd = take(CC), dS0 = take(S), dbeta = take(C);
    }
  }
};

// Points at chunk tokens [t0, t0 + L) of example `sp`, head h, and computes every chunk-local
// term: γ, e, f, D, M, P = (Q Kᵀ) ⊙ D, (I + M)⁻¹, U, W, e⊙Q, f⊙K.
inline void intra(const Call& c, const Span& sp, int64_t t0, int64_t L, int64_t h, Work& w) {
  const int64_t Dk = c.Dk, Dv = c.Dv, t = sp.start + t0, gi = c.gate(sp.row, h, t);
  w.q = c.qrow(sp.row, h, t), w.k = c.krow(sp.row, h, t), w.v = c.vrow(sp.row, h, t);
  float acc = 0.f;
  for (int64_t i = 0; i < L; ++i) acc += c.g[gi + i], w.gam[i] = acc, w.beta[i] = c.beta[gi + i];
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

inline Call call_of(const at::Tensor& qh, const at::Tensor& kh, const at::Tensor& vh,
                    const at::Tensor& g, const at::Tensor& beta, float scale) {
  Call c{qh.const_data_ptr<float>(), kh.const_data_ptr<float>(), vh.const_data_ptr<float>(),
         g.const_data_ptr<float>(), beta.const_data_ptr<float>()};
  c.Hk = qh.size(1), c.T_ = qh.size(2), c.Hv = vh.size(1), c.Dk = qh.size(3), c.Dv = vh.size(3);
  c.rep = c.Hv / c.Hk, c.scale = scale;
  return c;
}

template <typename T>
void store_rows(const float* src, T* out, const Call& c, const Span& sp, int64_t t0, int64_t L,
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
