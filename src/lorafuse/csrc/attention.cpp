// Causal self-attention for training on CPU, GQA, no mask tensor:
//   out = softmax(scale * q kᵀ + causal) v      per (batch, query head); kv head = head / G.
// Shapes: q (B,Hq,T,D), k/v (B,Hk,T,D) with any batch/head/time strides and unit stride on D;
// out (B,T,Hq,D) contiguous (the layout o_proj reads, so no transpose copy), lse (B,Hq,T) fp32.
// Storage fp32, or bf16 where this CPU multiplies bf16 natively (AVX-512-BF16, AMX).
//
// Why not ATen's flash kernel: on a 2-core AVX2 box it spends ~40 GFLOP/s on these shapes. Here
// the work is split into row blocks of br queries of the query heads that share a kv head (see
// Blocking); a block only multiplies against the keys it can see (the causal triangle is skipped
// block-wise), the products run in the BLAS that torch links (single-threaded inside a task),
// and the softmax is one vectorised pass over an M x BC scratch. Tasks are dealt round-robin over
// the threads, so the cheap early and dear late blocks of the triangle spread evenly. Backward
// recomputes P from the saved log-sum-exp (nothing of size T x T is kept).
//
// Products: fp32 storage -> BLAS sgemm. bf16 storage -> MKL's gemm_bf16bf16f32 (bf16 operands,
// fp32 accumulation and fp32 result), the same products torch's own CPU flash kernel runs. Every
// softmax, log-sum-exp, row sum and gradient accumulator is fp32; the only roundings to bf16 are
// the operands a product needs (P before P·V and Pᵀ·dO, dS before dS·K and dSᵀ·Q, as the flash
// kernel does) and each output once at the end.
#include <dlfcn.h>

#include <cstring>
#include <limits>

#include "common.h"

namespace lorafuse {
namespace {

constexpr int64_t BC = 512;  // keys per block: the M x BC fp32 scratches stay in L2

// Both BLAS entry points are looked up at run time in libtorch_cpu and its dependencies, never in
// whatever else the process loaded, so a torch build without them still loads every other kernel.
// Fortran sgemm (column-major, 32-bit ints), of MKL or OpenBLAS.
using sgemm_t = void (*)(const char*, const char*, const int*, const int*, const int*,
                         const float*, const float*, const int*, const float*, const int*,
                         const float*, float*, const int*);
// MKL's cblas_gemm_bf16bf16f32 (layout, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c,
// ldc), MKL_INT = int (torch links the LP64 interface).
using bf16gemm_t = void (*)(int, int, int, int, int, int, float, const void*, int, const void*,
                            int, float, float*, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

sgemm_t sgemm_fn = nullptr;
bf16gemm_t bf16gemm_fn = nullptr;

// Row-major C (m x n) = alpha * op(A) op(B) + beta * C; A/B/C row-major with leading dims.
// Column-major BLAS sees each row-major matrix transposed, so it computes Cᵀ = op(B)ᵀ op(A)ᵀ.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char opa = tb ? 'T' : 'N', opb = ta ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int LA = static_cast<int>(ldb), LB = static_cast<int>(lda), LC = static_cast<int>(ldc);
  sgemm_fn(&opa, &opb, &M, &N, &K, &alpha, b, &LA, a, &LB, &beta, c, &LC);
}

// The same contract with bf16 operands and an fp32 C.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const at::BFloat16* a,
          int64_t lda, const at::BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  bf16gemm_fn(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
              static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

void* torch_symbol(const char* name) {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(&at::_ops::mm::call), &info) || !info.dli_fname) {
    return nullptr;
  }
  void* torch_cpu = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!torch_cpu) return nullptr;
  void* fn = dlsym(torch_cpu, name);
  dlclose(torch_cpu);  // only drops the reference RTLD_NOLOAD added
  return fn;
}

