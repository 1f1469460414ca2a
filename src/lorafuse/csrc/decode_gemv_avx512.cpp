// gemv_rows' AVX-512 body (decode_gemv.h, decode_gemv_body.h): 16 fp32 lanes, 32 registers, up
// to 8 rows of x per pass. Compiled under its own target pragma in every build variant and run
// only where the CPU has AVX-512F/BW/VL/DQ (decode_gemv.cpp decides).
#include "decode_gemv.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#endif

namespace lorafuse {
namespace gemv512 {

struct V {
  using F = __m512;
  static constexpr int W = 16, kRegs = 32, kMaxRows = 8;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static F from_bf16(const uint16_t* p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  static F from_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F from_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // c = 0: the low nibbles of the 16 bytes (weights 0-15), c = 1: the high ones (16-31).
  static F q4(const uint8_t* p, int c) {
    __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    u = c == 0 ? _mm512_and_si512(u, _mm512_set1_epi32(15)) : _mm512_srli_epi32(u, 4);
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(8)));
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

}  // namespace gemv512

GemvFn gemv_avx512() { return &gemv512::gemv; }

}  // namespace lorafuse

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
namespace lorafuse {
GemvFn gemv_avx512() { return nullptr; }
}  // namespace lorafuse
#endif
