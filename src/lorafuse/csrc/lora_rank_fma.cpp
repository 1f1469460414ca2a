// Register-blocked fp32 FMA kernels for the rank-r LoRA products (lora_rank.cpp chooses them;
// contracts in lora_rank.h). Each runs over the large (N, w) operand once, converting its vectors
// to fp32 in registers (bf16/fp16 -> fp32 is exact), with the fp32 small operand's rows in
// registers or L1, and no fp32 scratch tile of the large operand: the products are the same fp32
// products as the torch expressions, up to summation order.
//
// pass_fma: per block of R rows of big, for each column j (the R values big[row, j] broadcast):
//   rows: out[row, :] += big[row, j]·S[j, :]  (xa = x·Aᵀ, gB = g·B), R·r/kW accumulators;
//   cols: part[j, :] += big[row, j]·small[row, :]  (dB = gᵀ·xa, dA = (xᵀ·gB)ᵀ), small's R rows
//   in registers, one fp32 partial (w, r) per parallel chunk, summed in chunk order at the end.
//   Both at once for rank_grads: each element of g loaded and converted once. r up to 2 vectors
//   (32 on AVX-512, 16 on AVX2: pass_fma_fits); past that lora_rank.cpp keeps the fp32 tiles.
//   Rows go by groups of 64 and columns by ranges whose S rows fill 16 KiB, so that S stays in
//   L1 across a group; the sums are blocked the same way (more accurate than one running sum).
// add_product_fma: per block of 4 rows and 4 (AVX2: 2) vectors of columns, acc = small·St in
// registers (r FMAs per vector), then y = round(y + acc·s): one rounding per element
// (y += s·xa·Bᵀ, dx += gB·A / keep). Every r.
//
// Rows are split into at most get_num_threads() contiguous chunks at multiples of 64 rows, so
// every sum's order depends only on N, r and the thread count, never on timing.
#include <c10/core/GradMode.h>

#include <algorithm>
#include <type_traits>

#include "lora_rank.h"

