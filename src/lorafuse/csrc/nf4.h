// NF4 dequantisation of a range of 64-weight blocks, serial (nf4.cpp; callers parallelise):
// blocks [b0, b1) of a weight of n values go to out[0 .. (b1 - b0)·64), bit for bit what
// nf4_dequantize_forward writes there (contract: models/nf4.py's dequantize_nf4).
#pragma once

#include "common.h"

#include <cstdint>

namespace lorafuse {

constexpr int64_t kNF4Block = 64;    // weights per absmax
constexpr int64_t kNF4Block2 = 256;  // absmaxes per double-quantisation scale

// bitsandbytes' NF4 code as fp32 (the literals of ops/nf4.py's NF4_CODE, rounded once
// to fp32).
inline constexpr float kNF4Code[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

// Block b's absmax as torch computes it: q * scale rounded to fp32, then + offset rounded.
// `volatile` keeps the compiler from contracting the two into one FMA (GCC does so by default
// under -O3 -mfma), which would round once and differ from torch in the last bit.
inline float nf4_block_absmax(const int8_t* q, const float* scale, float offset, int64_t b) {
  volatile float prod = static_cast<float>(q[b]) * scale[b / kNF4Block2];
  return prod + offset;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LORAFUSE_NF4_AVX512 1
// Whether the CPU runs the AVX-512 bodies (compiled with their own target attribute even where
// the extension is built for AVX2).
inline bool nf4_have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return yes;
}
#endif

template <typename T>
void nf4_dequantize_range(const uint8_t* codes, const int8_t* absmax_q, const float* scale,
                          float offset, T* out, int64_t n, int64_t b0, int64_t b1, bool simd);

// The four buffers of an NF4 weight as raw pointers.
struct NF4Buffers {
  const uint8_t* codes;
  const int8_t* q;
  const float* scale;
  float offset;
};

// The buffers of a weight of n_blocks 64-weight blocks, after a clear error (naming `op` and the
// buffer) unless each is a contiguous CPU tensor of its dtype, large enough.
NF4Buffers nf4_checked_buffers(const at::Tensor& codes, const at::Tensor& absmax_q,
                               const at::Tensor& absmax_scale, const at::Tensor& absmax_offset,
                               int64_t n_blocks, const char* op);

}  // namespace lorafuse
