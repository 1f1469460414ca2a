// NF4 dequantisation on CPU: packed 4-bit codes + double-quantised absmax -> a dense weight in
// the output's dtype (fp32 / bf16 / fp16), written directly (no fp32 copy of the whole weight).
//
// Contract: src/lorafuse/models/nf4.py's `dequantize_nf4`, bit for bit:
//   absmax[b] = fp32(q[b] * scale[b / 256]) + offset   (two fp32 roundings, no fused multiply-add)
//   w[i]      = round_to_T(fp32(code[nibble(i)] * absmax[i / 64]))
// `simd=false` runs the portable loop even where AVX-512 exists (the tests cover both bodies).
// One task handles whole 64-blocks: a 256-entry byte -> (high, low) value-pair table expands 32
// bytes into a 64-float stack buffer, which is scaled and stored with vector conversions.
#include "nf4.h"

#include <cstdint>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lorafuse {
namespace {

constexpr int64_t kBlock = kNF4Block;
constexpr int64_t kBlock2 = kNF4Block2;

struct PairTable {
  alignas(64) float v[256][2];  // byte -> (code[byte >> 4], code[byte & 15]): first = high
  PairTable() {
    for (int b = 0; b < 256; ++b) {
      v[b][0] = kNF4Code[b >> 4];
      v[b][1] = kNF4Code[b & 15];
    }
  }
};
const PairTable kPairs;

#ifdef LORAFUSE_NF4_AVX512
// AVX-512 body (its own target attribute: it is compiled even where the extension is built for
// AVX2, and runs only where the CPU reports AVX-512F/BW): 16 weights per step, the 16-entry
// code table held in one register (vpermps), the bf16 rounding done as torch does it
// (round to nearest even on the bits), so the result stays bit-identical. 64 weights per block:
// the 32 code bytes split into high/low nibbles and interleaved back into element order.
template <typename T>
__attribute__((target("avx512f,avx512bw"))) void dequantize_blocks_avx512(
    const uint8_t* codes, const int8_t* q, const float* scale, float offset, T* out, int64_t nb,
    int64_t b0, int64_t b1) {
  const __m512 table = _mm512_loadu_ps(kNF4Code);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = b0; b < b1 && b < nb; ++b) {
    const __m512 a = _mm512_set1_ps(nf4_block_absmax(q, scale, offset, b));
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * 32));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low4);
    const __m256i lo = _mm256_and_si256(x, low4);
    const __m256i il0 = _mm256_unpacklo_epi8(hi, lo);  // elements 0-15 | 32-47
    const __m256i il1 = _mm256_unpackhi_epi8(hi, lo);  // elements 16-31 | 48-63
    const __m128i part[4] = {_mm256_castsi256_si128(il0), _mm256_castsi256_si128(il1),
                             _mm256_extracti128_si256(il0, 1), _mm256_extracti128_si256(il1, 1)};
    T* dst = out + (b - b0) * kBlock;
    for (int k = 0; k < 4; ++k) {
      const __m512i idx = _mm512_cvtepu8_epi32(part[k]);  // 16 codes 0-15
      const __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(idx, table), a);
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(reinterpret_cast<float*>(dst) + 16 * k, v);
      } else if constexpr (std::is_same_v<T, at::BFloat16>) {
        // c10::BFloat16's round_to_nearest_even: bits + 0x7FFF + lsb, keep the high half;
        // NaN (absmax NaN only) -> 0x7FC0 as c10 does.
        const __m512i bits = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
        r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r,
                                    _mm512_set1_epi32(0x7FC0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * k), _mm512_cvtepi32_epi16(r));
      } else {  // at::Half: IEEE round to nearest even, as c10::Half's conversion
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * k),
                            _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
    }
  }
}

#endif

}  // namespace

template <typename T>
void nf4_dequantize_range(const uint8_t* codes, const int8_t* q, const float* scale, float offset,
                          T* out, int64_t n, int64_t b0, int64_t b1, bool simd) {
  int64_t b = b0;
#ifdef LORAFUSE_NF4_AVX512
  if (simd && nf4_have_avx512()) {  // whole blocks; the partial last one: the portable loop
    const int64_t full = n / kBlock;
    dequantize_blocks_avx512(codes, q, scale, offset, out, full, b0, b1);
    b = std::max(b0, std::min(b1, full));
  }
#endif
  alignas(64) float buf[kBlock];
  for (; b < b1; ++b) {
    const float a = nf4_block_absmax(q, scale, offset, b);
    const uint8_t* c = codes + b * (kBlock / 2);
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      const float* pair = kPairs.v[c[j]];
      buf[2 * j] = pair[0] * a;
      buf[2 * j + 1] = pair[1] * a;
    }
    T* dst = out + (b - b0) * kBlock;
    const int64_t len = std::min<int64_t>(kBlock, n - b * kBlock);
    if (len == kBlock) {
      for (int64_t i = 0; i < kBlock; i += kW) store_f(dst + i, fVec::loadu(buf + i));
    } else {  // the last, partial block: the codes' zero padding is not written
      for (int64_t i = 0; i < len; ++i) dst[i] = static_cast<T>(buf[i]);
    }
  }
}
template void nf4_dequantize_range<float>(const uint8_t*, const int8_t*, const float*, float,
                                          float*, int64_t, int64_t, int64_t, bool);
