// A frozen-weight GEMM built on the brgemm micro-kernel torch exports (at::native::cpublas), for
// benchmarks/bench_gemm_epilogue.py only: can a GEMM of our own, whose epilogue could then fuse
// the passes that follow a projection (the rank-r up-add, SwiGLU), keep up with oneDNN's matmul?
//
// C (M, N) bf16 = A (M, K) bf16 · Wᵀ, W (N, K) the nn.Linear weight. Wᵀ is packed once into
// brgemm's VNNI panels of 64 columns (pack_wt). Tasks = (row block of mb rows, column block of
// cb panels), taken from a shared counter (dealt) or in equal contiguous shares (static). Each
// brgemm writes an mb x 64 fp32 tile; the epilogue then does one of:
//   0 nothing (the products alone), 1 round to bf16 and store into C, 2 round into a per-thread
//   staging row (the rounding without C's stores), 3 round and store into C with non-temporal
//   stores (no read-for-ownership of C's lines).
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <vector>

namespace {

namespace cpublas = at::native::cpublas;
using bf16 = at::BFloat16;
constexpr int64_t NP = 64;  // columns per packed panel

// 64 fp32 values rounded to bf16 (RNE, AVX-512-BF16) into dst.
void round_row(const float* s, bf16* dst, bool stream) {
  for (int64_t q = 0; q < NP; q += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + q + 16), _mm512_loadu_ps(s + q));
    if (stream) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + q), reinterpret_cast<__m512i>(v));
    } else {
      _mm512_storeu_si512(dst + q, reinterpret_cast<__m512i>(v));
    }
  }
}

}  // namespace

// Wᵀ (K, N) row-major (the caller transposes W once) -> packed panels: panel p (K x 64, VNNI)
// at p·64·K.
at::Tensor pack_wt(const at::Tensor& Wt) {
  const int64_t K = Wt.size(0), N = Wt.size(1);
  TORCH_CHECK(Wt.scalar_type() == at::kBFloat16 && Wt.is_contiguous() && N % NP == 0 && K % 2 == 0,
              "pack_wt: Wt must be contiguous bf16 (K, N), N % 64 == 0, K even");
  at::Tensor out = at::empty({N * K}, Wt.options());
  const bf16* w = Wt.const_data_ptr<bf16>();
  bf16* o = out.mutable_data_ptr<bf16>();
  at::parallel_for(0, N / NP, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      cpublas::pack(K, NP, N, NP, at::kBFloat16, at::kBFloat16, w + p * NP, o + p * NP * K);
    }
  });
  return out;
}

at::Tensor gemm(const at::Tensor& A, const at::Tensor& packed, int64_t N, int64_t mb, int64_t cb,
                bool dealt, int64_t epilogue) {
  const int64_t M = A.size(0), K = A.size(1), panels = N / NP;
  TORCH_CHECK(A.scalar_type() == at::kBFloat16 && A.is_contiguous() && N % NP == 0 &&
                  packed.numel() == N * K && epilogue >= 0 && epilogue <= 3,
              "gemm: bad operands or epilogue");
  at::Tensor C = at::empty({M, N}, A.options());
  const bf16* a = A.const_data_ptr<bf16>();
  const bf16* pw = packed.const_data_ptr<bf16>();
  bf16* c = C.mutable_data_ptr<bf16>();
  const int64_t row_blocks = (M + mb - 1) / mb, col_blocks = (panels + cb - 1) / cb;
  const int64_t tasks = row_blocks * col_blocks, threads = at::get_num_threads();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t me, int64_t) {
    std::vector<float> acc(mb * NP);
    std::vector<bf16> stage(NP);
    int64_t mine = me * tasks / threads;
    const int64_t mine_end = (me + 1) * tasks / threads;
    auto take = [&] { return dealt ? next.fetch_add(1) : (mine < mine_end ? mine++ : tasks); };
    for (int64_t t = take(); t < tasks; t = take()) {
      const int64_t j = t / row_blocks, i = t % row_blocks;  // a column block's tasks in a row
      const int64_t r0 = i * mb, m = std::min(mb, M - r0);
      for (int64_t p = j * cb; p < std::min((j + 1) * cb, panels); ++p) {
        cpublas::brgemm(m, NP, K, K, NP, NP, false, a + r0 * K, pw + p * NP * K, acc.data());
        if (epilogue == 0) continue;
        for (int64_t r = 0; r < m; ++r) {
          bf16* dst = epilogue == 2 ? stage.data() : c + (r0 + r) * N + p * NP;
          round_row(acc.data() + r * NP, dst, epilogue == 3);
        }
      }
    }
    cpublas::brgemm_release();
  });
  if (epilogue == 3) _mm_sfence();
  return C;
}

bool available() { return cpublas::could_pack(at::kBFloat16); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "Whether torch's oneDNN packs bf16 for brgemm (AMX)");
  m.def("pack_wt", &pack_wt);
  m.def("gemm", &gemm);
}