namespace lorafuse {
namespace {

// Rows per block of a pass: R·NV accumulators (ROWS) and R·NV small-row vectors (COLS), kRowVecs
// per product asked for (twice that for one product), so that they and the temporaries fit the
// 32 (AVX-512) or 16 (AVX2) vector registers.
constexpr int kRowVecs = kW == 16 ? 8 : 4;
template <int NV, bool ROWS, bool COLS>
constexpr int rows_per_block() {
  return std::max(1, (ROWS && COLS ? kRowVecs : 2 * kRowVecs) / NV);
}

// R rows of big's columns [j0, j0 + n) as fp32 into buf (row stride kW), zeros past n; with a
// mask, mask ? x·inv_keep : 0 (dropout(x), as the tiles computed it).
template <typename T, int R>
inline void convert_block(const T* big, const bool* mask, int64_t w, int64_t j0, int64_t n,
                          float inv_keep, float* buf) {
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    const T* src = big + i * w + j0;
    float* dst = buf + i * kW;
    if (mask == nullptr && n == kW) {
      load_f<T>(src).store(dst);
      continue;
    }
    const bool* m = mask == nullptr ? nullptr : mask + i * w + j0;
    for (int64_t jj = 0; jj < n; ++jj) {
      const float v = static_cast<float>(src[jj]);
      dst[jj] = m == nullptr ? v : (m[jj] ? v * inv_keep : 0.f);
    }
    for (int64_t jj = n; jj < kW; ++jj) dst[jj] = 0.f;
  }
}

// One pass's operands: row-major, S and part with w rows rounded up to whole vectors, out and
// small with N rows.
struct Pass {
  int64_t w;
  const bool* mask;
  float inv_keep;
  const float* S;  // (w, r) row product operand, or null
  int64_t lds;
  float* out;  // (N, r) row product result
  int64_t ldo;
  float scale;         // out = scale·(big·S)
  const float* small;  // (N, r) column reduction operand, or null
  int64_t ldm;
};

// Rows [row, row + R) of big, columns [j0, j1): ROWS adds the range's sums big·S (from zero)
// into out's rows (scaled after the last range), COLS adds bigᵀ·small into gpart's rows
// j - j0 (the row group's sums over this range).
template <typename T, int NV, int R, bool ROWS, bool COLS>
void pass_block(const T* big, const Pass& p, float* gpart, int64_t row, int64_t j0, int64_t j1) {
  fVec acc[R][NV], sm[R][NV];
  float* out = ROWS ? p.out + row * p.ldo : nullptr;
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int q = 0; q < NV; ++q) {
      if constexpr (ROWS) acc[i][q] = fVec(0.f);
      if constexpr (COLS) sm[i][q] = fVec::loadu(p.small + (row + i) * p.ldm + q * kW);
    }
  }
  alignas(64) float buf[R * kW];
  const T* b = big + row * p.w;
  const bool* m = p.mask == nullptr ? nullptr : p.mask + row * p.w;
  for (int64_t jb = j0; jb < j1; jb += kW) {
    const int64_t n = std::min<int64_t>(kW, j1 - jb);
    convert_block<T, R>(b, m, p.w, jb, n, p.inv_keep, buf);
    // kW columns always (S and part have w rounded up to whole vectors, big's zeros past w add
    // nothing): a constant trip count, fully unrolled, keeps the accumulators in registers.
#pragma GCC unroll 16
    for (int jj = 0; jj < kW; ++jj) {
      const int64_t j = jb + jj;
      // COLS: P partial sums over the R rows (row i into sum i % P) shorten the FMA latency
      // chain from R to R / P; the block's sum is ((d0 + d1) + (d2 + d3)). dA at r = 16 (R = 16)
      // takes 1.62 ms with P = 4 against 1.76 with P = 2 (N = 2048, d = 1536, bf16, 1 thread);
      // rank_grads' R = 8 runs no faster with 4.
      constexpr int P = R >= 16 ? 4 : R >= 4 ? 2 : 1;
      fVec s[NV], d[NV][P];
#pragma GCC unroll 4
      for (int q = 0; q < NV; ++q) {
        if constexpr (ROWS) s[q] = fVec::loadu(p.S + j * p.lds + q * kW);
        if constexpr (COLS) {
          d[q][0] = fVec::loadu(gpart + (j - j0) * NV * kW + q * kW);
          for (int c = 1; c < P; ++c) d[q][c] = fVec(0.f);
        }
      }
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const fVec v(buf[i * kW + jj]);
#pragma GCC unroll 4
        for (int q = 0; q < NV; ++q) {
          if constexpr (ROWS) acc[i][q] = at::vec::fmadd(v, s[q], acc[i][q]);
          if constexpr (COLS) d[q][i % P] = at::vec::fmadd(v, sm[i][q], d[q][i % P]);
        }
      }
#pragma GCC unroll 4
      for (int q = 0; q < NV; ++q) {
        if constexpr (COLS) {
          fVec sum = d[q][0];
          if constexpr (P == 2) sum = d[q][0] + d[q][1];
          if constexpr (P == 4) sum = (d[q][0] + d[q][1]) + (d[q][2] + d[q][3]);
          sum.store(gpart + (j - j0) * NV * kW + q * kW);
        }
      }
    }
  }
  if constexpr (ROWS) {
    const bool last = j1 == p.w;
    const fVec sv(p.scale);
    for (int i = 0; i < R; ++i) {
      for (int q = 0; q < NV; ++q) {
        float* o = out + i * p.ldo + q * kW;
        const fVec sum = j0 == 0 ? acc[i][q] : fVec::loadu(o) + acc[i][q];
        (last ? sum * sv : sum).store(o);
      }
    }
  }
}

// Rows [r0, r1) by groups of kGroupRows rows and column ranges of kRangeFloats floats of S: the
// range's S rows and the group's sums stay in L1 while every row block of the group passes over
// them, instead of streaming all of S (w·r floats) from L2 once per R rows. The sums are blocked
// too: over a range's columns from zero, then added range by range (ROWS); over a group's rows
// from zero, then added into the chunk's partial group by group (COLS). One long fp32 running
// sum over 4100 columns was 3.5 units of 2^-24 off where MKL's blocked GEMM was 0.6
// (tests/ops/test_lora_rank.py).
constexpr int64_t kGroupRows = 64;