// Self-test a product on [[1,2,3],[4,5,6]] · [[1,0],[0,1],[1,1]] (and its transposed operands):
// a wrong calling convention fails here instead of producing wrong attention.
template <typename T>
bool gemm_works() {
  const T a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1};
  const T at_[6] = {1, 4, 2, 5, 3, 6}, bt[6] = {1, 0, 1, 0, 1, 1};  // aᵀ (3x2), bᵀ (2x3)
  float c[4] = {0, 0, 0, 0}, d[4] = {1, 1, 1, 1};
  gemm(false, false, 2, 2, 3, 1.f, a, 3, b, 2, 0.f, c, 2);
  gemm(true, true, 2, 2, 3, 1.f, at_, 2, bt, 3, 1.f, d, 2);
  return c[0] == 4 && c[1] == 5 && c[2] == 10 && c[3] == 11 && d[0] == 5 && d[1] == 6 &&
         d[2] == 11 && d[3] == 12;
}

bool blas_ready() {
  static const sgemm_t fn = [] {  // thread-safe one-time lookup
    sgemm_fn = reinterpret_cast<sgemm_t>(torch_symbol("sgemm_"));
    const bool ok = sgemm_fn && gemm_works<float>();
    return ok ? sgemm_fn : nullptr;
  }();
  sgemm_fn = fn;
  return fn != nullptr;
}

bool bf16_blas_ready() {
  static const bf16gemm_t fn = [] {
    bf16gemm_fn = reinterpret_cast<bf16gemm_t>(torch_symbol("cblas_gemm_bf16bf16f32"));
    const bool ok = bf16gemm_fn && gemm_works<at::BFloat16>();
    return ok ? bf16gemm_fn : nullptr;
  }();
  bf16gemm_fn = fn;
  return fn != nullptr;
}

template <typename T>
struct View {  // a (B, H, T, D) tensor with unit stride on D
  const T* p;
  int64_t sb, sh, st;
  explicit View(const at::Tensor& t)
      : p(t.const_data_ptr<T>()), sb(t.stride(0)), sh(t.stride(1)), st(t.stride(2)) {}
  const T* at(int64_t b, int64_t h, int64_t t) const { return p + b * sb + h * sh + t * st; }
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

// n fp32 values -> T (round to nearest even, as tensor.to(T)); a plain copy for fp32.
template <typename T>
void store_row(T* dst, const float* src, int64_t n) {
  int64_t j = 0;
  for (; j + kW <= n; j += kW) store_f<T>(dst + j, fVec::loadu(src + j));
  for (; j < n; ++j) dst[j] = static_cast<T>(src[j]);
}

// Where a product's operand lives: the fp32 scratch itself for fp32 storage, else its T copy.
template <typename T>
T* operand_buffer(std::vector<float>& scratch, std::vector<T>& copy) {
  if constexpr (std::is_same_v<T, float>) {
    return scratch.data();
  } else {
    return copy.data();
  }
}

template <typename T>
float dot(const T* a, const T* b, int64_t n) {  // fp32 sum of a·b
  fVec acc(0.f);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) acc = at::vec::fmadd(load_f<T>(a + j), load_f<T>(b + j), acc);
  float s = hsum(acc);
  for (; j < n; ++j) s += static_cast<float>(a[j]) * static_cast<float>(b[j]);
  return s;
}

// row[j] <- exp(row[j] - m) for j < n and 0 up to cols; the same values rounded to T go to out
// (for fp32, out is row itself). One pass: the exponentials, their sum and the operand copy.
template <typename T>
float exp_row(float* row, int64_t n, int64_t cols, float m, T* out) {
  const fVec mv(m);
  fVec acc(0.f);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const fVec e = (fVec::loadu(row + j) - mv).exp_u20();
    acc = acc + e;
    if constexpr (std::is_same_v<T, float>) {
      e.store(row + j);
    } else {
      e.store(row + j);
      store_f<T>(out + j, e);
    }
  }
  float sum = hsum(acc);
  for (; j < n; ++j) {
    const float e = std::exp(row[j] - m);
    row[j] = e;
    out[j] = static_cast<T>(e);
    sum += e;
  }
  for (; j < cols; ++j) {
    row[j] = 0.f;
    out[j] = static_cast<T>(0.f);
  }
  return sum;
}

