// Mamba2's chunked SSD scan (contract: ops/mamba2_scan_chunks.py's torch_forward / torch_backward)
// and one decoding step, per (example, head):
//   dt' = clamp(softplus(dt + dt_bias)), a = dt'·A, S_t = exp(a_t)·S_{t-1} + dt'_t·x_t·B_tᵀ,
//   y_t = S_t·C_t + D·x_t.
// Each example is walked in chunks of `chunk` tokens (the op's chunk_size; the state at every
// interior chunk start is saved for backward, slots as ops/mamba2_scan_chunks.py numbers them), each
// chunk in sub-chunks of at most `sub` tokens (kSub), and each sub-chunk of L tokens is five BLAS
// products (blas_gemm, single-threaded inside the parallel loop) on fp32 copies in a per-thread
// scratch: scores C·Bᵀ (L x L) times the decays exp(acs_l - acs_s), Y = M·x̄, Y += diag(exp(acs))·
// C·S0ᵀ, S = exp(acs_L)·S0 + x̄ᵀ·diag(exp(acs_L - acs))·B. Backward walks the chunks from the last,
// recomputing the start states of a chunk's sub-chunks from its saved state, and runs the same
// products transposed (nine per sub-chunk); the gradient of the log decays collects every exponent
// and becomes da by a reverse cumulative sum. fp64 inputs compute in fp64 (the tests' gradcheck),
// everything else in fp32; y, the states and the saved states are in that compute type.
// dB and dC sum over the heads of a group: each task owns a fixed block of a group's heads and
// adds into its own (T', G, N) buffer, summed at the end in block order, so the result does not
// depend on scheduling. The elementwise dt steps (softplus, clamp and their gradients) are ATen's
// own, so they round as the torch backend does.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>  // _mm_getcsr / _mm_setcsr
#endif

