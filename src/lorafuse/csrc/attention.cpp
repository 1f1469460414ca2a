// Causal self-attention for training on CPU, fp32, GQA, no mask tensor:
//   out = softmax(scale * q kᵀ + causal) v      per (batch, query head); kv head = head / G.
// Shapes: q (B,Hq,T,D), k/v (B,Hk,T,D) with any batch/head/time strides and unit stride on D;
// out (B,T,Hq,D) contiguous (the layout o_proj reads, so no transpose copy), lse (B,Hq,T) fp32.
//
// Why not ATen's flash kernel: on a 2-core AVX2 box it spends ~40 GFLOP/s on these shapes. Here
// the work is split into row blocks of BR queries (forward: one task per block; backward: one
// task per (batch, kv head) walking its blocks); a block only multiplies against the keys it can
// see (the causal triangle is skipped block-wise), the products run in the BLAS sgemm that torch
// links (single-threaded inside a task), and the softmax is one vectorised pass over a BR x T
// scratch. Backward recomputes P from the saved
// log-sum-exp (nothing of size T x T is kept), and accumulates dK/dV of the G query heads that
// share a kv head inside the same task, so no two threads write the same rows.
#include <dlfcn.h>

#include "common.h"

namespace lorafuse {
namespace {

constexpr int64_t BR = 64;  // query rows per block: large enough for sgemm, small causal waste

// The Fortran BLAS sgemm (32-bit ints) of the BLAS torch itself links (MKL or OpenBLAS): looked
// up at run time in libtorch_cpu and its dependencies, never in whatever else the process
// loaded, so a torch build without it still loads every other kernel of this extension.
using sgemm_t = void (*)(const char*, const char*, const int*, const int*, const int*,
                         const float*, const float*, const int*, const float*, const int*,
                         const float*, float*, const int*);

sgemm_t sgemm_fn = nullptr;

// Row-major C (m x n) = alpha * op(A) op(B) + beta * C; A/B/C row-major with leading dims.
// Column-major BLAS sees each row-major matrix transposed, so it computes Cᵀ = op(B)ᵀ op(A)ᵀ.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char opa = tb ? 'T' : 'N', opb = ta ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int LA = static_cast<int>(ldb), LB = static_cast<int>(lda), LC = static_cast<int>(ldc);
  sgemm_fn(&opa, &opb, &M, &N, &K, &alpha, b, &LA, a, &LB, &beta, c, &LC);
}

sgemm_t find_sgemm() {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(&at::_ops::mm::call), &info) || !info.dli_fname) {
    return nullptr;
  }
  void* torch_cpu = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!torch_cpu) return nullptr;
  auto fn = reinterpret_cast<sgemm_t>(dlsym(torch_cpu, "sgemm_"));
  dlclose(torch_cpu);  // only drops the reference RTLD_NOLOAD added
  if (!fn) return nullptr;
  // Self-test the calling convention on [[1,2,3],[4,5,6]] · [[1,0],[0,1],[1,1]].
  const float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1};
  float c[4] = {0, 0, 0, 0};
  sgemm_fn = fn;
  gemm(false, false, 2, 2, 3, 1.f, a, 3, b, 2, 0.f, c, 2);
  const bool ok = c[0] == 4 && c[1] == 5 && c[2] == 10 && c[3] == 11;
  sgemm_fn = nullptr;
  return ok ? fn : nullptr;
}

bool blas_ready() {
  static const sgemm_t fn = find_sgemm();  // thread-safe one-time lookup
  sgemm_fn = fn;
  return fn != nullptr;
}

struct View {  // a (B, H, T, D) fp32 tensor with unit stride on D
  const float* p;
  int64_t sb, sh, st;
  explicit View(const at::Tensor& t)
      : p(t.const_data_ptr<float>()), sb(t.stride(0)), sh(t.stride(1)), st(t.stride(2)) {}
  const float* at(int64_t b, int64_t h, int64_t t) const { return p + b * sb + h * sh + t * st; }
};

// Rows [s0, s0+rows) of one head: s holds scale * q kᵀ for keys [0, s0+rows); turn each row into
// its softmax over the visible keys (zeros beyond the diagonal) and return log-sum-exp in lse.
void softmax_rows(float* s, int64_t rows, int64_t s0, int64_t ld, float* lse) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = s + i * ld;
    const int64_t n = s0 + i + 1;  // visible keys
    const float mx = at::vec::reduce_all<float>([](fVec a, fVec b) { return at::vec::maximum(a, b); },
                                                row, n);
    at::vec::map([mx](fVec x) { return (x - fVec(mx)).exp_u20(); }, row, row, n);
    const float sum = at::vec::reduce_all<float>([](fVec a, fVec b) { return a + b; }, row, n);
    const float inv = 1.f / sum;
    at::vec::map([inv](fVec x) { return x * fVec(inv); }, row, row, n);
    std::fill(row + n, row + ld, 0.f);
    lse[i] = mx + std::log(sum);
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(blas_ready(),
              "attention: this torch build exports no usable BLAS sgemm_; use backend='torch'");
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == at::kFloat && t->stride(3) == 1,
                "attention: q, k, v must be fp32 (B, H, T, D) with unit stride on D, got ",
                t->scalar_type(), " ", t->sizes(), " strides ", t->strides());
  }
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0,
              "attention: q ", q.sizes(), " and k/v ", k.sizes(), ", ", v.sizes(),
              " must be (B, Hq, T, D) and (B, Hk, T, D) with Hq a multiple of Hk");
}

}  // namespace

