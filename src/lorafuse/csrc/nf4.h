// NF4 dequantisation of a range of 64-weight blocks, serial (nf4.cpp; callers parallelise):
// blocks [b0, b1) of a weight of n values go to out[0 .. (b1 - b0)·64), bit for bit what
// nf4_dequantize_forward writes there (contract: models/nf4.py's dequantize_nf4).
#pragma once

#include "common.h"

#include <cstdint>

namespace lorafuse {

constexpr int64_t kNF4Block = 64;    // weights per absmax
constexpr int64_t kNF4Block2 = 256;  // absmaxes per double-quantisation scale

template <typename T>
void nf4_dequantize_range(const uint8_t* codes, const int8_t* absmax_q, const float* scale,
                          float offset, T* out, int64_t n, int64_t b0, int64_t b1, bool simd);

// A clear error unless t is a contiguous CPU `type` tensor of at least min_numel elements.
void nf4_check_buffer(const at::Tensor& t, at::ScalarType type, int64_t min_numel,
                      const char* name, const char* op);

}  // namespace lorafuse