constexpr int64_t kRangeFloats = 4096;  // 16 KiB

template <typename T, int NV, bool ROWS, bool COLS>
void pass_rows(const T* big, const Pass& p, float* part, int64_t r0, int64_t r1) {
  constexpr int R = rows_per_block<NV, ROWS, COLS>();
  constexpr int64_t width = NV * kW;  // floats of a row of S, part
  constexpr int64_t range = std::max<int64_t>(kW, kRangeFloats / width / kW * kW);
  alignas(64) float gpart[COLS ? range * width : 1];  // (range, width) the group's sums
  for (int64_t g0 = r0; g0 < r1; g0 += kGroupRows) {
    const int64_t g1 = std::min(r1, g0 + kGroupRows);
    for (int64_t j0 = 0; j0 < p.w; j0 += range) {
      const int64_t j1 = std::min(p.w, j0 + range);
      const int64_t n = (j1 - j0 + kW - 1) / kW * kW * width;  // floats of gpart used
      if constexpr (COLS) std::fill(gpart, gpart + n, 0.f);
      int64_t row = g0;
      for (; row + R <= g1; row += R) pass_block<T, NV, R, ROWS, COLS>(big, p, gpart, row, j0, j1);
      for (; row < g1; ++row) pass_block<T, NV, 1, ROWS, COLS>(big, p, gpart, row, j0, j1);
      if constexpr (COLS) {
        float* dst = part + j0 * width;
        for (int64_t i = 0; i < n; i += kW) {
          (fVec::loadu(dst + i) + fVec::loadu(gpart + i)).store(dst + i);
        }
      }
    }
  }
}

// Rows [r0, r1) with NV vectors of r (a compile-time count) and the products asked for.
template <typename T>
void pass_dispatch(const T* big, const Pass& p, float* part, int64_t nv, int64_t r0, int64_t r1) {
  const bool rows = p.S != nullptr, cols = p.small != nullptr;
  auto with_nv = [&](auto nv_c) {
    constexpr int NV = decltype(nv_c)::value;
    if (rows && cols) return pass_rows<T, NV, true, true>(big, p, part, r0, r1);
    if (rows) return pass_rows<T, NV, true, false>(big, p, part, r0, r1);
    pass_rows<T, NV, false, true>(big, p, part, r0, r1);
  };
  switch (nv) {
    case 1: return with_nv(std::integral_constant<int, 1>{});
    default: return with_nv(std::integral_constant<int, 2>{});  // pass_fma_fits: nv <= 2
  }
}

// t (rows, cols) fp32 padded with zeros to (rows_p, cols_p), with unit column stride (t itself
// when it has that form already: e.g. B at r = 16 and k a multiple of kW).
at::Tensor pad_to(const at::Tensor& t, int64_t rows_p, int64_t cols_p) {
  if (t.size(0) == rows_p && t.size(1) == cols_p && t.stride(1) == 1) return t;
  at::Tensor out = at::zeros({rows_p, cols_p}, t.options());
  out.narrow(0, 0, t.size(0)).narrow(1, 0, t.size(1)).copy_(t);
  return out;
}

// Row chunks: at most get_num_threads(), split at multiples of `block` rows.
struct Chunks {
  int64_t n, block, blocks, count;
  Chunks(int64_t n_, int64_t block_) : n(n_), block(block_) {
    blocks = (n + block - 1) / block;
    count = std::max<int64_t>(1, std::min<int64_t>(blocks, at::get_num_threads()));
  }
  int64_t begin(int64_t c) const { return std::min(n, c * blocks / count * block); }
  template <typename F>
  void run(const F& f) const {  // f(chunk, first row, end row), chunks in parallel
    at::parallel_for(0, count, 1, [&](int64_t c0, int64_t c1) {
      c10::NoGradGuard no_grad;  // workers start in grad mode: no autograd in here
      for (int64_t c = c0; c < c1; ++c) f(c, begin(c), begin(c + 1));
    });
  }
};

