// The bf16 products the C++ kernels can call, timed alone on one thread (bf16_products.py beside it):
// BLAS sgemm on fp32 copies, MKL's cblas_gemm_bf16bf16f32, and oneDNN's brgemm micro-kernel on a
// B operand in the VNNI layout (K row pairs interleaved), as attention_products.h calls them.
// Row-major C (m x n) fp32 = A (m x k) · B (k x n); all operands contiguous.
#include <ATen/native/CPUBlas.h>
#include <dlfcn.h>
#include <torch/extension.h>

#include <chrono>

namespace {

using bf16 = at::BFloat16;
using MklGemmBf16 = void (*)(int, int, int, int, int, int, float, const bf16*, int, const bf16*,
                             int, float, float*, int);
using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                       const float*, const int*, const float*, const int*, const float*, float*,
                       const int*);

template <typename T>
T symbol(const char* name) {
  return reinterpret_cast<T>(dlsym(RTLD_DEFAULT, name));
}

}  // namespace

bool available(const std::string& which) {
  if (which == "mkl") return symbol<MklGemmBf16>("cblas_gemm_bf16bf16f32") != nullptr;
  if (which == "sgemm") return symbol<Sgemm>("sgemm_") != nullptr;
  return which == "brgemm";
}

// Seconds per call (mean of `reps` calls) of `which` on a (m x k), b (k x n) bf16, and its result.
// b_vnni is b in the VNNI layout by panels of w = min(n, 64) columns (n / w x k/2 x w x 2); af, bf
// are a and b in fp32 (for sgemm).
std::tuple<double, at::Tensor> run(const std::string& which, const at::Tensor& a,
                                   const at::Tensor& b, const at::Tensor& b_vnni,
                                   const at::Tensor& af, const at::Tensor& bf, int64_t reps) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  TORCH_CHECK(available(which), which, ": not in this torch build");
  at::Tensor c = at::zeros({m, n});
  float* cp = c.data_ptr<float>();
  const auto mkl = symbol<MklGemmBf16>("cblas_gemm_bf16bf16f32");  // looked up once, not timed
  const auto sgemm = symbol<Sgemm>("sgemm_");
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r) {
    if (which == "mkl") {  // CblasRowMajor = 101, CblasNoTrans = 111
      mkl(101, 111, 111, m, n, k, 1.f, a.const_data_ptr<bf16>(), k, b.const_data_ptr<bf16>(), n,
          0.f, cp, n);
    } else if (which == "brgemm") {  // by panels of up to 64 columns, as the kernel calls it
      const int64_t w = std::min<int64_t>(n, 64);
      for (int64_t j = 0; j < n; j += w) {
        at::native::cpublas::brgemm(m, w, k, k, w, n, false, a.const_data_ptr<bf16>(),
                                    b_vnni.const_data_ptr<bf16>() + j * k, cp + j);
      }
    } else {  // column-major sgemm sees the row-major operands transposed: Cᵀ = Bᵀ·Aᵀ
      const char N = 'N';
      const int M = n, NN = m, K = k;
      const float one = 1.f, zero = 0.f;
      sgemm(&N, &N, &M, &NN, &K, &one, bf.const_data_ptr<float>(), &M, af.const_data_ptr<float>(),
            &K, &zero, cp, &M);
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (which == "brgemm") at::native::cpublas::brgemm_release();
  return {s / reps, c};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available);
  m.def("run", &run);
  m.def("could_pack", [] { return at::native::cpublas::could_pack(at::kBFloat16); });
}