template void nf4_dequantize_range<at::BFloat16>(const uint8_t*, const int8_t*, const float*,
                                                 float, at::BFloat16*, int64_t, int64_t, int64_t,
                                                 bool);
template void nf4_dequantize_range<at::Half>(const uint8_t*, const int8_t*, const float*, float,
                                             at::Half*, int64_t, int64_t, int64_t, bool);

namespace {

template <typename T>
void dequantize_blocks(const uint8_t* codes, const int8_t* q, const float* scale, float offset,
                       T* out, int64_t n, bool simd) {
  const int64_t nb = (n + kBlock - 1) / kBlock;
  // 512 blocks = 32K weights per task (row_grain's size), ~16 KiB of codes.
  parallel_rows(nb, 512, [&](int64_t b0, int64_t b1) {
    nf4_dequantize_range(codes, q, scale, offset, out + b0 * kBlock, n, b0, b1, simd);
  });
}

// A clear error unless t is a contiguous CPU `type` tensor of at least min_numel elements.
void check_buffer(const at::Tensor& t, at::ScalarType type, int64_t min_numel, const char* name,
                  const char* op) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == type, op, ": ", name, " must be ", type, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK(t.numel() >= min_numel, op, ": ", name, " has ", t.numel(),
              " elements, needs at least ", min_numel);
}

}  // namespace

NF4Buffers nf4_checked_buffers(const at::Tensor& codes, const at::Tensor& absmax_q,
                               const at::Tensor& absmax_scale, const at::Tensor& absmax_offset,
                               int64_t nb, const char* op) {
  check_buffer(codes, at::kByte, nb * (kBlock / 2), "codes", op);
  check_buffer(absmax_q, at::kChar, nb, "absmax_q", op);
  check_buffer(absmax_scale, at::kFloat, (nb + kBlock2 - 1) / kBlock2, "absmax_scale", op);
  check_buffer(absmax_offset, at::kFloat, 1, "absmax_offset", op);
  return {codes.const_data_ptr<uint8_t>(), absmax_q.const_data_ptr<int8_t>(),
          absmax_scale.const_data_ptr<float>(), *absmax_offset.const_data_ptr<float>()};
}

void nf4_dequantize_forward(const at::Tensor& codes, const at::Tensor& absmax_q,
                            const at::Tensor& absmax_scale, const at::Tensor& absmax_offset,
                            at::Tensor& out, bool simd) {
  LORAFUSE_PROFILE_RANGE("nf4_dequantize");
  const char* op = "nf4_dequantize";
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous(), op,
              ": out must be a contiguous CPU tensor");
  const int64_t n = out.numel();
  const int64_t nb = (n + kBlock - 1) / kBlock;
  const auto [c, q, s, off] =
      nf4_checked_buffers(codes, absmax_q, absmax_scale, absmax_offset, nb, op);
  AT_DISPATCH_SWITCH(out.scalar_type(), "nf4_dequantize",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       dequantize_blocks(c, q, s, off, out.data_ptr<scalar_t>(), n, simd);
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       dequantize_blocks(c, q, s, off, out.data_ptr<scalar_t>(), n, simd);
                     }) AT_DISPATCH_CASE(at::kHalf, [&] {
                       dequantize_blocks(c, q, s, off, out.data_ptr<scalar_t>(), n, simd);
                     }));
}

void nf4_dequantize_columns(const at::Tensor& codes, const at::Tensor& absmax_q,
                            const at::Tensor& absmax_scale, const at::Tensor& absmax_offset,
                            int64_t cols, int64_t start, int64_t stop, at::Tensor& out,
                            bool simd) {
  LORAFUSE_PROFILE_RANGE("nf4_dequantize_columns");
  const char* op = "nf4_dequantize_columns";
  TORCH_CHECK(cols % kBlock == 0 && start % kBlock == 0 && stop % kBlock == 0, op,
              ": cols (", cols, "), start (", start, ") and stop (", stop,
              ") must be multiples of ", kBlock);
  TORCH_CHECK(0 <= start && start < stop && stop <= cols, op,
              ": need 0 <= start < stop <= cols, got ", start, ", ", stop, ", ", cols);
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() == 2 &&
                  out.size(1) == stop - start,
              op, ": out must be a contiguous (rows, ", stop - start, ") CPU tensor, got ",
              out.sizes());
  const int64_t rows = out.size(0), n = rows * cols, nb = n / kBlock;
  const auto [c, q, s, off] =
      nf4_checked_buffers(codes, absmax_q, absmax_scale, absmax_offset, nb, op);
  const int64_t width = stop - start, per_row = width / kBlock;
  const auto columns = [&](auto* dst) {
    // ~512 blocks per task, as dequantize_blocks; row i's blocks are contiguous in the codes
    parallel_rows(rows, 512 / per_row, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        const int64_t b0 = (i * cols + start) / kBlock;
        nf4_dequantize_range(c, q, s, off, dst + i * width, n, b0, b0 + per_row, simd);
      }
    });
  };
  AT_DISPATCH_SWITCH(out.scalar_type(), "nf4_dequantize_columns",
                     AT_DISPATCH_CASE(at::kFloat, [&] { columns(out.data_ptr<scalar_t>()); })
                     AT_DISPATCH_CASE(at::kBFloat16, [&] { columns(out.data_ptr<scalar_t>()); })
                     AT_DISPATCH_CASE(at::kHalf, [&] { columns(out.data_ptr<scalar_t>()); }));
}

}  // namespace lorafuse