namespace lorafuse {
namespace {

// Tokens per sub-chunk. The products cost per token and head about L·N + L·P + 2·P·N multiply-adds
// (L x L scores and their product with x̄, the start state's output and the state update): 64
// balances the L-proportional terms against per-call BLAS overhead at P = 64, N = 128.
constexpr int64_t kSub = 64;

template <typename T>
using Compute = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Denormals flushed to zero on this thread while a task runs (restored after). The decays reach
// the denormal range inside a sub-chunk (exp(-2·64) at Granite's A = -16, dt' = 0.13) and so do
// the states and products they scale; x86 takes a microcode assist per denormal operand, which
// made 64-token sub-chunks 5x slower than 32-token ones (benchmarks/ops/mamba2_scan.py --subs).
// Flushed, a value changes by less than the smallest normal (1.2e-38 in fp32) in absolute terms.
struct FlushDenormals {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
#elif defined(__aarch64__)
  uint64_t saved;
  FlushDenormals() {
    asm volatile("mrs %0, fpcr" : "=r"(saved));
    const uint64_t fz = saved | (uint64_t{1} << 24);  // FPCR.FZ
    asm volatile("msr fpcr, %0" : : "r"(fz));
  }
  ~FlushDenormals() { asm volatile("msr fpcr, %0" : : "r"(saved)); }
#endif
};

template <typename S>
using Buf = std::vector<S>;

template <typename T, typename S>
inline void to_compute(const T* src, S* dst, int64_t n) {
  if constexpr (std::is_same_v<T, S>) {
    std::memcpy(dst, src, n * sizeof(S));
  } else {
    at::vec::convert(src, dst, n);
  }
}

// Σ a·b; fp32 by vectors (the compiler keeps a float sum in order, one lane).
template <typename S>
inline S dot(const S* a, const S* b, int64_t n) {
  S s = 0;
  int64_t i = 0;
  if constexpr (std::is_same_v<S, float>) {
    fVec acc(0.f);
    for (; i + kW <= n; i += kW) acc = at::vec::fmadd(fVec::loadu(a + i), fVec::loadu(b + i), acc);
    s = hsum(acc);
  }
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// q = dM ∘ M over the lower triangle (the gradient of each exponent acs_l - acs_s):
// dacs_l += Σ_s q_ls, dacs_s -= Σ_l q_ls.
template <typename S>
void exponent_grads(const S* dM, const S* M, int64_t L, S* dacs) {
  S* col = dacs + L;  // L more slots of scratch after dacs: the column sums
  std::fill(col, col + L, S(0));
  for (int64_t l = 0; l < L; ++l) {
    const S* a = dM + l * L;
    const S* b = M + l * L;
    S row = 0;
    int64_t s = 0;
    if constexpr (std::is_same_v<S, float>) {
      fVec acc(0.f);
      for (; s + kW <= l + 1; s += kW) {
        const fVec q = fVec::loadu(a + s) * fVec::loadu(b + s);
        acc = acc + q;
        (fVec::loadu(col + s) + q).store(col + s);
      }
      row = hsum(acc);
    }
    for (; s <= l; ++s) {
      const S q = a[s] * b[s];
      row += q;
      col[s] += q;
    }
    dacs[l] += row;
  }
  for (int64_t l = 0; l < L; ++l) dacs[l] -= col[l];
}

// dec (L x L) = exp(acs_l - acs_s) for s <= l, 0 above the diagonal (common.h's exp_fast for fp32:
// the L²/2 exponentials per sub-chunk would otherwise cost a third of the products' time).
template <typename S>
void decays(const S* acs, int64_t L, S* dec) {
  for (int64_t l = 0; l < L; ++l) {
    S* row = dec + l * L;
    int64_t s = 0;
    if constexpr (std::is_same_v<S, float>) {
      const fVec al(acs[l]);
      for (; s + kW <= l + 1; s += kW) exp_fast(al - fVec::loadu(acs + s)).store(row + s);
    }
    for (; s <= l; ++s) row[s] = std::exp(acs[l] - acs[s]);
    for (; s < L; ++s) row[s] = 0;
  }
}

// Inputs of one call, flattened: x (T', H, P), B, C (T', G, N) as stored; dt' (T', H) discretised,
// A, D (H,) in the compute type; the examples' token spans and first saved slots.
template <typename T, typename S>
struct Problem {
  const T *x, *B, *C;
  const S *dt, *A, *D;  // D may be null
  int64_t H, P, G, N, hpg, chunk, sub;
  std::vector<int64_t> start, len, slot;
  int64_t n_chunks(int64_t n) const { return (len[n] + chunk - 1) / chunk; }
};

// Per-thread scratch: one sub-chunk's operands and products, the running states.
template <typename S>
struct Work {
  Buf<S> X, Xb, Bc, Cc, Bw, Cs, Y, M, Dec, dM, dXb, dBc, dCc, T1, dYs, dt, acs, dacs, wexp, eacs;
  Buf<S> state, dS, starts;
  void size(int64_t L, int64_t P, int64_t N, int64_t n_starts) {
    if (!X.empty()) return;
    for (Buf<S>* b : {&X, &Xb, &Y, &dXb, &dYs}) b->assign(L * P, 0);
    for (Buf<S>* b : {&Bc, &Cc, &Bw, &Cs, &dBc, &dCc, &T1}) b->assign(L * N, 0);
    for (Buf<S>* b : {&M, &Dec, &dM}) b->assign(L * L, 0);
    for (Buf<S>* b : {&dt, &acs, &wexp, &eacs}) b->assign(L, 0);
    dacs.assign(2 * L, 0);  // and the column sums of exponent_grads
    state.assign(P * N, 0);
    dS.assign(P * N, 0);
    starts.assign(n_starts * P * N, 0);
  }
};

// One sub-chunk's x, x̄ = dt'·x, B, C (when asked) as compute-type rows, dt' and acs (the inclusive
// cumulative sum of a = dt'·A, in double as ATen's cumsum accumulates).
template <typename T, typename S>
void load(const Problem<T, S>& pr, Work<S>& w, int64_t h, int64_t t0, int64_t L, bool with_c) {
  const int64_t P = pr.P, N = pr.N, g = h / pr.hpg;
  double run = 0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t t = t0 + l;
    const S d = pr.dt[t * pr.H + h];
    w.dt[l] = d;
    run += static_cast<double>(d * pr.A[h]);
    w.acs[l] = static_cast<S>(run);
    S* xr = w.X.data() + l * P;
    to_compute(pr.x + (t * pr.H + h) * P, xr, P);
    for (int64_t p = 0; p < P; ++p) w.Xb[l * P + p] = d * xr[p];
    to_compute(pr.B + (t * pr.G + g) * N, w.Bc.data() + l * N, N);
    if (with_c) to_compute(pr.C + (t * pr.G + g) * N, w.Cc.data() + l * N, N);
  }
}

// Bw = diag(exp(acs_L - acs))·B; state = exp(acs_L)·state + x̄ᵀ·Bw. Needs load().
template <typename S>
void state_update(Work<S>& w, int64_t L, int64_t P, int64_t N, S* state) {
  const S last = w.acs[L - 1];
  for (int64_t s = 0; s < L; ++s) {
    const S ws = std::exp(last - w.acs[s]);
    for (int64_t n = 0; n < N; ++n) w.Bw[s * N + n] = ws * w.Bc[s * N + n];
  }
  const S e = std::exp(last);
  for (int64_t i = 0; i < P * N; ++i) state[i] *= e;
  blas_gemm(true, false, P, N, L, S(1), w.Xb.data(), P, w.Bw.data(), N, S(1), state, N);
}

// M = (C·Bᵀ) ∘ decays: the within-sub-chunk scores. Needs load(with_c).
template <typename S>
void scores(Work<S>& w, int64_t L, int64_t N) {
  blas_gemm(false, true, L, L, N, S(1), w.Cc.data(), N, w.Bc.data(), N, S(0), w.M.data(), L);
  decays(w.acs.data(), L, w.Dec.data());
  for (int64_t i = 0; i < L * L; ++i) w.M[i] *= w.Dec[i];
}

template <typename T, typename S>
void forward_sub(const Problem<T, S>& pr, Work<S>& w, int64_t h, int64_t t0, int64_t L,
                 S* state, S* y) {
  const int64_t P = pr.P, N = pr.N;
  load(pr, w, h, t0, L, true);
  scores(w, L, N);
  blas_gemm(false, false, L, P, L, S(1), w.M.data(), L, w.Xb.data(), P, S(0), w.Y.data(), P);
  for (int64_t l = 0; l < L; ++l) {
    const S e = std::exp(w.acs[l]);
    for (int64_t n = 0; n < N; ++n) w.Cs[l * N + n] = e * w.Cc[l * N + n];
  }
  blas_gemm(false, true, L, P, N, S(1), w.Cs.data(), N, state, N, S(1), w.Y.data(), P);
  const S Dh = pr.D ? pr.D[h] : S(0);
  for (int64_t l = 0; l < L; ++l) {
    S* out = y + ((t0 + l) * pr.H + h) * P;
    for (int64_t p = 0; p < P; ++p) out[p] = w.Y[l * P + p] + Dh * w.X[l * P + p];
  }
  state_update(w, L, P, N, state);
}

// ---- backward --------------------------------------------------------------------------------

// Where one head's backward writes: dx (x's dtype, or null), per token da and Σ_p x·dx̄ (T', H),
// per (example, head) Σ y'·x for dD, this task's dB / dC block (T', G, N) (or null), d initial.
template <typename T, typename S>
struct Grads {
  const S* gy;  // (T', H, P), compute type
  T* dx;
  S *da, *ddt_x, *dD, *dB, *dC, *dinit;
};

// One sub-chunk from its start state S0, with dS the gradient of its end state on entry and of its
// start state on return (products: the comment at the top).
template <typename T, typename S>
void backward_sub(const Problem<T, S>& pr, Work<S>& w, const Grads<T, S>& gr, int64_t n,
                  int64_t h, int64_t t0, int64_t L, const S* S0) {
  const int64_t P = pr.P, N = pr.N, H = pr.H, g = h / pr.hpg;
  load(pr, w, h, t0, L, true);
  scores(w, L, N);
  const S* dY = gr.gy + (t0 * H + h) * P;  // rows H·P apart
  S* dS = w.dS.data();
  const S last = w.acs[L - 1], e_last = std::exp(last);
  for (int64_t s = 0; s < L; ++s) {
    w.wexp[s] = std::exp(last - w.acs[s]);
    w.eacs[s] = std::exp(w.acs[s]);
    for (int64_t k = 0; k < N; ++k) w.Bw[s * N + k] = w.wexp[s] * w.Bc[s * N + k];
  }
  // dx̄ = Mᵀ·dY + Bw·dSᵀ; dM = dY·x̄ᵀ; T1 = x̄·dS (the state's part of dB), all before dS changes.
  blas_gemm(true, false, L, P, L, S(1), w.M.data(), L, dY, H * P, S(0), w.dXb.data(), P);
  blas_gemm(false, true, L, P, N, S(1), w.Bw.data(), N, dS, N, S(1), w.dXb.data(), P);
  blas_gemm(false, true, L, L, P, S(1), dY, H * P, w.Xb.data(), P, S(0), w.dM.data(), L);
  blas_gemm(false, false, L, N, P, S(1), w.Xb.data(), P, dS, N, S(0), w.T1.data(), N);
  // The exponents acs_L - acs_s of the state update, and acs_L of the start state's decay.
  S* dacs = w.dacs.data();
  S to_last = e_last * dot(dS, S0, P * N);
  for (int64_t s = 0; s < L; ++s) {
    const S t = w.wexp[s] * dot(w.Bc.data() + s * N, w.T1.data() + s * N, N);
    dacs[s] = -t;
    to_last += t;
  }
  dacs[L - 1] += to_last;
  // Within the sub-chunk: d(acs_l - acs_s) = dM ∘ M; dG = dM ∘ decays.
  exponent_grads(w.dM.data(), w.M.data(), L, dacs);
  for (int64_t i = 0; i < L * L; ++i) w.dM[i] *= w.Dec[i];
  blas_gemm(false, false, L, N, L, S(1), w.dM.data(), L, w.Bc.data(), N, S(0), w.dCc.data(), N);
  blas_gemm(true, false, L, N, L, S(1), w.dM.data(), L, w.Cc.data(), N, S(0), w.dBc.data(), N);
  for (int64_t s = 0; s < L; ++s) {
    for (int64_t k = 0; k < N; ++k) w.dBc[s * N + k] += w.wexp[s] * w.T1[s * N + k];
  }
  // The start state's part of y, exp(acs_l)·S0·C_l: dYs = diag(exp(acs))·dY, T1 = dYs·S0.
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t p = 0; p < P; ++p) w.dYs[l * P + p] = w.eacs[l] * dY[l * H * P + p];
  }
  blas_gemm(false, false, L, N, P, S(1), w.dYs.data(), P, S0, N, S(0), w.T1.data(), N);
  for (int64_t l = 0; l < L; ++l) {
    dacs[l] += dot(w.Cc.data() + l * N, w.T1.data() + l * N, N);
    for (int64_t k = 0; k < N; ++k) w.dCc[l * N + k] += w.T1[l * N + k];
  }
  // dS for the previous sub-chunk: exp(acs_L)·dS + dYsᵀ·C.
  for (int64_t i = 0; i < P * N; ++i) dS[i] *= e_last;
  blas_gemm(true, false, P, N, L, S(1), w.dYs.data(), P, w.Cc.data(), N, S(1), dS, N);
  // Per token: da (the reverse cumulative sum), Σ_p x·dx̄, dx, dD, dB, dC.
  const S Dh = pr.D ? pr.D[h] : S(0);
  S run = 0, dD = 0;
  for (int64_t l = L - 1; l >= 0; --l) {
    const int64_t t = t0 + l;
    run += dacs[l];
    gr.da[t * H + h] = run;
    const S* xr = w.X.data() + l * P;
    const S* dxb = w.dXb.data() + l * P;
    const S* dy = dY + l * H * P;
    gr.ddt_x[t * H + h] = dot(xr, dxb, P);
    dD += dot(dy, xr, P);
    if (gr.dx) {
      T* out = gr.dx + (t * H + h) * P;
      for (int64_t p = 0; p < P; ++p) out[p] = static_cast<T>(w.dt[l] * dxb[p] + Dh * dy[p]);
    }
    if (gr.dB) {
      S* row = gr.dB + (t * pr.G + g) * N;
      for (int64_t k = 0; k < N; ++k) row[k] += w.dBc[l * N + k];
    }
    if (gr.dC) {
      S* row = gr.dC + (t * pr.G + g) * N;
      for (int64_t k = 0; k < N; ++k) row[k] += w.dCc[l * N + k];
    }
  }
  gr.dD[n * H + h] += dD;
}

