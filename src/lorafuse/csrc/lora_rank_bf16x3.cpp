// bf16x3: rank-r products of a bf16 large operand and an fp32 small one as whole bf16 GEMMs that
// stay exact to fp32 (lora_rank.cpp calls these where use_bf16x3 says; contracts there).
#include <atomic>

#include "lora_rank.h"

namespace lorafuse {
namespace {

// ---- bf16x3: a bf16 large operand times an fp32 small one as one bf16 GEMM -------------------
// Where bf16 products are native (AMX: ~1 TFLOP/s against ~96 GFLOP/s of fp32 on one core), an
// fp32 small operand S is split into three bf16 parts S = S1 + S2 + S3, S1 = bf16(S), S2 =
// bf16(S - S1), S3 = bf16(S - S1 - S2): S1 holds the top 8 significant bits, S - S1 is exact in
// fp32 and has at most 16 left, S2 takes 8 of them and S - S1 - S2 (at most 8 bits) is S3
// exactly, so the split is exact for every finite S with |S| <= bf16's max (3.39e38) whose
// parts stay normal (|S| >~ 2^-110; the bf16 units read denormals as zero, an error below
// 2^-126 per product). Every bf16·bf16 product is exact in fp32 and MKL sums in fp32, so
// x·[S1 S2 S3] summed per column group is the fp32 product x·S up to summation order, without
// converting the large operand and in one whole GEMM. Non-finite values stay non-finite but
// turn into NaN: inf·S2 = inf·0 when S is a bf16 value, and inf - inf in the split of an inf.

// Where bf16x3 runs (set_rank_bf16x3): "auto" where torch's oneDNN packs bf16 (AMX), "on"
// wherever bf16 is native and MKL's bf16 GEMM is there (tests, benchmarks), "off".
enum class Bf16x3 { kOff, kAuto, kOn };
std::atomic<Bf16x3> g_bf16x3{Bf16x3::kAuto};

// bf16x3 is three bf16 products where the FMA kernels run one fp32 product, so it pays only where
// bf16 products run several times faster than fp32 FMA: AMX (1.45 against 1.75 ms for down at
// d = 1536, lora_rank.cpp). On AVX-512-BF16 without AMX a bf16 dot product does at most twice
// the FMA's work, and MKL's bf16 GEMM there ran 4-7x slower than the FMA kernels: down 4.23
// against 1.00 ms, grads 8.60 against 1.28, dA 4.24 against 0.77 at d = k = 1536 (N = 2048,
// r = 16, 2 threads; `python benchmarks/ops/lora_rank.py --threads 2 --baseline bf16x3
// --widths 1536 576`, 2-core AMD EPYC).
bool bf16x3_allowed() {
  switch (g_bf16x3.load()) {
    case Bf16x3::kOff: return false;
    case Bf16x3::kOn: return true;
    default: return onednn_packs_bf16();
  }
}

// The three bf16 parts of S (rows, cols) fp32 with row stride ld: part p of S[i][j] goes to
// out[i * ld_out + p * part_stride + j] (column groups: ld_out = 3 cols, part_stride = cols; row
// groups: ld_out = cols, part_stride = rows * cols).
void split3(const float* s, int64_t rows, int64_t cols, int64_t ld, at::BFloat16* out,
            int64_t ld_out, int64_t part_stride) {
  using B = at::BFloat16;
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* src = s + i * ld;
      B* o = out + i * ld_out;
      int64_t j = 0;
      for (; j + kW <= cols; j += kW) {
        const fVec v = fVec::loadu(src + j);
        const fVec s1 = round_to<B>(v);
        const fVec r1 = v - s1;  // exact
        const fVec s2 = round_to<B>(r1);
        store_f<B>(o + j, s1);
        store_f<B>(o + part_stride + j, s2);
        store_f<B>(o + 2 * part_stride + j, r1 - s2);  // exact in bf16 (see above)
      }
      for (; j < cols; ++j) {
        const float v = src[j];
        const B s1(v);
        const float r1 = v - static_cast<float>(s1);
        const B s2(r1);
        o[j] = s1;
        o[part_stride + j] = s2;
        o[2 * part_stride + j] = B(r1 - static_cast<float>(s2));
      }
    }
  });
}

// out[i·os + j·oc] = alpha·((C3 + C2) + C1)[i][j], Cp[i][j] = c[i·ldc + p·part_stride + j]: the
// three parts' products summed, smallest first (os, oc: out's strides; out transposed for dA).
void sum3(const float* c, int64_t rows, int64_t cols, int64_t ldc, int64_t part_stride,
          float alpha, float* out, int64_t os, int64_t oc) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* ci = c + i * ldc;
    for (int64_t j = 0; j < cols; ++j) {
      out[i * os + j * oc] = alpha * ((ci[2 * part_stride + j] + ci[part_stride + j]) + ci[j]);
    }
  }
}

// A small fp32 operand with unit column stride (a column block of a stacked xa has it already).
at::Tensor unit_cols(const at::Tensor& t) { return t.stride(1) == 1 ? t : t.contiguous(); }

// S (rows, cols) fp32 as [S1 S2 S3] (rows, 3 cols) bf16.
at::Tensor split_cols(const at::Tensor& s) {
  const at::Tensor u = unit_cols(s);
  const int64_t rows = u.size(0), cols = u.size(1);
  at::Tensor out = at::empty({rows, 3 * cols}, u.options().dtype(at::kBFloat16));
  split3(u.const_data_ptr<float>(), rows, cols, u.stride(0), out.mutable_data_ptr<at::BFloat16>(),
         3 * cols, cols);
  return out;
}