bool attention_available() { return blas_ready(); }

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, double scale) {
  check_inputs(q, k, v);
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hk = k.size(1);
  const int64_t G = Hq / Hk;
  auto out = at::empty({B, T, Hq, D}, q.options());
  auto lse = at::empty({B, Hq, T}, q.options());
  const View Q(q), K(k), V(v);
  float* o = out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  // Forward blocks are independent: one task per (batch, head, row block), so a batch of one
  // with few kv heads still keeps every thread busy.
  const int64_t blocks = (T + BR - 1) / BR;
  at::parallel_for(0, B * Hq * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(BR * T);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (Hq * blocks), h = task / blocks % Hq, hk = h / G;
      const int64_t s0 = task % blocks * BR, rows = std::min(BR, T - s0), keys = s0 + rows;
      gemm(false, true, rows, keys, D, static_cast<float>(scale), Q.at(b, h, s0), Q.st,
           K.at(b, hk, 0), K.st, 0.f, s.data(), keys);
      softmax_rows(s.data(), rows, s0, keys, l + (b * Hq + h) * T + s0);
      gemm(false, false, rows, D, keys, 1.f, s.data(), keys, V.at(b, hk, 0), V.st, 0.f,
           o + ((b * T + s0) * Hq + h) * D, Hq * D);
    }
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale) {
  check_inputs(q, k, v);
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hk = k.size(1);
  const int64_t G = Hq / Hk;
  TORCH_CHECK(dout.is_contiguous() && out.is_contiguous() && dout.sizes() == out.sizes() &&
                  out.sizes() == at::IntArrayRef({B, T, Hq, D}) && dout.scalar_type() == at::kFloat,
              "attention backward: dout and out must be contiguous fp32 (B, T, Hq, D)");
  TORCH_CHECK(lse.is_contiguous() && lse.sizes() == at::IntArrayRef({B, Hq, T}),
              "attention backward: lse must be contiguous (B, Hq, T)");
  // Layouts as the forward's output: (B, T, H, D), returned as (B, H, T, D) views.
  auto dq = at::empty({B, T, Hq, D}, q.options());
  auto dk = at::zeros({B, T, Hk, D}, q.options());
  auto dv = at::zeros({B, T, Hk, D}, q.options());
  const View Q(q), K(k), V(v);
  const float* go = dout.const_data_ptr<float>();
  const float* o = out.const_data_ptr<float>();
  const float* l = lse.const_data_ptr<float>();
  float *dqp = dq.data_ptr<float>(), *dkp = dk.data_ptr<float>(), *dvp = dv.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(BR * T), dp(BR * T);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hk, hk = task % Hk;
      float* dK = dkp + (b * T * Hk + hk) * D;  // rows t at dK + t * Hk * D
      float* dV = dvp + (b * T * Hk + hk) * D;
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
        for (int64_t s0 = 0; s0 < T; s0 += BR) {
          const int64_t rows = std::min(BR, T - s0), keys = s0 + rows;
          const float* dO = go + ((b * T + s0) * Hq + h) * D;  // row stride Hq * D
          const float* O = o + ((b * T + s0) * Hq + h) * D;
          const float* L = l + (b * Hq + h) * T + s0;
          // P = exp(scale q kᵀ - lse) on the visible keys, 0 beyond the diagonal.
          gemm(false, true, rows, keys, D, sc, Q.at(b, h, s0), Q.st, K.at(b, hk, 0), K.st, 0.f,
               p.data(), keys);
          for (int64_t i = 0; i < rows; ++i) {
            float* row = p.data() + i * keys;
            const int64_t n = s0 + i + 1;
            const float li = L[i];
            at::vec::map([li](fVec x) { return (x - fVec(li)).exp_u20(); }, row, row, n);
            std::fill(row + n, row + keys, 0.f);
          }
          gemm(true, false, keys, D, rows, 1.f, p.data(), keys, dO, Hq * D, 1.f, dV, Hk * D);
          gemm(false, true, rows, keys, D, 1.f, dO, Hq * D, V.at(b, hk, 0), V.st, 0.f,
               dp.data(), keys);
          // dS = P * (dP - rowsum(dO * O)) * scale, in dp.
          for (int64_t i = 0; i < rows; ++i) {
            const float delta = at::vec::map2_reduce_all<float>(
                [](fVec a, fVec c) { return a * c; }, [](fVec a, fVec c) { return a + c; },
                dO + i * Hq * D, O + i * Hq * D, D);
            float* ds = dp.data() + i * keys;
            const float* pr = p.data() + i * keys;
            at::vec::map2([delta, sc](fVec pv, fVec dpv) { return pv * (dpv - fVec(delta)) * fVec(sc); },
                          ds, pr, ds, keys);
          }
          gemm(false, false, rows, D, keys, 1.f, dp.data(), keys, K.at(b, hk, 0), K.st, 0.f,
               dqp + ((b * T + s0) * Hq + h) * D, Hq * D);
          gemm(true, false, keys, D, rows, 1.f, dp.data(), keys, Q.at(b, h, s0), Q.st, 1.f, dK,
               Hk * D);
        }
      }
    }
  });
  return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)};
}

}  // namespace lorafuse
