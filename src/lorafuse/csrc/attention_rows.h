// The vector passes between the causal attention kernel's products (attention.cpp, its only
// includer: definitions in an anonymous namespace): row max, exp + row sum + the P operand copy,
// dS, each one pass over a row of the M x BC scratch, rounding to bf16 natively where the CPU can
// (common.h's Bf16RoundingNative; why and what it measured: attention.cpp's header).
#pragma once

#include <limits>

#include "common.h"

namespace lorafuse {
namespace {

using bf16 = at::BFloat16;

// Horizontal sum and max by halving (log2 kW steps, not a chain of kW - 1 dependent adds).
float sum_of(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec a, fVec b) { return a + b; }, v);
}
float max_of(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec a, fVec b) { return at::vec::maximum(a, b); }, v);
}

template <typename T>
float dot(const T* a, const T* b, int64_t n) {  // fp32 sum of a·b
  fVec acc(0.f);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) acc = at::vec::fmadd(load_f<T>(a + j), load_f<T>(b + j), acc);
  float s = sum_of(acc);
  for (; j < n; ++j) s += static_cast<float>(a[j]) * static_cast<float>(b[j]);
  return s;
}

// The largest of n fp32 values times ss (the scores' scale where the product left it out).
float scaled_max(const float* row, int64_t n, float ss) {
  const fVec sv(ss), lowest(-std::numeric_limits<float>::infinity());
  fVec acc = lowest;
  int64_t j = 0;
  // clamp_min is the plain max instruction (at::vec::maximum adds 3 operations to propagate NaN;
  // a NaN score makes its row NaN through the exponentials anyway).
  for (; j + kW <= n; j += kW) acc = at::vec::clamp_min(fVec::loadu(row + j) * sv, acc);
  if (j < n) {  // the ragged end as one masked vector (no scalar loop on every diagonal row)
    acc = at::vec::clamp_min(fVec::set(lowest, fVec::loadu(row + j, n - j) * sv, n - j), acc);
  }
  return max_of(acc);
}

// out[j] <- exp(ss·row[j] - m) rounded to T for j < n, 0 up to cols; returns their fp32 sum. With
// keep_row the fp32 values also replace row (the backward's dS pass reads them; for fp32 storage
// out is row itself). One pass: the exponentials, their sum and the operand copy.
template <typename T, bool keep_row, typename Rounding>
float exp_row_with(float* row, int64_t n, int64_t cols, float m, T* out, float ss) {
  const fVec mv(-m), sv(ss);
  fVec acc(0.f);
  auto put = [&](int64_t j, const fVec& e) {
    if constexpr (keep_row || std::is_same_v<T, float>) e.store(row + j);
    if constexpr (!std::is_same_v<T, float>) Rounding::store(out + j, e);
  };
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const fVec e = exp_fast(at::vec::fmadd(fVec::loadu(row + j), sv, mv));
    acc = acc + e;
    put(j, e);
  }
  if (j < n) {  // the ragged end (every diagonal row has one): lanes past n are stored as 0
    const fVec x = fVec::loadu(row + j, n - j);
    const fVec e = fVec::set(fVec(0.f), exp_fast(at::vec::fmadd(x, sv, mv)), n - j);
    acc = acc + e;
    put(j, e);
    j += kW;
  }
  // Zeros up to cols, by whole vectors: rows are BC (a multiple of kW) apart, so this stays in row.
  for (; j < cols; j += kW) put(j, fVec(0.f));
  return sum_of(acc);
}

// dS = P * (dP - delta) * scale over one row, rounded to T into out (for fp32, out is dp).
template <typename T, typename Rounding>
void ds_row_with(const float* p, float* dp, int64_t cols, float delta, float sc, T* out) {
  const fVec dv(delta), sv(sc);
  int64_t j = 0;
  for (; j + kW <= cols; j += kW) {
    const fVec ds = fVec::loadu(p + j) * (fVec::loadu(dp + j) - dv) * sv;
    if constexpr (std::is_same_v<T, float>) {
      ds.store(out + j);
    } else {
      Rounding::store(out + j, ds);
    }
  }
  for (; j < cols; ++j) out[j] = static_cast<T>(p[j] * (dp[j] - delta) * sc);
}

#if defined(LORAFUSE_NATIVE_BF16_ROUNDING)
template <bool keep_row>
LORAFUSE_NATIVE_BF16_TARGET float exp_row_native(float* row, int64_t n, int64_t cols, float m,
                                                 bf16* out, float ss) {
  return exp_row_with<bf16, keep_row, Bf16RoundingNative>(row, n, cols, m, out, ss);
}
LORAFUSE_NATIVE_BF16_TARGET void ds_row_native(const float* p, float* dp, int64_t cols,
                                               float delta, float sc, bf16* out) {
  ds_row_with<bf16, Bf16RoundingNative>(p, dp, cols, delta, sc, out);
}
#endif

// exp_row_with / ds_row_with rounding bf16 natively where the CPU can (common.h).
template <typename T, bool keep_row>
float exp_row(float* row, int64_t n, int64_t cols, float m, T* out, float ss) {
#if defined(LORAFUSE_NATIVE_BF16_ROUNDING)
  if constexpr (std::is_same_v<T, bf16>) {
    if (native_bf16_rounding()) return exp_row_native<keep_row>(row, n, cols, m, out, ss);
  }
#endif
  return exp_row_with<T, keep_row, Bf16Rounding>(row, n, cols, m, out, ss);
}
template <typename T>
void ds_row(const float* p, float* dp, int64_t cols, float delta, float sc, T* out) {
#if defined(LORAFUSE_NATIVE_BF16_ROUNDING)
  if constexpr (std::is_same_v<T, bf16>) {
    if (native_bf16_rounding()) return ds_row_native(p, dp, cols, delta, sc, out);
  }
#endif
  ds_row_with<T, Bf16Rounding>(p, dp, cols, delta, sc, out);
}

}  // namespace
}  // namespace lorafuse