// ---- one (example, head) ----------------------------------------------------------------------

template <typename S>
inline void copy_or_zero(S* dst, const S* src, int64_t n) {
  if (src) {
    std::memcpy(dst, src, n * sizeof(S));
  } else {
    std::fill(dst, dst + n, S(0));
  }
}

template <typename T, typename S>
void forward_head(const Problem<T, S>& pr, Work<S>& w, const S* init, S* saved, S* final, S* y,
                  int64_t n, int64_t h) {
  const int64_t PN = pr.P * pr.N, H = pr.H, end = pr.start[n] + pr.len[n];
  S* st = w.state.data();
  copy_or_zero(st, init ? init + (n * H + h) * PN : nullptr, PN);
  for (int64_t k = 0; k < pr.n_chunks(n); ++k) {
    if (k > 0) std::memcpy(saved + ((pr.slot[n] + k - 1) * H + h) * PN, st, PN * sizeof(S));
    const int64_t c0 = pr.start[n] + k * pr.chunk, c1 = std::min(end, c0 + pr.chunk);
    for (int64_t t0 = c0; t0 < c1; t0 += pr.sub) {
      forward_sub(pr, w, h, t0, std::min(pr.sub, c1 - t0), st, y);
    }
  }
  std::memcpy(final + (n * H + h) * PN, st, PN * sizeof(S));
}

