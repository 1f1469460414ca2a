// The products of the causal attention kernel (attention.cpp, its only includer: definitions in
// an anonymous namespace). Two sets with one interface, chosen explicitly by attention.cpp:
// * BlasProducts: the operands as stored. fp32 -> BLAS sgemm; bf16 -> MKL's gemm_bf16bf16f32
//   (common.h's bf16_gemm: bf16 operands, fp32 accumulation), which packs both operands again on
//   every call.
// * BrgemmProducts (bf16 where oneDNN has a bf16 micro-kernel, AMX or AVX-512-BF16, and
//   D % 16 == 0): oneDNN's brgemm micro-kernel as torch exports it (at::native::cpublas), the one
//   torch's own CPU flash kernel runs, on K and V packed once per (batch, kv head) into its VNNI
//   layout.
#pragma once

#include <ATen/native/CPUBlas.h>

#include <cstring>
#include <new>
#include <vector>

#include "common.h"

namespace lorafuse {
namespace {

constexpr int64_t BC = 512;  // keys per block: the M x BC fp32 scratches stay in L2

// Scratch whose rows start on cache lines (BC and D rows are whole lines apart): malloc's 16-byte
// alignment splits every AVX-512 load and store of the softmax passes over two lines.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using Scratch = std::vector<T, CacheLineAllocator<T>>;

// fp32 products: the BLAS sgemm torch links (common.h's blas_gemm, looked up and self-tested
// there); bf16 products: common.h's bf16_gemm (MKL's cblas_gemm_bf16bf16f32).
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  blas_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// The same contract with bf16 operands and an fp32 C.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const at::BFloat16* a,
          int64_t lda, const at::BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  LORAFUSE_PROFILE_RANGE("attention_mkl_bf16_gemm");
  bf16_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

bool blas_ready() { return blas_gemm_available(); }

// ---- oneDNN brgemm (bf16 operands, fp32 C) ------------------------------------------------------
// cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C): C (M x N, ldc) [+]= A (M x K row-major,
// lda) · B, with B in the VNNI layout: K row pairs interleaved, (K/2, N, 2), N <= 64 columns a call
// (ldb = N). cpublas::pack writes that layout from a row-major K x N panel (N of 16, 32, 48 or 64).
namespace cpublas = at::native::cpublas;
using bf16 = at::BFloat16;
constexpr int64_t NP = 64;  // columns per packed panel (oneDNN's widest)
static_assert(BC % NP == 0, "a key block is whole packed panels (and whole vectors)");

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// out (k/2 x n x 2) = the VNNI layout of in (k x n, row stride ld), k even: rows 2i and 2i + 1
// interleaved element by element (on AVX-512, 32 columns by two two-source permutes).
void pack_vnni(int64_t k, int64_t n, int64_t ld, const bf16* in, bf16* out) {
#if defined(CPU_CAPABILITY_AVX512)
  // Output element 2t takes r0[t], 2t + 1 takes r1[t] (index bit 5 picks the second source).
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38,
                                               7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13,
                                               45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
                                               22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59,
                                               28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
#endif
  for (int64_t i = 0; i < k; i += 2) {
    const bf16 *r0 = in + i * ld, *r1 = r0 + ld;
    bf16* o = out + i * n;
    int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512)
    for (; j + 32 <= n; j += 32) {
      const __m512i a = _mm512_loadu_si512(r0 + j), b = _mm512_loadu_si512(r1 + j);
      _mm512_storeu_si512(o + 2 * j, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(o + 2 * j + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
#endif
    for (; j < n; ++j) o[2 * j] = r0[j], o[2 * j + 1] = r1[j];
  }
}

// oneDNN packs where it can (AMX). Elsewhere, on AVX-512-BF16 CPUs, its micro-kernel still
// multiplies VNNI-laid-out operands (VDPBF16PS) and only the packing is ours: 217-230 GFLOP/s at
// the kernel's shapes against 87-93 for MKL's bf16 GEMM, which there runs no faster than sgemm
// (96) (`python benchmarks/probes/bf16_products.py`, 1 thread, 2-core AMD EPYC; brgemm_works
// checks the layout on every machine before it is used).
void pack_panel(int64_t k, int64_t n, int64_t ld, const bf16* in, bf16* out) {
  if (onednn_packs_bf16()) {
    cpublas::pack(k, n, ld, n, at::kBFloat16, at::kBFloat16, in, out);
  } else {
    pack_vnni(k, n, ld, in, out);
  }
}

// dst (cols x rows, ld_dst) = src (rows x cols, ld_src)ᵀ, by ATen's 32 x 32 bf16 tiles.
void transpose(const bf16* src, int64_t ld_src, int64_t rows, int64_t cols, bf16* dst,
               int64_t ld_dst) {
  for (int64_t i = 0; i < rows; i += 32) {
    for (int64_t j = 0; j < cols; j += 32) {
      at::vec::transpose_mxn<bf16>(src + i * ld_src + j, ld_src, dst + j * ld_dst + i, ld_dst,
                                   static_cast<int>(std::min<int64_t>(32, rows - i)),
                                   static_cast<int>(std::min<int64_t>(32, cols - j)));
    }
  }
}

// x (rows x D, row stride st) as brgemm's B = xᵀ (K = D): panels of NP rows of x, each a packed
// D x NP, panel p at out + p·NP·D (so key c0 starts at out + c0·D); keys past `rows` are zero.
// tmp: NP·D scratch.
void pack_transposed(const bf16* x, int64_t st, int64_t rows, int64_t D, bf16* out, bf16* tmp) {
  for (int64_t p0 = 0; p0 < rows; p0 += NP) {
    const int64_t n = std::min(NP, rows - p0);
    if (n < NP) std::fill(tmp, tmp + D * NP, bf16(0.f));
    transpose(x + p0 * st, st, n, D, tmp, NP);
    pack_panel(D, NP, NP, tmp, out + p0 * D);
  }
}

// x (rows x D, row stride st) as brgemm's B = x (K = rows): column panels of up to NP, panel j0
// at out + j0·R with R = round_up(rows, NP) packed rows (row r0 of panel j0 of width w starts at
// out + j0·R + r0·w); rows past `rows` are zero. tmp: NP·D scratch.
void pack_rows(const bf16* x, int64_t st, int64_t rows, int64_t D, bf16* out, bf16* tmp) {
  const int64_t R = round_up(rows, NP);
  for (int64_t r0 = 0; r0 < rows; r0 += NP) {
    const int64_t n = std::min(NP, rows - r0);
    const bf16* src = x + r0 * st;
    int64_t ld = st;
    if (n < NP) {  // the ragged end as a zero-padded copy: every pack is NP rows (an even K)
      std::fill(tmp, tmp + NP * D, bf16(0.f));
      for (int64_t i = 0; i < n; ++i) std::memcpy(tmp + i * D, src + i * st, D * sizeof(bf16));
      src = tmp, ld = D;
    }
    for (int64_t j0 = 0; j0 < D; j0 += NP) {
      const int64_t w = std::min(NP, D - j0);
      pack_panel(NP, w, ld, src + j0, out + j0 * R + r0 * w);
    }
  }
}

// Self-test of the packing and the calling convention on small integers (exact in bf16 and in
// fp32 sums): x (3 x 16), x[i][j] = 16 i + j - 20; q·xᵀ (1 x 64) and a·x (1 x 16) with K padded.
bool brgemm_works() {
  constexpr int64_t D = 16;
  bf16 x[3 * D], q[D], a[4] = {1.f, -2.f, 3.f, 0.f}, tmp[NP * D], kt[NP * D], xr[NP * D];
  for (int64_t i = 0; i < 3 * D; ++i) x[i] = static_cast<float>(i - 20);
  for (int64_t j = 0; j < D; ++j) q[j] = static_cast<float>(j % 3 - 1);
  pack_transposed(x, D, 3, D, kt, tmp);
  pack_rows(x, D, 3, D, xr, tmp);
  float s[NP], y[D];
  cpublas::brgemm(1, NP, D, D, NP, NP, false, q, kt, s);
  cpublas::brgemm(1, D, 4, 4, D, D, false, a, xr, y);
  cpublas::brgemm_release();
  bool ok = true;
  for (int64_t i = 0; i < NP; ++i) {
    float want = 0.f;
    for (int64_t j = 0; i < 3 && j < D; ++j) want += float(q[j]) * float(x[i * D + j]);
    ok = ok && s[i] == want;
  }
  for (int64_t j = 0; j < D; ++j) {
    ok = ok && y[j] == float(x[j]) - 2.f * float(x[D + j]) + 3.f * float(x[2 * D + j]);
  }
  return ok;
}

// Whether the brgemm products run here: the packed panels fit D, and oneDNN has a bf16
// micro-kernel for this CPU (AMX or AVX-512-BF16) that reads the VNNI layout. brgemm_works tells:
// elsewhere, or where mkldnn is disabled, cpublas::brgemm falls back to a plain GEMM that
// misreads the layout, and the self-test fails.
bool use_brgemm(int64_t D) {
  if (D % 16 != 0) return false;
  static const bool works = [] {
    // torch 2.13 raises where oneDNN has no bf16 micro-kernel ("BFloat16 Brgemm VNNI format is
    // only supported on X64 when oneDNN ukernel is enabled and `amx` is supported": AVX2 CPUs)
    // instead of falling back: no brgemm there, the MKL products run
    try {
      return brgemm_works();
    } catch (const std::exception&) {
      return false;
    }
  }();
  return works;
}

template <typename T>
struct View {  // a (B, H, T, D) tensor with unit stride on D
  const T* p;
  int64_t sb, sh, st;
  explicit View(const at::Tensor& t)
      : p(t.const_data_ptr<T>()), sb(t.stride(0)), sh(t.stride(1)), st(t.stride(2)) {}
  const T* at(int64_t b, int64_t h, int64_t t) const { return p + b * sb + h * sh + t * st; }
};

// n fp32 values -> T (round to nearest even, as tensor.to(T)); a plain copy for fp32.
template <typename T>
void store_row(T* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    round_row_bf16(src, dst, n);
  }
}

// ---- the products of one (batch, kv head) ------------------------------------------------------
// Score-like results (S = q kᵀ, dP = dO vᵀ) are m x width(cols) fp32 rows of stride BC; operands
// P and dS are m x width(cols) rows of stride BC in T (zero past the visible keys); dQ and the
// forward's accumulator are m x D row-major; dK/dV accumulate acc_rows(T)·D values per kv head in
// the products' own layout, which store_acc reads.

// The operands as stored, through BLAS (fp32) or MKL's bf16 GEMM.
template <typename T>
struct BlasProducts {
  using Scalar = T;  // storage of q, k, v, out and the gradients
  View<T> K, V;
  float scale;
  BlasProducts(const at::Tensor& k, const at::Tensor& v, float scale, bool /*backward*/)
      : K(k), V(v), scale(scale) {}
  float score_scale() const { return 1.f; }  // the product applies it (alpha)
  int64_t width(int64_t cols) const { return cols; }
  int64_t acc_rows(int64_t T_) const { return T_; }
  void scores(int64_t b, int64_t hk, int64_t m, int64_t c0, int64_t cols, const T* qp, int64_t D,
              float* s) const {
    gemm(false, true, m, cols, D, scale, qp, D, K.at(b, hk, c0), K.st, 0.f, s, BC);
  }
  void pv(int64_t b, int64_t hk, int64_t m, int64_t c0, int64_t cols, const T* p, int64_t D,
          float* acc) const {
    gemm(false, false, m, D, cols, 1.f, p, BC, V.at(b, hk, c0), V.st, c0 > 0 ? 1.f : 0.f, acc, D);
  }
  void rows(int64_t /*m*/, const T* /*qp*/, const T* /*dop*/, int64_t /*D*/) const {}
  void dp(int64_t b, int64_t hk, int64_t m, int64_t c0, int64_t cols, const T* dop, int64_t D,
          float* out) const {
    gemm(false, true, m, cols, D, 1.f, dop, D, V.at(b, hk, c0), V.st, 0.f, out, BC);
  }
  // dV += Pᵀ·dO (dK += dSᵀ·Q: the same with dS and the stacked queries); acc is T x D.
  void transposed_acc(int64_t m, int64_t c0, int64_t cols, T* p, const T* x, int64_t D,
                      float* acc, bool /*queries*/) const {
    gemm(true, false, cols, D, m, 1.f, p, BC, x, D, 1.f, acc + c0 * D, D);
  }
  // dst rows t < T (row stride ld) = acc rows rounded to T.
  void store_acc(const float* acc, int64_t T_, int64_t D, T* dst, int64_t ld) const {
    for (int64_t t = 0; t < T_; ++t) store_row<T>(dst + t * ld, acc + t * D, D);
  }
  void dq(int64_t b, int64_t hk, int64_t m, int64_t c0, int64_t cols, const T* ds, int64_t D,
          float* acc) const {
    gemm(false, false, m, D, cols, 1.f, ds, BC, K.at(b, hk, c0), K.st, c0 > 0 ? 1.f : 0.f, acc,
         D);
  }
  void done() const {}
};

// oneDNN brgemm on operands packed once per call and (batch, kv head): Kᵀ and V (forward), and
// Vᵀ and K (backward), T rounded up to NP keys (zeros past T). Scores come out unscaled (brgemm
// has no alpha): the softmax applies the scale. Key blocks are computed in whole NP-key panels.
struct BrgemmProducts {
  using Scalar = bf16;
  int64_t Hk, T64, D;
  float scale;
  at::Tensor packed;  // (2 or 4, B·Hk, T64·D) bf16, the four below
  const bf16 *kt, *vr;  // Kᵀ (S = Q·Kᵀ), V (P·V)
  const bf16 *vt = nullptr, *kr = nullptr;  // backward: Vᵀ (dP = dO·Vᵀ), K (dQ = dS·K)

  BrgemmProducts(const at::Tensor& k, const at::Tensor& v, float scale, bool backward)
      : Hk(k.size(1)), T64(round_up(k.size(2), NP)), D(k.size(3)), scale(scale) {
    const int64_t B = k.size(0), heads = B * Hk, T = k.size(2);
    packed = at::empty({backward ? 4 : 2, heads, T64 * D}, k.options());
    bf16* base = packed.data_ptr<bf16>();
    const int64_t per = heads * T64 * D;
    kt = base, vr = base + per;
    if (backward) vt = base + 2 * per, kr = base + 3 * per;
    const View<bf16> K(k), V(v);
    at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<bf16> tmp(NP * D);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / Hk, hk = i % Hk, off = i * T64 * D;
        pack_transposed(K.at(b, hk, 0), K.st, T, D, base + off, tmp.data());
        pack_rows(V.at(b, hk, 0), V.st, T, D, base + per + off, tmp.data());
        if (backward) {
          pack_transposed(V.at(b, hk, 0), V.st, T, D, base + 2 * per + off, tmp.data());
          pack_rows(K.at(b, hk, 0), K.st, T, D, base + 3 * per + off, tmp.data());
        }
      }
    });
  }
  float score_scale() const { return scale; }
  int64_t width(int64_t cols) const { return round_up(cols, NP); }  // whole packed key panels
  int64_t acc_rows(int64_t /*T*/) const { return T64; }
  const bf16* head(const bf16* p, int64_t b, int64_t hk) const {
    return p + (b * Hk + hk) * T64 * D;
  }
  // out (m x width(cols)) = x · (packed xᵀ) over keys [c0, c0 + width(cols)).
  void by_transposed(const bf16* packed_t, int64_t m, int64_t c0, int64_t cols, const bf16* x,
                     float* out) const {
    for (int64_t p = 0; p < width(cols); p += NP) {
      cpublas::brgemm(m, NP, D, D, NP, BC, false, x, packed_t + (c0 + p) * D, out + p);
    }
  }
  // acc (m x D) [+]= x (m x width(cols), stride BC) · (packed rows [c0, c0 + width)).
  void by_rows(const bf16* packed_r, int64_t m, int64_t c0, int64_t cols, const bf16* x,
               float* acc) const {
    for (int64_t j0 = 0; j0 < D; j0 += NP) {
      const int64_t w = std::min(NP, D - j0);
      cpublas::brgemm(m, w, width(cols), BC, w, D, c0 > 0, x, packed_r + j0 * T64 + c0 * w,
                      acc + j0);
    }
  }
  void scores(int64_t b, int64_t hk, int64_t m, int64_t c0, int64_t cols, const bf16* qp,
              int64_t /*D*/, float* s) const {
    by_transposed(head(kt, b, hk), m, c0, cols, qp, s);
  }
  void pv(int64_t b, int64_t hk, int64_t m, int64_t c0, int64_t cols, const bf16* p,
          int64_t /*D*/, float* acc) const {
    by_rows(head(vr, b, hk), m, c0, cols, p, acc);
  }
  void dp(int64_t b, int64_t hk, int64_t m, int64_t c0, int64_t cols, const bf16* dop,
          int64_t /*D*/, float* out) const {
    by_transposed(head(vt, b, hk), m, c0, cols, dop, out);
  }
  void dq(int64_t b, int64_t hk, int64_t m, int64_t c0, int64_t cols, const bf16* ds,
          int64_t /*D*/, float* acc) const {
    by_rows(head(kr, b, hk), m, c0, cols, ds, acc);
  }