// ---- y = round(y + (small·St)·s) ----------------------------------------------------------------
// Blocks of kAddRows rows by kAddCols vectors of columns: kAddRows·kAddCols accumulators (16 on
// AVX-512, 8 on AVX2), kAddCols St vectors and a broadcast per step of the r-long sums. Column
// blocks run over groups of kGroupRows rows, so that a block's St columns (r·kAddCols vectors)
// stay in L1 for the group's rows instead of streaming all of St (r·w floats) from L2 per row
// block: 1.3 against 3.4 ms streaming St (N = 2048, k = 1536, r = 16, bf16, 1 thread; bf16
// rounded by the native instruction where the CPU has it).
constexpr int kAddRows = 4;
constexpr int kAddCols = kW == 16 ? 4 : 2;

struct Add {
  int64_t w, r;
  const float* small;  // (N, r), row stride ldm
  int64_t ldm;
  const float* St;  // (r, w) contiguous
  const bool* mask;
  float s;
};

// y[0, n) = round(y + t·s) where mask (or everywhere), n <= kW: add_rows' formula, one rounding.
// A dropout mask or a row's last columns go element by element.
template <typename T, typename Store>
inline void add_vec(T* y, const fVec& t, const bool* m, float s, int64_t n) {
  if (m == nullptr && n == kW) return Store::store(y, load_f<T>(y) + t * fVec(s));
  alignas(64) float tb[kW];
  t.store(tb);
  for (int64_t jj = 0; jj < n; ++jj) {
    if (m == nullptr || m[jj]) y[jj] = static_cast<T>(static_cast<float>(y[jj]) + tb[jj] * s);
  }
}

// Rows [row, row + R), columns [j0, j0 + C·kW) (C = 1: [j0, j0 + n), n <= kW, the row's tail).
template <typename T, typename Store, int R, int C>
void add_block(T* y, const Add& a, int64_t row, int64_t j0, int64_t n) {
  fVec acc[R][C];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[i][c] = fVec(0.f);
  }
  const float* xs = a.small + row * a.ldm;
  for (int64_t kk = 0; kk < a.r; ++kk) {
    const float* st = a.St + kk * a.w + j0;
    fVec b[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      b[c] = C == 1 && n < kW ? fVec::loadu(st, n) : fVec::loadu(st + c * kW);
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const fVec v(xs[i * a.ldm + kk]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[i][c] = at::vec::fmadd(v, b[c], acc[i][c]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    T* yr = y + (row + i) * a.w + j0;
    const bool* m = a.mask == nullptr ? nullptr : a.mask + (row + i) * a.w + j0;
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      add_vec<T, Store>(yr + c * kW, acc[i][c], m == nullptr ? nullptr : m + c * kW, a.s,
                        C == 1 ? n : kW);
    }
  }
}

// Rows [r0, r1) of y.
template <typename T, typename Store>
void add_rows_fma(T* y, const Add& a, int64_t r0, int64_t r1) {
  constexpr int64_t cols = kAddCols * kW;
  for (int64_t g0 = r0; g0 < r1; g0 += kGroupRows) {
    const int64_t g1 = std::min(r1, g0 + kGroupRows);
    for (int64_t j0 = 0; j0 < a.w; j0 += cols) {
      const int64_t n = std::min(cols, a.w - j0);
      int64_t row = g0;
      if (n == cols) {
        for (; row + kAddRows <= g1; row += kAddRows) {
          add_block<T, Store, kAddRows, kAddCols>(y, a, row, j0, kW);
        }
        for (; row < g1; ++row) add_block<T, Store, 1, kAddCols>(y, a, row, j0, kW);
        continue;
      }
      for (int64_t jb = j0; jb < a.w; jb += kW) {  // the rows' last columns, a vector at a time
        const int64_t nb = std::min(kW, a.w - jb);
        for (row = g0; row + kAddRows <= g1; row += kAddRows) {
          add_block<T, Store, kAddRows, 1>(y, a, row, jb, nb);
        }
        for (; row < g1; ++row) add_block<T, Store, 1, 1>(y, a, row, jb, nb);
      }
    }
  }
}

#if defined(LORAFUSE_NATIVE_BF16_ROUNDING)
LORAFUSE_NATIVE_BF16_TARGET void add_rows_native(at::BFloat16* y, const Add& a, int64_t r0,
                                                 int64_t r1) {
  add_rows_fma<at::BFloat16, Bf16RoundingNative>(y, a, r0, r1);
}
#endif

// Rows [r0, r1) of y, a bf16 y rounded by the native instruction where the CPU has it.
template <typename T>
void add_rows_any(T* y, const Add& a, int64_t r0, int64_t r1) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(LORAFUSE_NATIVE_BF16_ROUNDING)
    if (native_bf16_rounding()) return add_rows_native(y, a, r0, r1);
#endif
  }
  add_rows_fma<T, Bf16Rounding>(y, a, r0, r1);
}

}  // namespace