// dS = P * (dP - delta) * scale over one row, rounded to T into out (for fp32, out is dp).
template <typename T>
void ds_row(const float* p, float* dp, int64_t cols, float delta, float sc, T* out) {
  const fVec dv(delta), sv(sc);
  int64_t j = 0;
  for (; j + kW <= cols; j += kW) {
    const fVec ds = fVec::loadu(p + j) * (fVec::loadu(dp + j) - dv) * sv;
    if constexpr (std::is_same_v<T, float>) {
      ds.store(out + j);
    } else {
      store_f<T>(out + j, ds);
    }
  }
  for (; j < cols; ++j) out[j] = static_cast<T>(p[j] * (dp[j] - delta) * sc);
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16,
              "attention: q, k, v must be fp32 or bf16, got ", dt);
  TORCH_CHECK(blas_ready(),
              "attention: this torch build exports no usable BLAS sgemm_; use backend='torch'");
  TORCH_CHECK(dt == at::kFloat || bf16_blas_ready(),
              "attention: this torch build exports no usable cblas_gemm_bf16bf16f32 (MKL); "
              "pass fp32 inputs");
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == dt && t->stride(3) == 1,
                "attention: q, k, v must share a dtype and be (B, H, T, D) with unit stride on D, "
                "got ", t->scalar_type(), " ", t->sizes(), " strides ", t->strides());
  }
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0,
              "attention: q ", q.sizes(), " and k/v ", k.sizes(), ", ", v.sizes(),
              " must be (B, Hq, T, D) and (B, Hk, T, D) with Hq a multiple of Hk");
}

// Query heads that share a kv head are multiplied together: the rows of up to `pack` heads
// (their query blocks stacked, g-major) form one product against each key/value block, so the
// BLAS packs K and V once for them and runs an M = pack·br product instead of pack products of
// M = br.
struct Blocking {
  int64_t br;     // query rows per head per block (divides BC, so no row sees zero keys)
  int64_t pack;   // query heads per product (G or a divisor of it)
  int64_t packs;  // G / pack
};

// The largest product M = pack·br up to 256 rows (the backward's four M x BC scratches stay in
// a 2 MiB L2), preferring the smaller br on ties: a diagonal block wastes ~br/T of the work on
// masked keys, so br = 128 is only a candidate from 2048 tokens on.
Blocking blocking(int64_t T, int64_t G) {
  Blocking best{0, 0, 0};
  for (int64_t br : {64, 128}) {
    if (br == 128 && T < 2048) break;
    int64_t pack = std::max<int64_t>(1, std::min<int64_t>(G, 256 / br));
    while (G % pack) --pack;  // equal packs
    if (pack * br > best.pack * best.br) best = {br, pack, G / pack};
  }
  return best;
}

// Stack rows [s0, s0+rows) of heads h0..h0+pack of x (row stride st, head stride sh) into dst
// (pack·rows x D, row g·rows + i).
template <typename T>
void stack_rows(T* dst, const T* x, int64_t st, int64_t sh, int64_t pack, int64_t rows,
                int64_t D) {
  for (int64_t g = 0; g < pack; ++g) {
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(dst + (g * rows + i) * D, x + g * sh + i * st, D * sizeof(T));
    }
  }
}

