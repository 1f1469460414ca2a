// Rank-r LoRA products with an fp32 small operand and a large (N, w) operand of any floating
// dtype, computed by register-blocked fp32 FMA kernels that convert the large operand in registers
// (or by row tiles) so that no (N, w) fp32 tensor is ever formed, or, for a bf16 large operand
// where bf16 products are native, as whole bf16 GEMMs exact to fp32 (csrc/lora_rank.cpp).
// Used by lora_linear.cpp and, through the bindings, by ops/lora_rank.py (ops/lora_split.py).
// Kernels for the ops' own forward/backward: they record no autograd history.
#pragma once

#include "common.h"

namespace lorafuse {

// xa = dropout(x)·Aᵀ: x (N, d) any floating dtype, contiguous; A (r, d) fp32; mask (N, d) bool
// or none (dropout(x) = mask ? x / keep : 0). Returns xa (N, r) fp32.
at::Tensor rank_down(const at::Tensor& x, const at::Tensor& A, const OptTensor& mask,
                     double keep);

// y = round(y + s·xa·Bᵀ) in place: y (N, k) contiguous, any floating dtype; xa (N, r) fp32
// (any row stride: a column block of a stacked xa); B (k, r) fp32. One rounding per element.
void rank_up_add_(at::Tensor& y, const at::Tensor& xa, const at::Tensor& B, double s);

// gB = s·g·B (N, r) and dB = s·gᵀ·xa (k, r), both fp32, from one pass over g's row tiles:
// g (N, k) any floating dtype, contiguous; B (k, r) fp32; xa (N, r) fp32. Each output is
// undefined unless asked for.
std::tuple<at::Tensor, at::Tensor> rank_grads(const at::Tensor& g, const at::Tensor& B,
                                              const at::Tensor& xa, double s, bool need_gB,
                                              bool need_dB);

// dA = gBᵀ·dropout(x) (r, d) fp32: gB (N, r) fp32; x (N, d) any floating dtype, contiguous;
// mask as rank_down's.
at::Tensor rank_dA(const at::Tensor& gB, const at::Tensor& x, const OptTensor& mask,
                   double keep);

// dx = round(dx + dropout'(gB·A)) in place: dx (N, d) contiguous, any floating dtype; gB (N, r)
// fp32; A (r, d) fp32; with a mask the term is mask ? (gB·A) / keep : 0. One rounding.
void rank_dx_add_(at::Tensor& dx, const at::Tensor& gB, const at::Tensor& A,
                  const OptTensor& mask, double keep);

// Where a bf16 large operand takes the bf16x3 GEMMs: "auto" (the default: where torch's oneDNN
// packs bf16, AMX, the only CPUs where they measured faster), "on" (wherever bf16 is native and
// MKL's bf16 GEMM is there: tests and benchmarks on other CPUs), "off" (the FMA kernels or the
// fp32 tiles), so that a benchmark can time both in one process.
void set_rank_bf16x3(const std::string& mode);
// Whether a bf16 large operand without a mask takes bf16x3 now (use_bf16x3's machine half).
bool rank_bf16x3_active();
// Whether the products may take the register-blocked FMA kernels where lora_rank.cpp picks them
// (the default); false runs the fp32 tiles they replaced, for benchmarks timing both.
void set_rank_fma(bool allowed);

// ---- shared by lora_rank.cpp, lora_rank_bf16x3.cpp and lora_rank_fma.cpp ----------------------
// The sum of a reduction's per-chunk partials (chunks, a, b) as (a, b), in chunk order.
at::Tensor sum_partials(const at::Tensor& part, int64_t a, int64_t b);
// A per-thread fp32 scratch of at least n floats, kept across calls: a fresh buffer of this size
// would be page-faulted in on every call.
float* rank_scratch(int64_t n);
// Whether a product whose large operand is `big` (dropout mask or null) runs as bf16x3: bf16,
// no mask, N > 0, and rank_bf16x3_active (bf16 native, MKL's bf16 GEMM found, and
// set_rank_bf16x3's mode allows it here).
bool use_bf16x3(const at::Tensor& big, const bool* mask);
// The bf16x3 products (lora_rank_bf16x3.cpp); same results as rank_down / rank_grads / rank_dA
// without a mask, up to fp32 summation order. s scales gB and dB.
at::Tensor down_bf16x3(const at::Tensor& x, const at::Tensor& A);
std::tuple<at::Tensor, at::Tensor> grads_bf16x3(const at::Tensor& g, const at::Tensor& B,
                                                const at::Tensor& xa, float s, bool need_gB,
                                                bool need_dB);
at::Tensor dA_bf16x3(const at::Tensor& gB, const at::Tensor& x);
// The register-blocked fp32 FMA kernels (lora_rank_fma.cpp): one pass over big (N, w), any
// floating dtype, contiguous, with an optional dropout mask (mask ? big·inv_keep : 0):
// rows = scale_rows·dropout(big)·S (N, r) where S (w, r) fp32 is defined, cols =
// scale_cols·dropout(big)ᵀ·small (w, r) where small (N, r) fp32 is defined (undefined otherwise).
// For r where pass_fma_fits: up to 2 vectors (32 on AVX-512, 16 on AVX2).
bool pass_fma_fits(int64_t r);
std::tuple<at::Tensor, at::Tensor> pass_fma(const at::Tensor& big, const bool* mask,
                                            float inv_keep, const at::Tensor& S, float scale_rows,
                                            const at::Tensor& small, float scale_cols);
// y = round(y + (small·St)·s) in place, only where mask when given: y (N, w) contiguous fp32,
// bf16 or fp16; small (N, r) fp32 (any row stride); St (r, w) fp32. One rounding per element.
void add_product_fma(at::Tensor& y, const at::Tensor& small, const at::Tensor& St,
                     const bool* mask, float s);

}  // namespace lorafuse
