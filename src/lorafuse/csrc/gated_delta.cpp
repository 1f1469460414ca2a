// Gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next), the chunked WY / UT-transform form and
// its backward; contract: ops/gated_delta_chunks.py's forward / backward (the math is written out
// in that file's docstring; the names here follow it).
//
// Shapes: q, k (B, T, Hk, Dk) and v (B, T, Hv, Dv) of one floating dtype, the last dim contiguous
// (any strides else); g, beta (B, T, Hv) any floating dtype; states (N, Hv, Dk, Dv) fp32; the
// per-chunk start states (NCH_max, Hv, Dk, Dv) fp32, chunks example after example (this file's
// layout: only this file's backward reads them). Examples: the B rows, or cu_seqlens (N+1,) int64
// over the one row.
//
// Work: one task per (example, value head), longest examples first, dealt by parallel_tasks; each
// walks its chunks of C = 64 tokens with an L2-resident scratch (~0.5 MiB at D = 128) and BLAS
// sgemm for the products (gated_delta.h: torch's own MKL/OpenBLAS, found at run time; single-
// threaded inside the task). Math fp32. A chunk of one token (decoding, or an
// example's last) runs the recurrence itself: two passes over the state, no products.
// Backward: the chunks in reverse, the state gradient carried; q/k gradients are summed over the
// value heads of a key head and taken through the L2 norm afterwards, per token.
#include "gated_delta.h"