// Run task(t) for t in [0, n) with tasks dealt round-robin over the threads: neighbouring row
// blocks (whose cost grows along the causal triangle) land on different threads.
template <typename F>
void deal(int64_t n, const F& task) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = t; i < n; i += threads) task(i);
    }
  });
}

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
                  at::Tensor& out, at::Tensor& lse) {
  const int64_t B = q.size(0), Hq = q.size(1), T_ = q.size(2), D = q.size(3), Hk = k.size(1);
  const int64_t G = Hq / Hk;
  const Blocking bl = blocking(T_, G);
  const int64_t BRr = bl.br, M = bl.pack * BRr;
  const View<T> Q(q), K(k), V(v);
  T* o = out.data_ptr<T>();
  float* l = lse.data_ptr<float>();
  const int64_t blocks = (T_ + BRr - 1) / BRr;
  // One task per (batch, kv head, head pack, row block); blocks vary fastest.
  deal(B * Hk * bl.packs * blocks, [&](int64_t task) {
    thread_local std::vector<float> s, acc, mx, sum;
    thread_local std::vector<T> p, qp;
    s.resize(M * BC), acc.resize(M * D), mx.resize(M), sum.resize(M), qp.resize(M * D);
    if constexpr (!std::is_same_v<T, float>) p.resize(M * BC);
    T* pb = operand_buffer<T>(s, p);  // P as the P·V product reads it
    const int64_t blk = task % blocks, rest = task / blocks;
    const int64_t pk = rest % bl.packs, hk = rest / bl.packs % Hk, b = rest / bl.packs / Hk;
    const int64_t h0 = hk * G + pk * bl.pack;
    const int64_t s0 = blk * BRr, rows = std::min(BRr, T_ - s0), keys = s0 + rows;
    const int64_t m = bl.pack * rows;
    stack_rows<T>(qp.data(), Q.at(b, h0, s0), Q.st, Q.sh, bl.pack, rows, D);
    std::fill(mx.begin(), mx.begin() + m, -std::numeric_limits<float>::infinity());
    std::fill(sum.begin(), sum.begin() + m, 0.f);
    // Online softmax over key blocks of BC (the scratch stays in L2 however long T is).
    for (int64_t c0 = 0; c0 < keys; c0 += BC) {
      const int64_t cols = std::min(BC, keys - c0);
      gemm(false, true, m, cols, D, scale, qp.data(), D, K.at(b, hk, c0), K.st, 0.f, s.data(),
           cols);
      for (int64_t r = 0; r < m; ++r) {
        const int64_t i = r % rows;
        float* row = s.data() + r * cols;
        const int64_t n = std::min(cols, s0 + i + 1 - c0);  // visible keys in this block
        const float m_old = mx[r];
        const float m_new = std::max(
            m_old, at::vec::reduce_all<float>(
                       [](fVec a, fVec c) { return at::vec::maximum(a, c); }, row, n));
        const float block_sum = exp_row<T>(row, n, cols, m_new, pb + r * cols);
        const float rescale = std::exp(m_old - m_new);  // 0 on the first block
        sum[r] = sum[r] * rescale + block_sum;
        mx[r] = m_new;
        if (c0 > 0) {
          float* a = acc.data() + r * D;
          at::vec::map([rescale](fVec x) { return x * fVec(rescale); }, a, a, D);
        }
      }
      gemm(false, false, m, D, cols, 1.f, pb, cols, V.at(b, hk, c0), V.st, c0 > 0 ? 1.f : 0.f,
           acc.data(), D);
    }
    for (int64_t r = 0; r < m; ++r) {
      const int64_t g = r / rows, i = r % rows, h = h0 + g;
      float* a = acc.data() + r * D;
      const float inv = 1.f / sum[r];
      at::vec::map([inv](fVec x) { return x * fVec(inv); }, a, a, D);
      store_row<T>(o + ((b * T_ + s0 + i) * Hq + h) * D, a, D);
      l[(b * Hq + h) * T_ + s0 + i] = mx[r] + std::log(sum[r]);
    }
  });
}

