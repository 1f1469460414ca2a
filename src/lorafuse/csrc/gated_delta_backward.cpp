// Gated delta rule backward: contract ops/gated_delta_chunks.py's backward (its docstring writes
// the math out; the names here follow it). One task per (example, value head) walks its chunks in
// reverse, carrying the state gradient dS; each chunk's start state comes from the forward's
// `states`, every chunk-local term is recomputed (gated_delta.h: intra). The q/k gradients of a
// task are for its value head's normalised, scaled q/k (fp32, (B, T, Hv, Dk)); one pass per token
// afterwards sums a key head's value heads and takes them through the L2 norm.
#include "gated_delta.h"

namespace lorafuse {

namespace {
using namespace gated_delta_detail;

struct Grads {                          // outputs of the tasks; null where not asked for
  float *dqn, *dkn, *dg, *dbeta, *dvf;  // dvf: dv in fp32 (B, T, Hv, Dv) when v is not fp32
};

inline float rowdot(const float* a, const float* b, int64_t i, int64_t d) {
  return dot(a + i * d, b + i * d, d);
}

// Adds each strictly-lower pair's decay term a[t][s]·b[t][s] (dP ⊙ P, dM ⊙ M) to dγ_t and takes
// it from dγ_s: the pair's D_ts = exp(γ_t - γ_s). Summed pair by pair, not as rowdot(dQ, Q) -
// rowdot(dK, K): those carry the diagonal's term twice, to cancel, and round at its size; under
// strong decays dg was 2-5x further from fp64 than transformers' autograd
// (tests/ops/test_gated_delta.py::test_fp32_gradients_as_accurate_as_transformers).
void add_pairs(const float* a, const float* b, float* dgam, int64_t L) {
  for (int64_t t = 1; t < L; ++t) {
    float row = 0.f;
    for (int64_t s = 0; s < t; ++s) {
      const float x = a[t * C + s] * b[t * C + s];
      row += x, dgam[s] -= x;
    }
    dgam[t] += row;
  }
}

// Through O's two reads of the state and S_end's write: dQ, dK (before the WY terms) and dγ.
void through_reads(Work& w, const float* S0, const float* dS, int64_t L) {
  const int64_t Dk = w.Dk, Dv = w.Dv;
  mm(false, true, L, L, Dv, 1.f, w.dO, Dv, w.vn, Dv, 0.f, w.dp, C);  // dP = dO V'ᵀ
  std::fill(w.dgam, w.dgam + L, 0.f);
  add_pairs(w.dp, w.p, w.dgam, L);
  for (int64_t t = 0; t < L; ++t) {  // ⊙ D
    for (int64_t s = 0; s < L; ++s) w.dp[t * C + s] *= w.dm[t * C + s];
  }
  mm(false, true, L, Dk, Dv, 1.f, w.dO, Dv, S0, Dv, 0.f, w.dq, Dk);  // dQ = e ⊙ dO S0ᵀ + dP K
  scale_rows(w.e, w.dq, w.dq, L, Dk);
  for (int64_t i = 0; i < L; ++i) w.dgam[i] += rowdot(w.dq, w.q, i, Dk);  // e_i
  mm(false, false, L, Dk, L, 1.f, w.dp, C, w.k, Dk, 1.f, w.dq, Dk);
  mm(false, true, L, Dk, Dv, 1.f, w.vn, Dv, dS, Dv, 0.f, w.dk, Dk);  // dK = f ⊙ V' dSᵀ + dPᵀ Q
  scale_rows(w.f, w.dk, w.dk, L, Dk);
  float last = w.e[L - 1] * dot(dS, S0, Dk * Dv);  // γ_L: S_end's decay and f's numerator
  for (int64_t i = 0; i < L; ++i) {
    const float x = rowdot(w.dk, w.k, i, Dk);  // f_i = exp(γ_L - γ_i)
    last += x, w.dgam[i] -= x;
  }
  mm(true, false, L, Dk, L, 1.f, w.dp, C, w.q, Dk, 1.f, w.dk, Dk);
  w.dgam[L - 1] += last;
}

// Through U, W = (I + M)⁻¹ [diag(β) V | diag(βe) K]: dV (in dvb, times β), dβ, and the K and γ
// terms of the solve and of M.
void through_wy(Work& w, const float* S0, int64_t L) {
  const int64_t Dk = w.Dk, Dv = w.Dv;
  mm(false, true, L, Dk, Dv, -1.f, w.dvn, Dv, S0, Dv, 0.f, w.dw, Dk);    // dW = -dV' S0ᵀ
  mm(true, false, L, Dv, L, 1.f, w.tinv, C, w.dvn, Dv, 0.f, w.dvb, Dv);  // (I + M)⁻ᵀ dU
  mm(true, false, L, Dk, L, 1.f, w.tinv, C, w.dw, Dk, 0.f, w.dkbg, Dk);  // (I + M)⁻ᵀ dW
  for (int64_t i = 0; i < L; ++i) {
    const float kd = rowdot(w.dkbg, w.k, i, Dk), be = w.beta[i] * w.e[i];
    w.dbeta[i] = rowdot(w.dvb, w.v, i, Dv) + w.e[i] * kd;
    w.dgam[i] += be * kd;
    axpy(be, w.dkbg + i * Dk, w.dk + i * Dk, Dk);
  }
  mm(false, true, L, L, Dv, -1.f, w.dvb, Dv, w.u, Dv, 0.f, w.dmd, C);  // dM = -(dVb Uᵀ + dKbg Wᵀ)
  mm(false, true, L, L, Dk, -1.f, w.dkbg, Dk, w.w, Dk, 1.f, w.dmd, C);
  add_pairs(w.dmd, w.m, w.dgam, L);  // M is strictly lower
  for (int64_t t = 0; t < L; ++t) {  // strictly lower, ⊙ D
    for (int64_t s = 0; s < L; ++s)
      w.dmd[t * C + s] = s < t ? w.dmd[t * C + s] * w.dm[t * C + s] : 0.f;
  }
  scale_rows(w.beta, w.k, w.kb, L, Dk);
  mm(false, false, L, Dk, L, 1.f, w.dmd, C, w.k, Dk, 0.f, w.dkb, Dk);  // dKb = dMD K
  mm(true, false, L, Dk, L, 1.f, w.dmd, C, w.kb, Dk, 0.f, w.dkt, Dk);  // dMDᵀ Kb
  for (int64_t i = 0; i < L; ++i) {
    const float kbk = rowdot(w.dkb, w.k, i, Dk);
    w.dbeta[i] += kbk;
    axpy(w.beta[i], w.dkb + i * Dk, w.dk + i * Dk, Dk);
    axpy(1.f, w.dkt + i * Dk, w.dk + i * Dk, Dk);
  }
  scale_rows(w.beta, w.dvb, w.dvb, L, Dv);  // dV = β dVb
}

// dOh: the output gradient head-major (B, Hv, T, Dv) fp32.
void backward_task(const Call& c, const float* dOh, const Span& sp, int64_t h, const float* states,
                   float* dS, const Grads& gr) {
  const int64_t Dk = c.Dk, Dv = c.Dv, SZ = Dk * Dv, Hv = c.Hv;
  Work w(Dk, Dv, true);
  for (int64_t ci = (sp.len + C - 1) / C - 1; ci >= 0; --ci) {
    const int64_t t0 = ci * C, L = std::min(C, sp.len - t0);
    const float* S0 = states + ((sp.chunk0 + ci) * Hv + h) * SZ;
    intra(c, sp, t0, L, h, w);
    std::copy(w.u, w.u + L * Dv, w.vn);
    mm(false, false, L, Dv, Dk, -1.f, w.w, Dk, S0, Dv, 1.f, w.vn, Dv);  // V' = U - W S0
    w.dO = dOh + ((sp.row * Hv + h) * c.T_ + sp.start + t0) * Dv;
    mm(true, false, L, Dv, L, 1.f, w.p, C, w.dO, Dv, 0.f, w.dvn, Dv);  // dV' = Pᵀ dO + fK dS
    mm(false, false, L, Dv, Dk, 1.f, w.kd, Dk, dS, Dv, 1.f, w.dvn, Dv);
    const float eL = w.e[L - 1];  // dS0 = (eQ)ᵀ dO + eL dS - Wᵀ dV'
    scale_rows(&eL, dS, w.dS0, 1, SZ);
    mm(true, false, Dk, Dv, L, 1.f, w.qg, Dk, w.dO, Dv, 1.f, w.dS0, Dv);
    mm(true, false, Dk, Dv, L, -1.f, w.w, Dk, w.dvn, Dv, 1.f, w.dS0, Dv);
    if (gr.dqn || gr.dkn || gr.dg || gr.dbeta || gr.dvf) {
      through_reads(w, S0, dS, L);
      through_wy(w, S0, L);
      float acc = 0.f;  // dg = reverse cumulative sum of dγ
      for (int64_t i = L - 1; i >= 0; --i) acc += w.dgam[i], w.dgam[i] = acc;
      for (int64_t i = 0; i < L; ++i) {
        const int64_t row = (sp.row * c.T_ + sp.start + t0 + i) * Hv + h;
        if (gr.dg) gr.dg[row] = w.dgam[i];
        if (gr.dbeta) gr.dbeta[row] = w.dbeta[i];
        if (gr.dqn) scale_rows(&c.scale, w.dq + i * Dk, gr.dqn + row * Dk, 1, Dk);
        if (gr.dkn) std::copy(w.dk + i * Dk, w.dk + (i + 1) * Dk, gr.dkn + row * Dk);
        if (gr.dvf) std::copy(w.dvb + i * Dv, w.dvb + (i + 1) * Dv, gr.dvf + row * Dv);
      }
    }
    std::copy(w.dS0, w.dS0 + SZ, dS);
  }
}

// dx (B, T, Hk, D) from the value heads' gradients dn (B, T, Hv, D) fp32 of the normalised x:
// summed over a key head's value heads, then through x·rsqrt(Σx² + 1e-6) where l2norm.
template <typename T>
void through_norm(const at::Tensor& x, const float* dn, int64_t rep, bool l2norm, at::Tensor& dx) {
  const int64_t B = x.size(0), T_ = x.size(1), Hk = x.size(2), D = x.size(3);
  const Rows<T> src = rows_of<T>(x);
  T* out = dx.mutable_data_ptr<T>();
  parallel_rows(B * T_ * Hk, row_grain(D * (rep + 2)), [&](int64_t r0, int64_t r1) {
    std::vector<float> acc(D), xs(D);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (T_ * Hk), t = r / Hk % T_, hk = r % Hk;
      const float* d0 = dn + r * rep * D;  // (b, t, hk·rep .. hk·rep + rep - 1) are adjacent
      std::copy(d0, d0 + D, acc.begin());
      for (int64_t j = 1; j < rep; ++j) axpy(1.f, d0 + j * D, acc.data(), D);
      if (l2norm) {
        load_row(src.at(b, t, hk), xs.data(), D, false, 1.f);
        const float rs = 1.f / std::sqrt(dot(xs.data(), xs.data(), D) + 1e-6f);
        for (int64_t i = 0; i < D; ++i) xs[i] *= rs;  // n = x·rstd
        const float nd = dot(xs.data(), acc.data(), D);
        for (int64_t i = 0; i < D; ++i) acc[i] = rs * (acc[i] - xs[i] * nd);
      }
      T* o = out + r * D;
      for (int64_t i = 0; i < D; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
gated_delta_backward(const at::Tensor& dout, const OptTensor& dfinal, const at::Tensor& q_in,
                     const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g,
                     const at::Tensor& beta, const OptTensor& initial_state,
                     const at::Tensor& states, const OptTensor& cu_seqlens, bool l2norm,
                     std::tuple<bool, bool, bool, bool, bool, bool> needs) {
  LORAFUSE_PROFILE_RANGE("gated_delta_backward");
  TORCH_CHECK(blas_gemm_available(), "gated_delta: no usable BLAS sgemm in this torch build");
  check_inputs(q_in, k_in, v_in, g, beta);
  const auto [need_q, need_k, need_v, need_g, need_b, need_h] = needs;
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
                   v = last_dim_contiguous(v_in);
  const at::Tensor dO = last_dim_contiguous(dout.to(v.scalar_type()));
  TORCH_CHECK(dO.sizes() == v.sizes(), "gated_delta backward: grad ", dout.sizes(), " != v ",
              v.sizes());
  const int64_t B = v.size(0), T = v.size(1), Hv = v.size(2), Dk = q.size(3), Dv = v.size(3);
  const std::vector<Span> spans = spans_of(cu_seqlens, B, T);
  const int64_t N = static_cast<int64_t>(spans.size()), SZ = Dk * Dv;
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() && states.dim() == 4 &&
                  states.size(0) >= max_chunks(B, T, N, cu_seqlens.has_value()),
              "gated_delta backward: states ", states.sizes(), " are not the forward's");
  const float scale = 1.f / std::sqrt(static_cast<float>(Dk));
  const at::Tensor qh = head_major(q, l2norm, scale), kh = head_major(k, l2norm, 1.f),
                   vh = head_major(v, false, 1.f), gh = gate_major(g), bh = gate_major(beta),
                   dOh = head_major(dO, false, 1.f);
  const Call c = call_of(qh, kh, vh, gh, bh, scale);
  at::Tensor dh = at::zeros({N, Hv, Dk, Dv}, v.options().dtype(at::kFloat));
  if (dfinal.has_value()) dh.copy_(*dfinal);
  const auto f32 = v.options().dtype(at::kFloat);
  at::Tensor dqn, dkn, dg, db, dv;
  if (need_q) dqn = at::empty({B, T, Hv, Dk}, f32);
  if (need_k) dkn = at::empty({B, T, Hv, Dk}, f32);
  if (need_g) dg = at::empty({B, T, Hv}, f32);
  if (need_b) db = at::empty({B, T, Hv}, f32);
  if (need_v) dv = at::empty({B, T, Hv, Dv}, f32);
  auto ptr = [](at::Tensor& t) { return t.defined() ? t.mutable_data_ptr<float>() : nullptr; };
  const Grads gr{ptr(dqn), ptr(dkn), ptr(dg), ptr(db), ptr(dv)};
  const std::vector<int64_t> order = longest_first(spans);
  const float *st = states.const_data_ptr<float>(), *dOp = dOh.const_data_ptr<float>();
  float* dhp = dh.mutable_data_ptr<float>();
  parallel_tasks(
      N * Hv,
      [&](int64_t task) {
        const int64_t n = order[task / Hv], h = task % Hv;
        backward_task(c, dOp, spans[n], h, st, dhp + (n * Hv + h) * SZ, gr);
      },
      [] {});
  at::Tensor dq, dk;
  LORAFUSE_DISPATCH(v.scalar_type(), "gated_delta_backward", [&] {
    const int64_t rep = Hv / q.size(2);
    if (need_q)
      dq = at::empty(q.sizes(), q.options()), through_norm<scalar_t>(q, gr.dqn, rep, l2norm, dq);
    if (need_k)
      dk = at::empty(k.sizes(), k.options()), through_norm<scalar_t>(k, gr.dkn, rep, l2norm, dk);
  });
  if (need_v) dv = dv.to(v.scalar_type());
  if (need_g) dg = dg.to(g.scalar_type());
  if (need_b) db = db.to(beta.scalar_type());
  at::Tensor dh0;
  if (need_h && initial_state.has_value()) dh0 = dh.to(initial_state->scalar_type());
  return {dq, dk, dv, dg, db, dh0};
}

}  // namespace lorafuse