// Chunks from the last; in each, the sub-chunks' start states are recomputed from the chunk's saved
// one (one state product per token: the saved states stay a chunk apart), then walked back.
template <typename T, typename S>
void backward_head(const Problem<T, S>& pr, Work<S>& w, const Grads<T, S>& gr, const S* init,
                   const S* saved, const S* gfinal, int64_t n, int64_t h) {
  const int64_t P = pr.P, N = pr.N, PN = P * N, H = pr.H, end = pr.start[n] + pr.len[n];
  copy_or_zero(w.dS.data(), gfinal ? gfinal + (n * H + h) * PN : nullptr, PN);
  for (int64_t k = pr.n_chunks(n) - 1; k >= 0; --k) {
    const int64_t c0 = pr.start[n] + k * pr.chunk, c1 = std::min(end, c0 + pr.chunk);
    const int64_t n_sub = (c1 - c0 + pr.sub - 1) / pr.sub;
    S* st = w.starts.data();
    const S* from = k > 0  ? saved + ((pr.slot[n] + k - 1) * H + h) * PN
                    : init ? init + (n * H + h) * PN
                           : nullptr;
    copy_or_zero(st, from, PN);
    for (int64_t j = 1; j < n_sub; ++j) {
      const int64_t t0 = c0 + (j - 1) * pr.sub;
      std::memcpy(st + j * PN, st + (j - 1) * PN, PN * sizeof(S));
      const int64_t L = std::min(pr.sub, c1 - t0);
      load(pr, w, h, t0, L, false);
      state_update(w, L, P, N, st + j * PN);
    }
    for (int64_t j = n_sub - 1; j >= 0; --j) {
      const int64_t t0 = c0 + j * pr.sub;
      backward_sub(pr, w, gr, n, h, t0, std::min(pr.sub, c1 - t0), st + j * PN);
    }
  }
  if (gr.dinit) std::memcpy(gr.dinit + (n * H + h) * PN, w.dS.data(), PN * sizeof(S));
}

