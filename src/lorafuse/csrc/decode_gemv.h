// Products of a few fp32 rows with a frozen weight stored for decoding (decode_gemv*.cpp):
//   y[m, n] = Σ_k x[m, k] · W[n, k]   for m < M, n in [n0, n1),
// x and y fp32, W (N, K) in one of the formats below, dequantised in registers (never a dense
// copy), fp32 sums, one FMA chain per (m, n) vector lane. Decoding reads every weight once per
// step, so these are bound by the bytes of W: int8 reads a quarter of fp32's, q4 an eighth.
//
// Formats (ops/quant_linear.py holds the quantisers and the torch reference):
//   F32, BF16, F16: W as stored (the model's own tensor, no copy).
//   I8: int8 codes (N, K) and fp32 scales (N, K / 32): W = code · scale, symmetric, one scale
//       per group of 32 consecutive weights of a row (llama.cpp's q8_0 groups, fp32 scales).
//   Q4: 4-bit codes, 16 bytes per 32 weights of a row (byte i: weight i in the low nibble,
//       weight i + 16 in the high one) and fp32 scales (N, K / 32): W = (code - 8) · scale
//       (llama.cpp's q4_0 layout with an fp32 scale).
// Grouped formats need K % 32 == 0.
// The bodies exist for AVX-512 (decode_gemv_avx512.cpp), AVX2 + FMA + F16C (decode_gemv_avx2.cpp)
// and plain C++ (decode_gemv.cpp), each compiled with its own target pragma, so every build
// variant holds all three and gemv_rows picks the widest the CPU runs, once.
#pragma once

#include <cstdint>

namespace lorafuse {

enum class WFmt : int64_t { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, Q4 = 4 };

constexpr int64_t kGroup = 32;  // weights per scale of I8 and Q4

// A weight as the kernels read it (borrowed pointers; the caller keeps the tensors alive).
struct WeightView {
  WFmt fmt = WFmt::F32;
  const void* data = nullptr;      // F32 float, BF16/F16 uint16, I8 int8, Q4 uint8 codes
  const float* scales = nullptr;   // I8 / Q4: (N, K / kGroup)
  int64_t N = 0, K = 0;
};

// The most rows of x one call takes at once (more are done in blocks of this many).
constexpr int64_t kGemvMaxRows = 8;

using GemvFn = void (*)(const WeightView& w, const float* x, int64_t M, int64_t ldx, float* y,
                        int64_t ldy, int64_t n0, int64_t n1);

// y[m·ldy + n] for m < M (any M), n in [n0, n1): serial (callers split N over threads).
void gemv_rows(const WeightView& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,
               int64_t n0, int64_t n1);
// Row n of W as fp32 (K values): an embedding lookup.
void dequantize_row(const WeightView& w, int64_t n, float* out);
// Which body gemv_rows runs here: "avx512", "avx2" or "scalar"; set_gemv_isa forces one
// ("auto" restores the choice; an ISA the CPU lacks is refused): for tests of every body.
const char* gemv_isa();
void set_gemv_isa(const char* isa);

// The bodies (decode_gemv_avx512.cpp, decode_gemv_avx2.cpp; null where not x86).
GemvFn gemv_avx512();
GemvFn gemv_avx2();

}  // namespace lorafuse