// S (rows, cols) fp32 as [S1; S2; S3] (3 rows, cols) bf16.
at::Tensor split_rows(const at::Tensor& s) {
  const at::Tensor u = unit_cols(s);
  const int64_t rows = u.size(0), cols = u.size(1);
  at::Tensor out = at::empty({3 * rows, cols}, u.options().dtype(at::kBFloat16));
  split3(u.const_data_ptr<float>(), rows, cols, u.stride(0), out.mutable_data_ptr<at::BFloat16>(),
         cols, rows * cols);
  return out;
}

const at::BFloat16* bf16_ptr(const at::Tensor& t) { return t.const_data_ptr<at::BFloat16>(); }

// s·op(big)·S (M, r) fp32: one bf16 GEMM C = op(big)·[S1 S2 S3] (M, 3r), its column groups summed.
// big (rows, cols) bf16 contiguous, op(big) = big (M = rows) or bigᵀ (trans: M = cols); S fp32 with
// op(big)'s column count of rows. transpose_out writes the result as (r, M).
at::Tensor times_split(const at::Tensor& big, bool trans, const at::Tensor& S, float s,
                       bool transpose_out) {
  const int64_t rows = big.size(0), cols = big.size(1), r = S.size(1);
  const int64_t M = trans ? cols : rows, K = trans ? rows : cols;
  const at::Tensor parts = split_cols(S);  // (K, 3r)
  float* c = rank_scratch(M * 3 * r);      // (M, 3r)
  {
    LORAFUSE_PROFILE_RANGE("lora_rank_mkl_bf16_gemm");
    bf16_gemm(trans, false, M, 3 * r, K, 1.f, bf16_ptr(big), cols, bf16_ptr(parts), 3 * r, 0.f, c,
              3 * r);
  }
  const auto opts = big.options().dtype(at::kFloat);
  at::Tensor out = transpose_out ? at::empty({r, M}, opts) : at::empty({M, r}, opts);
  sum3(c, M, r, 3 * r, r, s, out.mutable_data_ptr<float>(), transpose_out ? 1 : r,
       transpose_out ? M : 1);
  return out;
}

}  // namespace

// Which kernel computes a product whose large operand is `big` (dropout mask `mask` or null):
// the one place that chooses. A mask (x / keep is not a bf16 value), fp16 and N = 0 (no GEMM
// needed) take the FMA kernels or the fp32 tiles (lora_rank.cpp).
bool use_bf16x3(const at::Tensor& big, const bool* mask) {
  return big.scalar_type() == at::kBFloat16 && mask == nullptr && big.size(0) > 0 &&
         rank_bf16x3_active();
}

bool rank_bf16x3_active() {
  return matmul_dtype(at::kBFloat16) == at::kBFloat16 && bf16_gemm_available() &&
         bf16x3_allowed();
}

// xa = x·Aᵀ (N, r): C = x·[A1; A2; A3]ᵀ (N, 3r), column groups summed.
at::Tensor down_bf16x3(const at::Tensor& x, const at::Tensor& A) {
  const int64_t N = x.size(0), d = x.size(1), r = A.size(0);
  const at::Tensor parts = split_rows(A);  // (3r, d)
  float* c = rank_scratch(N * 3 * r);           // (N, 3r)
  {
    LORAFUSE_PROFILE_RANGE("lora_rank_mkl_bf16_gemm");
    bf16_gemm(false, true, N, 3 * r, d, 1.f, bf16_ptr(x), d, bf16_ptr(parts), d, 0.f, c, 3 * r);
  }
  at::Tensor xa = at::empty({N, r}, x.options().dtype(at::kFloat));
  sum3(c, N, r, 3 * r, r, 1.f, xa.mutable_data_ptr<float>(), r, 1);
  return xa;
}

// gB = s·g·B (N, r): C = g·[B1 B2 B3] (N, 3r); dB = s·gᵀ·xa (k, r): C = gᵀ·[xa1 xa2 xa3] (k, 3r).
std::tuple<at::Tensor, at::Tensor> grads_bf16x3(const at::Tensor& g, const at::Tensor& B,
                                                const at::Tensor& xa, float s, bool need_gB,
                                                bool need_dB) {
  at::Tensor gB = need_gB ? times_split(g, false, B, s, false) : at::Tensor();
  at::Tensor dB = need_dB ? times_split(g, true, xa, s, false) : at::Tensor();
  return {gB, dB};
}

// dA = gBᵀ·x (r, d), as its transpose C = xᵀ·[gB1 gB2 gB3] (d, 3r) with column groups summed:
// MKL ran that form in 0.54 ms against 0.83 ms for [gB1 gB2 gB3]ᵀ·x (N = 2048, d = 576, 3r = 96,
// 1 thread), the form dB = gᵀ·[xa1 xa2 xa3] above has already.
at::Tensor dA_bf16x3(const at::Tensor& gB, const at::Tensor& x) {
  return times_split(x, true, gB, 1.f, /*transpose_out=*/true);  // (r, d)
}

void set_rank_bf16x3(const std::string& mode) {
  TORCH_CHECK(mode == "auto" || mode == "on" || mode == "off",
              "lora_rank_set_bf16x3: mode must be 'auto', 'on' or 'off', got '", mode, "'");
  g_bf16x3.store(mode == "on" ? Bf16x3::kOn : mode == "off" ? Bf16x3::kOff : Bf16x3::kAuto);
}

}  // namespace lorafuse