// Backward of one (batch, kv head, head pack) over the row blocks blk = part, part + parts, ...:
// dQ rows are written to dq; dK/dV are summed into this task's fp32 accumulators dk_acc/dv_acc
// (T x D, row stride D).
template <typename T>
void backward_rows(int64_t b, int64_t h0, int64_t hk, int64_t part, int64_t parts,
                   const Blocking& bl, const View<T>& Q, const View<T>& K, const View<T>& V,
                   const T* go, const T* o, const float* l, T* dq, float* dk_acc, float* dv_acc,
                   int64_t T_, int64_t Hq, int64_t D, float sc) {
  const int64_t BRr = bl.br, M = bl.pack * BRr;
  thread_local std::vector<float> p, dp, dq_acc, delta;
  thread_local std::vector<T> pb, dsb, qp, dop;
  p.resize(M * BC), dp.resize(M * BC), dq_acc.resize(M * D), delta.resize(M);
  qp.resize(M * D), dop.resize(M * D);
  if constexpr (!std::is_same_v<T, float>) pb.resize(M * BC), dsb.resize(M * BC);
  const int64_t blocks = (T_ + BRr - 1) / BRr;
  for (int64_t blk = part; blk < blocks; blk += parts) {
    const int64_t s0 = blk * BRr, rows = std::min(BRr, T_ - s0), keys = s0 + rows;
    const int64_t m = bl.pack * rows;
    stack_rows<T>(qp.data(), Q.at(b, h0, s0), Q.st, Q.sh, bl.pack, rows, D);
    stack_rows<T>(dop.data(), go + ((b * T_ + s0) * Hq + h0) * D, Hq * D, D, bl.pack, rows, D);
    for (int64_t r = 0; r < m; ++r) {
      const int64_t g = r / rows, i = r % rows;
      delta[r] = dot<T>(dop.data() + r * D, o + ((b * T_ + s0 + i) * Hq + h0 + g) * D, D);
    }
    for (int64_t c0 = 0; c0 < keys; c0 += BC) {
      const int64_t cols = std::min(BC, keys - c0);
      // P = exp(scale q kᵀ - lse) on the visible keys, 0 beyond the diagonal.
      gemm(false, true, m, cols, D, sc, qp.data(), D, K.at(b, hk, c0), K.st, 0.f, p.data(),
           cols);
      T* P = operand_buffer<T>(p, pb);
      for (int64_t r = 0; r < m; ++r) {
        const int64_t g = r / rows, i = r % rows;
        const int64_t n = std::min(cols, s0 + i + 1 - c0);
        exp_row<T>(p.data() + r * cols, n, cols, l[(b * Hq + h0 + g) * T_ + s0 + i],
                   P + r * cols);
      }
      gemm(true, false, cols, D, m, 1.f, P, cols, dop.data(), D, 1.f, dv_acc + c0 * D, D);
      gemm(false, true, m, cols, D, 1.f, dop.data(), D, V.at(b, hk, c0), V.st, 0.f, dp.data(),
           cols);
      // dS = P * (dP - rowsum(dO * O)) * scale.
      T* dS = operand_buffer<T>(dp, dsb);
      for (int64_t r = 0; r < m; ++r) {
        ds_row<T>(p.data() + r * cols, dp.data() + r * cols, cols, delta[r], sc, dS + r * cols);
      }
      gemm(false, false, m, D, cols, 1.f, dS, cols, K.at(b, hk, c0), K.st, c0 > 0 ? 1.f : 0.f,
           dq_acc.data(), D);
      gemm(true, false, cols, D, m, 1.f, dS, cols, qp.data(), D, 1.f, dk_acc + c0 * D, D);
    }
    for (int64_t r = 0; r < m; ++r) {
      const int64_t g = r / rows, i = r % rows;
      store_row<T>(dq + ((b * T_ + s0 + i) * Hq + h0 + g) * D, dq_acc.data() + r * D, D);
    }
  }
}