namespace lorafuse {
namespace {
using namespace gated_delta_detail;

// One token on the state itself: S = a·S + k δᵀ with δ = β(v - a·Sᵀk), o = Sᵀq (two passes over
// S). kv: Dv scratch; o: Dv.
inline void recur(const float* q, const float* k, const float* v, float a, float b, float* S,
                  int64_t Dk, int64_t Dv, float* kv, float* o) {
  std::fill(kv, kv + Dv, 0.f);
  for (int64_t i = 0; i < Dk; ++i) axpy(k[i], S + i * Dv, kv, Dv);
  for (int64_t j = 0; j < Dv; ++j) kv[j] = b * (v[j] - a * kv[j]), o[j] = 0.f;  // kv := δ
  for (int64_t i = 0; i < Dk; ++i) {
    float* s = S + i * Dv;
    int64_t j = 0;
    for (; j + kW <= Dv; j += kW) {
      const fVec sn = at::vec::fmadd(fVec(k[i]), fVec::loadu(kv + j), fVec(a) * fVec::loadu(s + j));
      sn.store(s + j);
      at::vec::fmadd(fVec(q[i]), sn, fVec::loadu(o + j)).store(o + j);
    }
    for (; j < Dv; ++j) s[j] = a * s[j] + k[i] * kv[j], o[j] += q[i] * s[j];
  }
}

template <typename T>
void store_row(const float* o, T* dst, int64_t d) {
  int64_t j = 0;
  for (; j + kW <= d; j += kW) store_f(dst + j, fVec::loadu(o + j));
  for (; j < d; ++j) dst[j] = static_cast<T>(o[j]);
}

// A chunk of one token (an example's last) on the call's head-major inputs.
template <typename T>
void step_one(const Call& c, const Span& sp, int64_t t, int64_t h, float* S, T* out,
              float* scratch) {
  const int64_t gi = c.gate(sp.row, h, t);
  recur(c.qrow(sp.row, h, t), c.krow(sp.row, h, t), c.vrow(sp.row, h, t), std::exp(c.g[gi]),
        c.beta[gi], S, c.Dk, c.Dv, scratch, scratch + c.Dv);
  store_row(scratch + c.Dv, out + ((sp.row * c.T_ + t) * c.Hv + h) * c.Dv, c.Dv);
}

// Decoding (one token a row, no boundaries): row b, value head h read in place, normalised here
// (head_major's pass and buffers cost more than the step itself). g, beta (B, Hv) fp32.
template <typename T>
void decode_task(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* g,
                 const float* beta, bool l2norm, int64_t b, int64_t h, float* S, T* out) {
  const int64_t Hv = v.size(2), Dk = q.size(3), Dv = v.size(3), rep = Hv / q.size(2);
  std::vector<float> buf(2 * Dk + 3 * Dv);
  float *qs = buf.data(), *ks = qs + Dk, *vs = ks + Dk, *kv = vs + Dv, *o = kv + Dv;
  load_row(rows_of<T>(q).at(b, 0, h / rep), qs, Dk, l2norm, 1.f / std::sqrt(float(Dk)));
  load_row(rows_of<T>(k).at(b, 0, h / rep), ks, Dk, l2norm, 1.f);
  load_row(rows_of<T>(v).at(b, 0, h), vs, Dv, false, 1.f);
  recur(qs, ks, vs, std::exp(g[b * Hv + h]), beta[b * Hv + h], S, Dk, Dv, kv, o);
  store_row(o, out + (b * Hv + h) * Dv, Dv);
}

// Forward of one (example, head): S (Dk, Dv) holds the initial state and leaves the final one.
template <typename T>
void forward_task(const Call& c, const Span& sp, int64_t h, float* S, float* states, T* out) {
  const int64_t Dk = c.Dk, Dv = c.Dv, SZ = Dk * Dv;
  std::unique_ptr<Work> w;
  std::vector<float> one(2 * Dv);  // step_one's scratch
  for (int64_t t0 = 0, ci = 0; t0 < sp.len; t0 += C, ++ci) {
    const int64_t L = std::min(C, sp.len - t0);
    if (states) std::copy(S, S + SZ, states + ((sp.chunk0 + ci) * c.Hv + h) * SZ);
    if (L == 1) {
      step_one(c, sp, sp.start + t0, h, S, out, one.data());
      continue;
    }
    if (!w) w = std::make_unique<Work>(Dk, Dv, false);
    intra(c, sp, t0, L, h, *w);
    std::copy(w->u, w->u + L * Dv, w->vn);
    mm(false, false, L, Dv, Dk, -1.f, w->w, Dk, S, Dv, 1.f, w->vn, Dv);  // V' = U - W S
    mm(false, false, L, Dv, Dk, 1.f, w->qg, Dk, S, Dv, 0.f, w->o, Dv);   // O = eQ S + P V'
    mm(false, false, L, Dv, L, 1.f, w->p, C, w->vn, Dv, 1.f, w->o, Dv);
    store_rows(w->o, out, c, sp, t0, L, h, Dv);
    const float eL = w->e[L - 1];
    scale_rows(&eL, S, S, 1, SZ);
    mm(true, false, Dk, Dv, L, 1.f, w->kd, Dk, w->vn, Dv, 1.f, S, Dv);  // S = eL S + (fK)ᵀ V'
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> decode(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, const at::Tensor& g,
                                                      const at::Tensor& beta, bool l2norm,
                                                      bool save_states, at::Tensor& out,
                                                      at::Tensor& final) {
  const int64_t B = v.size(0), Hv = v.size(2), SZ = q.size(3) * v.size(3);
  // the one chunk's start state, the backward's input
  at::Tensor states = save_states ? final.clone() : final.narrow(0, 0, 0);
  const at::Tensor g32 = g.to(at::kFloat).contiguous(), b32 = beta.to(at::kFloat).contiguous();
  float* fin = final.mutable_data_ptr<float>();
  LORAFUSE_DISPATCH(v.scalar_type(), "gated_delta_decode", [&] {
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, B * Hv, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        decode_task(q, k, v, g32.const_data_ptr<float>(), b32.const_data_ptr<float>(), l2norm,
                    t / Hv, t % Hv, fin + t * SZ, o);
      }
    });
  });
  return {out, final, states};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_delta_forward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g,
    const at::Tensor& beta, const OptTensor& initial_state, const OptTensor& cu_seqlens,
    bool l2norm, bool save_states) {
  LORAFUSE_PROFILE_RANGE("gated_delta_forward");
  TORCH_CHECK(blas_gemm_available(), "gated_delta: no usable BLAS sgemm in this torch build");
  check_inputs(q_in, k_in, v_in, g, beta);
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
                   v = last_dim_contiguous(v_in);
  const int64_t B = v.size(0), T = v.size(1), Hv = v.size(2), Dk = q.size(3), Dv = v.size(3);
  const std::vector<Span> spans = spans_of(cu_seqlens, B, T);
  const int64_t N = static_cast<int64_t>(spans.size()), SZ = Dk * Dv;
  at::Tensor out = at::empty({B, T, Hv, Dv}, v.options());
  at::Tensor final;
  if (initial_state.has_value()) {
    TORCH_CHECK(initial_state->sizes() == at::IntArrayRef({N, Hv, Dk, Dv}),
                "gated_delta: initial_state ", initial_state->sizes(),
                " must be (N, Hv, Dk, Dv) = ", at::IntArrayRef({N, Hv, Dk, Dv}));
    final = initial_state->to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
  } else {
    final = at::zeros({N, Hv, Dk, Dv}, v.options().dtype(at::kFloat));
  }
  if (T == 1 && !cu_seqlens.has_value())
    return decode(q, k, v, g, beta, l2norm, save_states, out, final);
  const float scale = 1.f / std::sqrt(static_cast<float>(Dk));
  const at::Tensor qh = head_major(q, l2norm, scale), kh = head_major(k, l2norm, 1.f),
                   vh = head_major(v, false, 1.f), gh = gate_major(g), bh = gate_major(beta);
  const Call c = call_of(qh, kh, vh, gh, bh, scale);
  at::Tensor states = at::empty(
      {save_states ? max_chunks(B, T, N, cu_seqlens.has_value()) : 0, Hv, Dk, Dv}, final.options());
  if (save_states) {  // rows no chunk uses: defined values (a custom op's outputs compare)
    const int64_t used = spans.empty() ? 0 : spans.back().chunk0 + (spans.back().len + C - 1) / C;
    states.narrow(0, used, states.size(0) - used).zero_();
  }
  const std::vector<int64_t> order = longest_first(spans);
  LORAFUSE_DISPATCH(v.scalar_type(), "gated_delta_forward", [&] {
    float *fin = final.mutable_data_ptr<float>(),
          *st = save_states ? states.mutable_data_ptr<float>() : nullptr;
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    parallel_tasks(
        N * Hv,
        [&](int64_t task) {
          const int64_t n = order[task / Hv], h = task % Hv;
          forward_task(c, spans[n], h, fin + (n * Hv + h) * SZ, st, o);
        },
        [] {});
  });
  return {out, final, states};
}

}  // namespace lorafuse
