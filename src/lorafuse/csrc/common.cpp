// The matmul dtype policy shared by the kernels (see common.h) and small checks.
#include "common.h"

#include <ATen/native/CPUBlas.h>
#include <dlfcn.h>

#include <atomic>
#include <climits>

namespace lorafuse {

namespace {
// Defaults are the safe answer for a CPU without bf16/fp16 matrix units; load_cpp overrides.
std::atomic<bool> g_native_bf16{false};
std::atomic<bool> g_native_fp16{false};
std::atomic<bool> g_dynamic_schedule{true};
}  // namespace

void set_dynamic_schedule(bool on) { g_dynamic_schedule.store(on); }

bool dynamic_schedule() { return g_dynamic_schedule.load(std::memory_order_relaxed); }

void set_native_low_precision(bool bf16, bool fp16) {
  g_native_bf16.store(bf16);
  g_native_fp16.store(fp16);
}

std::tuple<bool, bool> native_low_precision() {
  return {g_native_bf16.load(), g_native_fp16.load()};
}

at::ScalarType matmul_dtype(at::ScalarType t) {
  if (t == at::kBFloat16 && !g_native_bf16.load()) return at::kFloat;
  if (t == at::kHalf && !g_native_fp16.load()) return at::kFloat;
  return t;
}

void* torch_cpu_symbol(const char* name) {
  Dl_info info;  // the library that defines at::mm is libtorch_cpu
  if (!dladdr(reinterpret_cast<void*>(&at::_ops::mm::call), &info) || !info.dli_fname) {
    return nullptr;
  }
  void* torch_cpu = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!torch_cpu) return nullptr;
  void* fn = dlsym(torch_cpu, name);
  dlclose(torch_cpu);  // only drops the reference RTLD_NOLOAD added
  return fn;
}

namespace {
// cblas_gemm_bf16bf16f32(layout, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc),
// MKL_INT = int (torch links MKL's LP64 interface).
using MklGemmBf16 = void (*)(int, int, int, int, int, int, float, const void*, int, const void*,
                             int, float, float*, int);
constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112;
MklGemmBf16 g_mkl_gemm_bf16 = nullptr;

void call_bf16_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                    const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t ldb,
                    float beta, float* c, int64_t ldc) {
  for (const int64_t v : {m, n, k, lda, ldb, ldc}) {
    TORCH_CHECK(v <= INT_MAX, "bf16_gemm: a size or leading dimension of ", v,
                " exceeds MKL's 32-bit int");
  }
  g_mkl_gemm_bf16(kCblasRowMajor, ta ? kCblasTrans : kCblasNoTrans,
                  tb ? kCblasTrans : kCblasNoTrans, static_cast<int>(m), static_cast<int>(n),
                  static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb),
                  beta, c, static_cast<int>(ldc));
}

// [[1,2,3],[4,5,6]] · [[1,0],[0,1],[1,1]] plain and from transposed operands into C = 1 (beta 1),
// so a wrong calling convention fails here rather than in a kernel; and (1 + 2^-7)^2 =
// 1 + 2^-6 + 2^-14, which only an fp32 (not a bf16-rounded) product and sum returns.
bool bf16_gemm_works() {
  using B = at::BFloat16;
  const B a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1};
  const B at_[6] = {1, 4, 2, 5, 3, 6}, bt[6] = {1, 0, 1, 0, 1, 1};  // aᵀ (3x2), bᵀ (2x3)
  float c[4] = {0, 0, 0, 0}, d[4] = {1, 1, 1, 1};
  call_bf16_gemm(false, false, 2, 2, 3, 1.f, a, 3, b, 2, 0.f, c, 2);
  call_bf16_gemm(true, true, 2, 2, 3, 1.f, at_, 2, bt, 3, 1.f, d, 2);
  const B e = 1.f + 0x1p-7f;
  float f = 0.f;
  call_bf16_gemm(false, false, 1, 1, 1, 1.f, &e, 1, &e, 1, 0.f, &f, 1);
  return c[0] == 4 && c[1] == 5 && c[2] == 10 && c[3] == 11 && d[0] == 5 && d[1] == 6 &&
         d[2] == 11 && d[3] == 12 && f == 1.f + 0x1p-6f + 0x1p-14f;
}
}  // namespace