// ---- the calls ------------------------------------------------------------------------------

struct Shapes {
  int64_t b, t, H, P, G, N, tokens, n_ex;
  std::vector<int64_t> start, len;  // per example
  std::vector<int64_t> order;       // examples, longest first (tasks are dealt most costly first)
};

Shapes shapes_of(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                 const at::Tensor& B, const at::Tensor& C, const OptTensor& cu_seqlens) {
  TORCH_CHECK(x.dim() == 4 && dt.dim() == 3 && B.dim() == 4 && C.sizes() == B.sizes(),
              "mamba2_scan: x (B, T, H, P), dt (B, T, H), B and C (B, T, G, N), got ", x.sizes(),
              ", ", dt.sizes(), ", ", B.sizes(), ", ", C.sizes());
  TORCH_CHECK(B.scalar_type() == x.scalar_type() && C.scalar_type() == x.scalar_type(),
              "mamba2_scan: x, B and C must share a dtype, got ", x.scalar_type(), ", ",
              B.scalar_type(), ", ", C.scalar_type());
  Shapes s{x.size(0), x.size(1), x.size(2), x.size(3), B.size(2), B.size(3), 0, 0, {}, {}, {}};
  TORCH_CHECK(dt.size(2) == s.H && A.numel() == s.H && s.G > 0 && s.H % s.G == 0,
              "mamba2_scan: dt, A must have H = ", s.H, " heads, a multiple of G = ", s.G);
  s.tokens = s.b * s.t;
  if (cu_seqlens.has_value() && cu_seqlens->defined()) {
    at::Tensor cu = cu_seqlens->to(at::kLong).contiguous();
    const int64_t* c = cu.const_data_ptr<int64_t>();
    TORCH_CHECK(s.b == 1 && cu.numel() >= 2 && c[0] == 0 && c[cu.numel() - 1] == s.t,
                "mamba2_scan: cu_seqlens must run from 0 to T over one row");
    for (int64_t i = 0; i + 1 < cu.numel(); ++i) {
      TORCH_CHECK(c[i + 1] >= c[i], "mamba2_scan: cu_seqlens must not decrease");
      s.start.push_back(c[i]);
      s.len.push_back(c[i + 1] - c[i]);
    }
  } else {
    for (int64_t i = 0; i < s.b; ++i) {
      s.start.push_back(i * s.t);
      s.len.push_back(s.t);
    }
  }
  s.n_ex = static_cast<int64_t>(s.len.size());
  for (int64_t i = 0; i < s.n_ex; ++i) s.order.push_back(i);
  std::stable_sort(s.order.begin(), s.order.end(),
                   [&](int64_t a, int64_t b) { return s.len[a] > s.len[b]; });
  return s;
}

// dt' (T', H) in the compute type; z = dt + dt_bias kept for the backward's softplus gradient.
std::tuple<at::Tensor, at::Tensor> discretize(const at::Tensor& dt, const OptTensor& dt_bias,
                                              bool softplus, double lo, double hi,
                                              at::ScalarType s, int64_t tokens) {
  at::Tensor z = dt.reshape({tokens, dt.size(-1)}).to(s);
  if (dt_bias.has_value() && dt_bias->defined()) z = z + dt_bias->to(s);
  at::Tensor v = softplus ? at::softplus(z, 1, 20) : z;
  return {z, at::clamp(v, lo, hi).contiguous()};
}

at::Tensor opt_to(const OptTensor& t, at::ScalarType s) {
  return t.has_value() && t->defined() ? t->to(s).contiguous() : at::Tensor();
}