void add_product_fma(at::Tensor& y, const at::Tensor& small, const at::Tensor& St,
                     const bool* mask, float s) {
  const int64_t N = y.size(0), w = y.size(1);
  const at::Tensor smallc = small.stride(1) == 1 ? small : small.contiguous();  // (N, r)
  const at::Tensor Stc = St.contiguous();                                      // (r, w)
  const Add a{w, small.size(1), smallc.const_data_ptr<float>(), smallc.stride(0),
              Stc.const_data_ptr<float>(), mask, s};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "lora_rank_fma_add",
                                  [&] {
                                    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
                                    // rows independent: dealt (common.h)
                                    parallel_rows(N, kGroupRows, [&](int64_t r0, int64_t r1) {
                                      add_rows_any<scalar_t>(yp, a, r0, r1);
                                    });
                                  });
}

bool pass_fma_fits(int64_t r) { return r <= 2 * kW; }

std::tuple<at::Tensor, at::Tensor> pass_fma(const at::Tensor& big, const bool* mask,
                                            float inv_keep, const at::Tensor& S, float scale_rows,
                                            const at::Tensor& small, float scale_cols) {
  const int64_t N = big.size(0), w = big.size(1);
  const int64_t r = S.defined() ? S.size(1) : small.size(1);
  TORCH_CHECK(pass_fma_fits(r), "pass_fma: r = ", r, " is more than 2 vectors");
  const int64_t rp = (r + kW - 1) / kW * kW;  // r padded to whole vectors
  const int64_t wp = (w + kW - 1) / kW * kW;  // w padded to whole vectors
  const auto f32 = big.options().dtype(at::kFloat);
  const at::Tensor Sp = S.defined() ? pad_to(S, wp, rp) : S;                  // (wp, rp)
  const at::Tensor smallp = small.defined() ? pad_to(small, N, rp) : small;  // (N, rp)
  at::Tensor out = S.defined() ? at::empty({N, rp}, f32) : at::Tensor();     // (N, rp)
  const Chunks chunks(N, kGroupRows);
  at::Tensor part;  // (chunks, wp, rp) the chunks' partials of the column reduction
  if (small.defined()) part = at::zeros({chunks.count, wp, rp}, f32);
  Pass p{w, mask, inv_keep, nullptr, 0, nullptr, rp, scale_rows, nullptr, 0};
  if (S.defined()) {
    p.S = Sp.const_data_ptr<float>();
    p.lds = Sp.stride(0);
    p.out = out.mutable_data_ptr<float>();
  }
  if (small.defined()) {
    p.small = smallp.const_data_ptr<float>();
    p.ldm = smallp.stride(0);
  }
  LORAFUSE_DISPATCH(big.scalar_type(), "lora_rank_fma", [&] {
    const scalar_t* bp = big.const_data_ptr<scalar_t>();
    chunks.run([&](int64_t c, int64_t r0, int64_t r1) {
      float* pp = part.defined() ? part.select(0, c).mutable_data_ptr<float>() : nullptr;
      pass_dispatch<scalar_t>(bp, p, pp, rp / kW, r0, r1);
    });
  });
  if (out.defined() && rp != r) out = out.narrow(1, 0, r).contiguous();  // (N, r)
  at::Tensor cols;
  if (small.defined()) {
    cols = sum_partials(part, wp, rp);  // in chunk order: deterministic
    if (rp != r || wp != w) cols = cols.narrow(0, 0, w).narrow(1, 0, r).contiguous();  // (w, r)
    if (scale_cols != 1.f) cols.mul_(scale_cols);
  }
  return {out, cols};
}

}  // namespace lorafuse