namespace {
// Fortran sgemm_ / dgemm_ (column-major, 32-bit ints) of the BLAS torch links (MKL or OpenBLAS).
template <typename S>
using FortranGemm = void (*)(const char*, const char*, const int*, const int*, const int*,
                             const S*, const S*, const int*, const S*, const int*, const S*, S*,
                             const int*);
FortranGemm<float> g_sgemm = nullptr;
FortranGemm<double> g_dgemm = nullptr;

// Row-major C (m x n) = alpha·op(A)·op(B) + beta·C: column-major BLAS sees each row-major matrix
// transposed, so it computes Cᵀ = op(B)ᵀ·op(A)ᵀ.
template <typename S>
void call_blas_gemm(FortranGemm<S> fn, bool ta, bool tb, int64_t m, int64_t n, int64_t k, S alpha,
                    const S* a, int64_t lda, const S* b, int64_t ldb, S beta, S* c, int64_t ldc) {
  for (const int64_t v : {m, n, k, lda, ldb, ldc}) {
    TORCH_CHECK(v <= INT_MAX, "blas_gemm: a size or leading dimension of ", v,
                " exceeds BLAS's 32-bit int");
  }
  const char opa = tb ? 'T' : 'N', opb = ta ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int LA = static_cast<int>(ldb), LB = static_cast<int>(lda), LC = static_cast<int>(ldc);
  fn(&opa, &opb, &M, &N, &K, &alpha, b, &LA, a, &LB, &beta, c, &LC);
}

// [[1,2,3],[4,5,6]] · [[1,0],[0,1],[1,1]] plain and from transposed operands into C = 1 (beta 1):
// a wrong calling convention fails here instead of producing wrong results in a kernel.
template <typename S>
bool blas_gemm_works(FortranGemm<S> fn) {
  const S a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1};
  const S at_[6] = {1, 4, 2, 5, 3, 6}, bt[6] = {1, 0, 1, 0, 1, 1};  // aᵀ (3x2), bᵀ (2x3)
  S c[4] = {0, 0, 0, 0}, d[4] = {1, 1, 1, 1};
  call_blas_gemm<S>(fn, false, false, 2, 2, 3, 1, a, 3, b, 2, 0, c, 2);
  call_blas_gemm<S>(fn, true, true, 2, 2, 3, 1, at_, 2, bt, 3, 1, d, 2);
  return c[0] == 4 && c[1] == 5 && c[2] == 10 && c[3] == 11 && d[0] == 5 && d[1] == 6 &&
         d[2] == 11 && d[3] == 12;
}
}  // namespace

bool blas_gemm_available() {
  static const bool ok = [] {  // thread-safe one-time lookup and self-test
    auto s = reinterpret_cast<FortranGemm<float>>(torch_cpu_symbol("sgemm_"));
    auto d = reinterpret_cast<FortranGemm<double>>(torch_cpu_symbol("dgemm_"));
    if (!s || !d || !blas_gemm_works(s) || !blas_gemm_works(d)) return false;
    g_sgemm = s;
    g_dgemm = d;
    return true;
  }();
  return ok;
}

void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  TORCH_CHECK(blas_gemm_available(), "blas_gemm: this torch build exports no usable sgemm_");
  call_blas_gemm(g_sgemm, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
               int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  TORCH_CHECK(blas_gemm_available(), "blas_gemm: this torch build exports no usable dgemm_");
  call_blas_gemm(g_dgemm, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

bool onednn_packs_bf16() {
  static const bool packs = at::native::cpublas::could_pack(at::kBFloat16);
  return packs;
}

bool bf16_gemm_available() {
  static const bool ok = [] {  // thread-safe one-time lookup and self-test
    g_mkl_gemm_bf16 = reinterpret_cast<MklGemmBf16>(torch_cpu_symbol("cblas_gemm_bf16bf16f32"));
    if (g_mkl_gemm_bf16 && bf16_gemm_works()) return true;
    g_mkl_gemm_bf16 = nullptr;
    return false;
  }();
  return ok;
}

void bf16_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
               const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t ldb,
               float beta, float* c, int64_t ldc) {
  TORCH_CHECK(bf16_gemm_available(),
              "bf16_gemm: this torch build exports no usable cblas_gemm_bf16bf16f32 (MKL)");
  call_bf16_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void check_2d(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
}

}  // namespace lorafuse