template <typename S>
const S* ptr(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<S>() : nullptr;
}

template <typename T, typename S>
Problem<T, S> problem(const Shapes& sh, const at::Tensor& x, const at::Tensor& B,
                      const at::Tensor& C, const at::Tensor& dtv, const at::Tensor& A,
                      const at::Tensor& D, int64_t chunk, int64_t sub) {
  Problem<T, S> pr{x.const_data_ptr<T>(), B.const_data_ptr<T>(), C.const_data_ptr<T>(),
                   dtv.const_data_ptr<S>(), A.const_data_ptr<S>(), ptr<S>(D),
                   sh.H, sh.P, sh.G, sh.N, sh.H / sh.G, chunk, std::min(sub, chunk),
                   sh.start, sh.len, {}};
  int64_t k = 0;
  for (int64_t i = 0; i < sh.n_ex; ++i) {
    pr.slot.push_back(k);
    k += std::max<int64_t>(0, pr.n_chunks(i) - 1);
  }
  return pr;
}

// The per-thread scratch of one call, one per ATen thread (at::get_thread_num()).
template <typename S>
std::vector<Work<S>> works() {
  return std::vector<Work<S>>(std::max(1, at::get_num_threads()));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> mamba2_scan_forward(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
    const at::Tensor& C, const OptTensor& D, const OptTensor& dt_bias,
    const OptTensor& initial_state, const OptTensor& cu_seqlens, bool softplus, double lo,
    double hi, int64_t chunk, int64_t sub) {
  LORAFUSE_PROFILE_RANGE("mamba2_scan_forward");
  TORCH_CHECK(chunk >= 1 && sub >= 1, "mamba2_scan: chunk and sub must be >= 1");
  TORCH_CHECK(blas_gemm_available(), "mamba2_scan: this torch build exports no usable BLAS");
  const Shapes sh = shapes_of(x, dt, A, B, C, cu_seqlens);
  const at::ScalarType s = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor xc = x.contiguous(), Bc = B.contiguous(), Cc = C.contiguous();
  const at::Tensor dtv = std::get<1>(discretize(dt, dt_bias, softplus, lo, hi, s, sh.tokens));
  const at::Tensor A_ = A.to(s).contiguous(), D_ = opt_to(D, s);
  const at::Tensor init = opt_to(initial_state, s);
  const auto opts = x.options().dtype(s);
  at::Tensor y = at::empty({sh.b, sh.t, sh.H, sh.P}, opts);
  at::Tensor final = at::empty({sh.n_ex, sh.H, sh.P, sh.N}, opts);
  at::Tensor saved = at::empty({sh.b * std::max<int64_t>(0, (sh.t - 1) / chunk), sh.H, sh.P, sh.N},
                               opts);
  LORAFUSE_DISPATCH(x.scalar_type(), "mamba2_scan_forward", [&] {
    using S = Compute<scalar_t>;
    const auto pr = problem<scalar_t, S>(sh, xc, Bc, Cc, dtv, A_, D_, chunk, sub);
    const int64_t used = pr.slot.empty() ? 0 : pr.slot.back() + std::max<int64_t>(
                                                   0, pr.n_chunks(sh.n_ex - 1) - 1);
    saved.narrow(0, used, saved.size(0) - used).zero_();
    auto ws = works<S>();
    S *yp = y.mutable_data_ptr<S>(), *fp = final.mutable_data_ptr<S>();
    S* sp = saved.mutable_data_ptr<S>();
    parallel_tasks(sh.n_ex * sh.H, [&](int64_t k) {
      const FlushDenormals flushed;
      Work<S>& w = ws[at::get_thread_num()];
      w.size(pr.sub, sh.P, sh.N, 1);
      forward_head(pr, w, ptr<S>(init), sp, fp, yp, sh.order[k / sh.H], k % sh.H);
    }, [] {});
  });
  return {y, final, saved};
}

std::vector<at::Tensor> mamba2_scan_backward(
    const at::Tensor& gy, const OptTensor& gfinal, const at::Tensor& x, const at::Tensor& dt,
    const at::Tensor& A, const at::Tensor& B, const at::Tensor& C, const OptTensor& D,
    const OptTensor& dt_bias, const OptTensor& initial_state, const OptTensor& cu_seqlens,
    const at::Tensor& saved, bool softplus, double lo, double hi, int64_t chunk,
    std::vector<bool> needs, int64_t sub) {
  LORAFUSE_PROFILE_RANGE("mamba2_scan_backward");
  TORCH_CHECK(needs.size() == 8, "mamba2_scan_backward: needs must hold 8 flags");
  TORCH_CHECK(chunk >= 1 && sub >= 1, "mamba2_scan: chunk and sub must be >= 1");
  TORCH_CHECK(blas_gemm_available(), "mamba2_scan: this torch build exports no usable BLAS");
  const Shapes sh = shapes_of(x, dt, A, B, C, cu_seqlens);
  const at::ScalarType s = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor xc = x.contiguous(), Bc = B.contiguous(), Cc = C.contiguous();
  at::Tensor z, dtv;  // not a structured binding: the lambdas below capture them
  std::tie(z, dtv) = discretize(dt, dt_bias, softplus, lo, hi, s, sh.tokens);
  const at::Tensor A_ = A.to(s).contiguous(), D_ = opt_to(D, s);
  const at::Tensor init = opt_to(initial_state, s), gf = opt_to(gfinal, s);
  const at::Tensor g = gy.to(s).contiguous(), sv = saved.to(s).contiguous();
  TORCH_CHECK(g.numel() == xc.numel(), "mamba2_scan_backward: gy must be shaped as x");
  const auto opts = x.options().dtype(s);
  const bool has_init = init.defined(), has_D = D_.defined();
  const bool has_bias = dt_bias.has_value() && dt_bias->defined();
  at::Tensor da = at::empty({sh.tokens, sh.H}, opts), ddt_x = at::empty({sh.tokens, sh.H}, opts);
  at::Tensor dD = at::zeros({sh.n_ex, sh.H}, opts);
  at::Tensor dx = needs[0] ? at::empty_like(xc) : at::Tensor();
  at::Tensor dinit = needs[7] && has_init ? at::empty({sh.n_ex, sh.H, sh.P, sh.N}, opts)
                                          : at::Tensor();
  // Heads of a group in K fixed blocks, one task each per (example, group): about two tasks per
  // thread; each block adds its dB / dC into a buffer of its own.
  const int64_t hpg = sh.H / sh.G, threads = at::get_num_threads();
  const int64_t K = std::clamp<int64_t>((2 * threads + sh.n_ex * sh.G - 1) / (sh.n_ex * sh.G), 1,
                                        hpg);
  at::Tensor dBb = needs[3] ? at::zeros({K, sh.tokens, sh.G, sh.N}, opts) : at::Tensor();
  at::Tensor dCb = needs[4] ? at::zeros({K, sh.tokens, sh.G, sh.N}, opts) : at::Tensor();
  LORAFUSE_DISPATCH(x.scalar_type(), "mamba2_scan_backward", [&] {
    using S = Compute<scalar_t>;
    const auto pr = problem<scalar_t, S>(sh, xc, Bc, Cc, dtv, A_, D_, chunk, sub);
    const int64_t n_starts = (chunk + pr.sub - 1) / pr.sub;
    auto ws = works<S>();
    const int64_t block = sh.tokens * sh.G * sh.N;
    parallel_tasks(sh.n_ex * sh.G * K, [&](int64_t k) {
      const FlushDenormals flushed;
      Work<S>& w = ws[at::get_thread_num()];
      w.size(pr.sub, sh.P, sh.N, n_starts);
      const int64_t n = sh.order[k / (sh.G * K)], grp = (k / K) % sh.G, kb = k % K;
      const Grads<scalar_t, S> gr{
          g.const_data_ptr<S>(),
          dx.defined() ? dx.mutable_data_ptr<scalar_t>() : nullptr,
          da.mutable_data_ptr<S>(),
          ddt_x.mutable_data_ptr<S>(),
          dD.mutable_data_ptr<S>(),
          dBb.defined() ? dBb.mutable_data_ptr<S>() + kb * block : nullptr,
          dCb.defined() ? dCb.mutable_data_ptr<S>() + kb * block : nullptr,
          dinit.defined() ? dinit.mutable_data_ptr<S>() : nullptr};
      for (int64_t h = grp * hpg + kb * hpg / K; h < grp * hpg + (kb + 1) * hpg / K; ++h) {
        backward_head(pr, w, gr, ptr<S>(init), ptr<S>(sv), ptr<S>(gf), n, h);
      }
    }, [] {});
  });
  // The elementwise steps, as the torch backend takes them (ATen's own rules and rounding).
  at::Tensor ddt = ddt_x + da * A_;  // a = dt'·A, x̄ = dt'·x
  at::Tensor v = softplus ? at::softplus(z, 1, 20) : z;
  at::Tensor dz = at::where(at::logical_and(v >= lo, v <= hi), ddt, at::zeros_like(ddt));
  if (softplus) dz = at::softplus_backward(dz, z, 1, 20);
  auto as = [](const at::Tensor& t, const at::Tensor& like) {
    return t.to(like.scalar_type()).view(like.sizes());
  };
  std::vector<at::Tensor> out(8);
  if (needs[0]) out[0] = dx.view(x.sizes());
  if (needs[1]) out[1] = as(dz, dt);
  if (needs[2]) out[2] = as((dtv * da).sum(0), A);
  if (needs[3]) out[3] = as(dBb.sum(0), B);
  if (needs[4]) out[4] = as(dCb.sum(0), C);
  if (needs[5] && has_D) out[5] = as(dD.sum(0), *D);
  if (needs[6] && has_bias) out[6] = as(dz.sum(0), *dt_bias);
  if (needs[7] && has_init) out[7] = as(dinit, *initial_state);
  return out;
}

// One token per row (decoding): x (b, H, P), dt (b, H), B, C (b, G, N), state (b, H, P, N) or
// none (zeros) -> (y (b, H, P), new state), compute type. The recurrence itself, row by row of the
// state: s = exp(dt'·A)·s + (dt'·x_p)·B, y_p = s·C + D·x_p.
std::tuple<at::Tensor, at::Tensor> mamba2_scan_step(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
    const at::Tensor& C, const OptTensor& D, const OptTensor& dt_bias, const OptTensor& state,
    bool softplus, double lo, double hi) {
  LORAFUSE_PROFILE_RANGE("mamba2_scan_step");
  TORCH_CHECK(x.dim() == 3 && dt.dim() == 2 && B.dim() == 3 && C.sizes() == B.sizes() &&
                  B.scalar_type() == x.scalar_type() && C.scalar_type() == x.scalar_type(),
              "mamba2_scan_step: x (b, H, P), dt (b, H), B and C (b, G, N) of x's dtype, got ",
              x.sizes(), ", ", dt.sizes(), ", ", B.sizes(), ", ", C.sizes());
  const int64_t b = x.size(0), H = x.size(1), P = x.size(2), G = B.size(1), N = B.size(2);
  TORCH_CHECK(G > 0 && H % G == 0 && A.numel() == H, "mamba2_scan_step: H = ", H,
              " must be a multiple of G = ", G, " and A (H,)");
  const at::ScalarType s = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor xc = x.contiguous(), Bc = B.contiguous(), Cc = C.contiguous();
  const at::Tensor dtv = std::get<1>(discretize(dt, dt_bias, softplus, lo, hi, s, b));
  const at::Tensor A_ = A.to(s).contiguous(), D_ = opt_to(D, s), st = opt_to(state, s);
  at::Tensor y = at::empty({b, H, P}, x.options().dtype(s));
  at::Tensor out = at::empty({b, H, P, N}, x.options().dtype(s));
  LORAFUSE_DISPATCH(x.scalar_type(), "mamba2_scan_step", [&] {
    using S = Compute<scalar_t>;
    using V = at::vec::Vectorized<S>;
    const scalar_t *xp = xc.const_data_ptr<scalar_t>(), *bp = Bc.const_data_ptr<scalar_t>();
    const scalar_t* cp = Cc.const_data_ptr<scalar_t>();
    const S *dp = dtv.const_data_ptr<S>(), *ap = A_.const_data_ptr<S>(), *Dp = ptr<S>(D_);
    const S* sp = ptr<S>(st);
    S *yp = y.mutable_data_ptr<S>(), *op = out.mutable_data_ptr<S>();
    at::parallel_for(0, b * H, 1, [&](int64_t r0, int64_t r1) {
      const FlushDenormals flushed;
      Buf<S> bc(N), cc(N), xr(P);
      alignas(64) S lanes[V::size()];
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t i = r / H, h = r % H, g = h / (H / G);
        to_compute(bp + (i * G + g) * N, bc.data(), N);
        to_compute(cp + (i * G + g) * N, cc.data(), N);
        to_compute(xp + r * P, xr.data(), P);
        const S d = dp[r], e = std::exp(d * ap[h]), skip = Dp ? Dp[h] : S(0);
        for (int64_t p = 0; p < P; ++p) {
          const S coef = d * xr[p];
          const S* s0 = sp ? sp + (r * P + p) * N : nullptr;
          S* s1 = op + (r * P + p) * N;
          V acc(S(0));
          int64_t k = 0;
          for (; k + V::size() <= N; k += V::size()) {
            const V add = V(coef) * V::loadu(bc.data() + k);
            const V v = s0 ? at::vec::fmadd(V(e), V::loadu(s0 + k), add) : add;
            v.store(s1 + k);
            acc = at::vec::fmadd(v, V::loadu(cc.data() + k), acc);
          }
          acc.store(lanes);
          S sum = 0;
          for (int64_t j = 0; j < V::size(); ++j) sum += lanes[j];
          for (; k < N; ++k) {
            const S v = (s0 ? e * s0[k] : S(0)) + coef * bc[k];
            s1[k] = v;
            sum += v * cc[k];
          }
          yp[r * P + p] = sum + skip * xr[p];
        }
      }
    });
  });
  return {y, out};
}

}  // namespace lorafuse