template <typename T>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, float sc,
                   at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const int64_t B = q.size(0), Hq = q.size(1), T_ = q.size(2), D = q.size(3), Hk = k.size(1);
  const int64_t G = Hq / Hk;
  const Blocking bl = blocking(T_, G);
  const View<T> Q(q), K(k), V(v);
  const T* go = dout.const_data_ptr<T>();
  const T* o = out.const_data_ptr<T>();
  const float* l = lse.const_data_ptr<float>();
  T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dv.data_ptr<T>();
  // One task per (batch, kv head, head pack, part): a part takes every parts-th row block and
  // sums dK/dV into its own fp32 accumulator, so no two threads write the same rows. Parts > 1
  // only where there are fewer (batch, kv head, pack) triples than threads can share (a batch
  // of one, few kv heads); the parts' accumulators are summed afterwards.
  const int64_t threads = at::get_num_threads(), heads = B * Hk * bl.packs;
  const int64_t blocks = (T_ + bl.br - 1) / bl.br;
  const int64_t parts =
      heads < 2 * threads ? std::min(blocks, (2 * threads + heads - 1) / heads) : 1;
  const int64_t per_kv = bl.packs * parts;  // accumulators per kv head
  auto acc = at::zeros({B * Hk * per_kv, 2, T_, D}, q.options().dtype(at::kFloat));
  float* accp = acc.data_ptr<float>();
  deal(B * Hk * per_kv, [&](int64_t task) {
    const int64_t part = task % parts, pk = task / parts % bl.packs;
    const int64_t hk = task / per_kv % Hk, b = task / per_kv / Hk;
    float* dk_acc = accp + task * 2 * T_ * D;
    backward_rows<T>(b, hk * G + pk * bl.pack, hk, part, parts, bl, Q, K, V, go, o, l, dqp,
                     dk_acc, dk_acc + T_ * D, T_, Hq, D, sc);
  });
  // Sum the accumulators of each kv head and write dK/dV rows in the (B, T, Hk, D) layout.
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hk, hk = task % Hk;
      float* first = accp + task * per_kv * 2 * T_ * D;
      for (int64_t j = 1; j < per_kv; ++j) {
        const float* other = first + j * 2 * T_ * D;
        at::vec::map2([](fVec a, fVec c) { return a + c; }, first, first, other, 2 * T_ * D);
      }
      for (int64_t t = 0; t < T_; ++t) {
        const int64_t row = ((b * T_ + t) * Hk + hk) * D;
        store_row<T>(dkp + row, first + t * D, D);
        store_row<T>(dvp + row, first + (T_ + t) * D, D);
      }
    }
  });
}

}  // namespace

bool attention_available() { return blas_ready(); }
bool attention_bf16_available() { return blas_ready() && bf16_blas_ready(); }

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, double scale) {
  check_inputs(q, k, v);
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  auto out = at::empty({B, T, Hq, D}, q.options());
  auto lse = at::empty({B, Hq, T}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kFloat) {
    forward_impl<float>(q, k, v, static_cast<float>(scale), out, lse);
  } else {
    forward_impl<at::BFloat16>(q, k, v, static_cast<float>(scale), out, lse);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale) {
  check_inputs(q, k, v);
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hk = k.size(1);
  TORCH_CHECK(dout.is_contiguous() && out.is_contiguous() && dout.sizes() == out.sizes() &&
                  out.sizes() == at::IntArrayRef({B, T, Hq, D}) &&
                  dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "attention backward: dout and out must be contiguous (B, T, Hq, D) in q's dtype");
  TORCH_CHECK(lse.is_contiguous() && lse.sizes() == at::IntArrayRef({B, Hq, T}) &&
                  lse.scalar_type() == at::kFloat,
              "attention backward: lse must be contiguous fp32 (B, Hq, T)");
  // Layouts as the forward's output: (B, T, H, D), returned as (B, H, T, D) views.
  auto dq = at::empty({B, T, Hq, D}, q.options());
  auto dk = at::empty({B, T, Hk, D}, q.options());
  auto dv = at::empty({B, T, Hk, D}, q.options());
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    backward_impl<float>(dout, q, k, v, out, lse, sc, dq, dk, dv);
  } else {
    backward_impl<at::BFloat16>(dout, q, k, v, out, lse, sc, dq, dk, dv);
  }
  return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)};
}

}  // namespace lorafuse
