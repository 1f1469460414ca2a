// A frozen-weight GEMM built on the brgemm micro-kernel torch exports (at::native::cpublas), for
// benchmarks/probes/gemm_epilogue.py only: can a GEMM of our own, whose epilogue could then fuse
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
#include <ATen/cpu/vec/vec.h>
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

namespace {

// bf16 rounding (RNE) of 16 floats, returned as floats.
__m512 rounded(__m512 v) {
  const __m256bh b = _mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(b)), 16));
}

void store_bf16(bf16* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

}  // namespace

// The MLP's up half in one kernel, as a fused epilogue would run it: gate = round(round(x·Wgᵀ)
// + s·xa_g·Bgᵀ), up likewise, h = round(silu(gate)·up): the roundings of stock PEFT's bf16
// linears with fp32 adapters followed by SwiGLU. xa (M, 2r) fp32 = [xa_g | xa_u]; BgT, BuT (r, I)
// fp32. Returns gate, up, h (M, I) bf16; tasks (row block, 64-column panel) dealt. For timing
// the parts, skip = 1 leaves out the rank-r terms, 2 the sigmoid too (the outputs are then wrong).
std::vector<at::Tensor> gate_up_swiglu(const at::Tensor& x, const at::Tensor& packed_g,
                                       const at::Tensor& packed_u, const at::Tensor& xa,
                                       const at::Tensor& BgT, const at::Tensor& BuT, double s,
                                       int64_t mb, int64_t skip) {
  const int64_t M = x.size(0), K = x.size(1), I = BgT.size(1), r = BgT.size(0);
  TORCH_CHECK(I % NP == 0 && M % 4 == 0 && mb % 4 == 0 && xa.size(1) == 2 * r &&
                  xa.is_contiguous() && BgT.is_contiguous() && BuT.is_contiguous(),
              "gate_up_swiglu: bad shapes");
  at::Tensor gate = at::empty({M, I}, x.options()), up = at::empty_like(gate),
             h = at::empty_like(gate);
  const bf16* a = x.const_data_ptr<bf16>();
  const bf16 *pg = packed_g.const_data_ptr<bf16>(), *pu = packed_u.const_data_ptr<bf16>();
  const float *xs = xa.const_data_ptr<float>(), *bg = BgT.const_data_ptr<float>(),
              *bu = BuT.const_data_ptr<float>();
  bf16 *go = gate.mutable_data_ptr<bf16>(), *uo = up.mutable_data_ptr<bf16>(),
       *ho = h.mutable_data_ptr<bf16>();
  const int64_t row_blocks = (M + mb - 1) / mb, tasks = row_blocks * (I / NP);
  const __m512 sv = _mm512_set1_ps(static_cast<float>(s)), one = _mm512_set1_ps(1.f);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> acc_g(mb * NP), acc_u(mb * NP);
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
      const int64_t p = t / row_blocks, r0 = (t % row_blocks) * mb, m = std::min(mb, M - r0);
      cpublas::brgemm(m, NP, K, K, NP, NP, false, a + r0 * K, pg + p * NP * K, acc_g.data());
      cpublas::brgemm(m, NP, K, K, NP, NP, false, a + r0 * K, pu + p * NP * K, acc_u.data());
      // The rank-r terms register-blocked: 4 rows x 2 column vectors of gate and of up, so each
      // loaded vector of Bᵀ serves 4 rows and each broadcast xa value 2 vectors (m % 4 == 0).
      constexpr int R = 4, C = 2;
      for (int64_t i = 0; i < m; i += R) {
        for (int64_t c = 0; c < NP; c += 16 * C) {
          __m512 lg[R][C], lu[R][C];
          for (int q = 0; q < R; ++q) {
            for (int v = 0; v < C; ++v) lg[q][v] = lu[q][v] = _mm512_setzero_ps();
          }
          const float *bgc = bg + p * NP + c, *buc = bu + p * NP + c;
          for (int64_t k = 0; k < (skip > 0 ? 0 : r); ++k) {
            __m512 vg[C], vu[C];
            for (int v = 0; v < C; ++v) {
              vg[v] = _mm512_loadu_ps(bgc + k * I + 16 * v);
              vu[v] = _mm512_loadu_ps(buc + k * I + 16 * v);
            }
            for (int q = 0; q < R; ++q) {
              const float* xq = xs + (r0 + i + q) * 2 * r;
              const __m512 xg = _mm512_set1_ps(xq[k]), xu = _mm512_set1_ps(xq[r + k]);
              for (int v = 0; v < C; ++v) {
                lg[q][v] = _mm512_fmadd_ps(xg, vg[v], lg[q][v]);
                lu[q][v] = _mm512_fmadd_ps(xu, vu[v], lu[q][v]);
              }
            }
          }
          for (int q = 0; q < R; ++q) {
            for (int v = 0; v < C; ++v) {
              const int64_t at_ = (i + q) * NP + c + 16 * v;
              const int64_t off = (r0 + i + q) * I + p * NP + c + 16 * v;
              // round(round(product) + s·term): the base linear rounds before the LoRA add
              const __m512 g0 = rounded(_mm512_loadu_ps(&acc_g[at_]));
              const __m512 u0 = rounded(_mm512_loadu_ps(&acc_u[at_]));
              const __m512 g = rounded(_mm512_fmadd_ps(lg[q][v], sv, g0));
              const __m512 u = rounded(_mm512_fmadd_ps(lu[q][v], sv, u0));
              const at::vec::Vectorized<float> neg(_mm512_sub_ps(_mm512_setzero_ps(), g));
              const __m512 sig =
                  skip > 1 ? one : _mm512_div_ps(one, _mm512_add_ps(one, neg.exp_u20()));
              store_bf16(go + off, g);
              store_bf16(uo + off, u);
              store_bf16(ho + off, _mm512_mul_ps(_mm512_mul_ps(g, sig), u));
            }
          }
        }
      }
    }
    cpublas::brgemm_release();
  });
  return {gate, up, h};
}

bool available() { return cpublas::could_pack(at::kBFloat16); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "Whether torch's oneDNN packs bf16 for brgemm (AMX)");
  m.def("pack_wt", &pack_wt);
  m.def("gemm", &gemm);
  m.def("gate_up_swiglu", &gate_up_swiglu);
}