  // Per row block: the stacked queries and dO transposed (D x m, m even with a zero column), the
  // A operands of dKᵀ and dVᵀ. Thread-local: a row block runs on one thread.
  static Scratch<bf16>& q_t() { thread_local Scratch<bf16> v; return v; }
  static Scratch<bf16>& do_t() { thread_local Scratch<bf16> v; return v; }
  void rows(int64_t m, const bf16* qp, const bf16* dop, int64_t /*D*/) const {
    const int64_t me = round_up(m, 2);
    for (auto [x, xt] : {std::pair{qp, &q_t()}, std::pair{dop, &do_t()}}) {
      xt->resize(D * me);
      transpose(x, D, m, D, xt->data(), me);
      if (me != m) {
        for (int64_t d = 0; d < D; ++d) (*xt)[d * me + m] = bf16(0.f);
      }
    }
  }
  // accᵀ columns [c0, c0 + width) += xᵀ·p: dVᵀ += dOᵀ·P, dKᵀ += Qᵀ·dS, so that p is brgemm's B,
  // packed by oneDNN (twice as fast as transposing it into an A operand). acc is D x T64; p's
  // row m is zeroed when m is odd (pack pairs rows).
  void transposed_acc(int64_t m, int64_t c0, int64_t cols, bf16* p, const bf16* /*x*/,
                      int64_t /*D*/, float* acc, bool queries) const {
    thread_local Scratch<bf16> packed_p;
    const int64_t w = width(cols), me = round_up(m, 2);
    if (me != m) std::fill(p + m * BC, p + m * BC + w, bf16(0.f));
    packed_p.resize(me * BC);
    const bf16* xt = queries ? q_t().data() : do_t().data();
    for (int64_t j = 0; j < w; j += NP) {
      pack_panel(me, NP, BC, p + j, packed_p.data() + j * me);
      cpublas::brgemm(D, NP, me, me, NP, T64, true, xt, packed_p.data() + j * me, acc + c0 + j);
    }
  }
  // dst rows t < T (row stride ld) = accᵀ (D x T64) rounded to bf16: rows rounded, then transposed.
  void store_acc(const float* acc, int64_t T_, int64_t /*D*/, bf16* dst, int64_t ld) const {
    thread_local Scratch<bf16> rounded;
    rounded.resize(D * T64);
    for (int64_t d = 0; d < D; ++d) store_row<bf16>(rounded.data() + d * T64, acc + d * T64, T_);
    transpose(rounded.data(), T64, D, T_, dst, ld);
  }
  void done() const { cpublas::brgemm_release(); }
};

}  // namespace
}  // namespace lorafuse
