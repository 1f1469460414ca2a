// gemv_rows' AVX2 body (decode_gemv.h, decode_gemv_body.h): 8 fp32 lanes, 16 registers, up to 4
// rows of x per pass. Compiled under its own target pragma in every build variant and run only
// where the CPU has AVX2, FMA and F16C (decode_gemv.cpp decides).
#include "decode_gemv.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace lorafuse {
namespace gemv256 {

struct V {
  using F = __m256;
  static constexpr int W = 8, kRegs = 16, kMaxRows = 4;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static F from_bf16(const uint16_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static F from_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F from_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // c = 0, 1: the low nibbles of bytes 0-7, 8-15 (weights 0-15); c = 2, 3: their high nibbles
  // (weights 16-31).
  static F q4(const uint8_t* p, int c) {
    __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + (c & 1) * 8)));
    u = c < 2 ? _mm256_and_si256(u, _mm256_set1_epi32(15)) : _mm256_srli_epi32(u, 4);
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(u, _mm256_set1_epi32(8)));
  }
  static float scalar_w(uint16_t bits, bool bf16) {
    if (bf16) {
      const uint32_t u = static_cast<uint32_t>(bits) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    return _cvtsh_ss(bits);
  }
};

#include "decode_gemv_body.h"

}  // namespace gemv256

GemvFn gemv_avx2() { return &gemv256::gemv; }

}  // namespace lorafuse

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
namespace lorafuse {
GemvFn gemv_avx2() { return nullptr; }
}  // namespace lorafuse
#endif
