// Linear products of a few rows, as decoding runs them (one new token per sequence):
//   y = x·Wᵀ + b,  x (..., K) with M <= kMaxRows rows, bf16 or fp16 x and W,
// fp32 sums, the bias added in fp32, one rounding per output (as a GEMM with fp32 accumulation).
// Decoding is bound by reading W once per token, so the products are FMA chains over W's rows
// as stored, converted in registers (dot_block): no packing, no copy of W.
// * decode_linear_forward: W dense (N, K). torch's bf16 product of one row reads the weight at
//   about half the bytes/s of its fp32 one on AVX-512 CPUs (so a bf16 model decoded slower than an
//   fp32 one); these chains, with the next rows prefetched, read it at 1.4-2x torch's bf16 rate
//   (benchmarks/ops/decode_linear.py).
// * nf4_decode_linear: W as NF4 codes, 4 bits of each weight read instead of 16, no dense copy.
//   On AVX-512 the weights are dequantised in registers and multiplied there (nf4_dot_block):
//   dequantising a tile into a buffer and reading it back cost more than the 4x fewer bytes
//   saved (slower than torch's dense bf16 product). Elsewhere (and with simd=false, for the
//   tests) a tile of rows is dequantised into a per-thread buffer in cache and multiplied there.
//   Either way the weights multiplied are nf4_dequantize_forward's, bit for bit
//   (benchmarks/ops/nf4.py --decode).
#include "nf4.h"

#include <cmath>
#include <type_traits>
#include <vector>

#ifdef LORAFUSE_NF4_AVX512
#include <immintrin.h>
#endif

namespace lorafuse {
namespace {

constexpr int64_t kMaxRows = 8;
// Weights per tile: 32 KiB of bf16 (a dequantised NF4 tile stays in L1/L2 between its
// dequantisation and its products), and at least 8 rows, whole row blocks of dot_rows.
constexpr int64_t kTileWeights = 16384;
int64_t tile_rows_for(int64_t K) { return std::max<int64_t>(8, kTileWeights / K / 8 * 8); }

// out[m·ldo + j] = Σ_k x[m·K + k]·w[j·K + k] in fp32 for R weight rows j and M rows of x: M·R
// independent FMA chains, each vector of x and of w loaded once. prefetch: also ask for the next
// R rows, a cache line per row at a time, as these are read. Weights streamed from memory come in
// short rows (1-4 KiB) that the hardware prefetchers pick up late: asking ahead reads one row of
// SmolLM2's gate/up weights at 15 GB/s instead of 10 (benchmarks/ops/decode_linear.py times the
// whole kernel). Prefetches never fault, so the rows after the weight's last need no check.
template <typename T, int M, int R>
void dot_block(const float* x, const T* w, int64_t K, float* out, int64_t ldo, bool prefetch) {
  constexpr int64_t line = 64 / sizeof(T);  // elements per cache line
  fVec acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) acc[m][j] = fVec(0.f);
  int64_t k = 0;
  for (; k + kW <= K; k += kW) {
    if (prefetch && k % line == 0) {
      for (int j = 0; j < R; ++j) __builtin_prefetch(w + (R + j) * K + k);
    }
    fVec wv[R];
    for (int j = 0; j < R; ++j) wv[j] = load_f<T>(w + j * K + k);
    for (int m = 0; m < M; ++m) {
      const fVec xv = fVec::loadu(x + m * K + k);
      for (int j = 0; j < R; ++j) acc[m][j] = at::vec::fmadd(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < R; ++j) {
      float s = hsum(acc[m][j]);
      for (int64_t i = k; i < K; ++i) s += x[m * K + i] * static_cast<float>(w[j * K + i]);
      out[m * ldo + j] = s;
    }
  }
}

// Weight rows per dot_block for M rows of x: as many as the vector registers hold (M·R
// accumulators, R weight vectors, one of x), a power of two up to 8. Fewer independent FMA
// chains than that leave the loop bound by FMA latency (2.5x slower with one row at K = 8192).
template <int M>
constexpr int rows_per_block() {
  constexpr int regs = kW == 16 ? 32 : 16;  // AVX-512 : AVX2
  constexpr int fit = (regs - 2) / (M + 1);
  return fit >= 8 ? 8 : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
}

// dot_block over `rows` weight rows, rows_per_block<M>() at a time.
template <typename T, int M>
void dot_rows(const float* x, const T* w, int64_t K, int64_t rows, float* out, int64_t ldo,
              bool prefetch) {
  constexpr int R = rows_per_block<M>();
  int64_t n = 0;
  for (; n + R <= rows; n += R) dot_block<T, M, R>(x, w + n * K, K, out + n, ldo, prefetch);
  for (; n < rows; ++n) dot_block<T, M, 1>(x, w + n * K, K, out + n, ldo, prefetch);
}

// f(std::integral_constant<int, M>{}): the rows of x (1-8) as a template argument.
template <typename F>
void with_rows(int64_t M, const F& f) {
  switch (M) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

template <typename T>
void dot_rows_any(int64_t M, const float* x, const T* w, int64_t K, int64_t rows, float* out,
                  int64_t ldo, bool prefetch) {
  with_rows(M, [&](auto m) {
    dot_rows<T, decltype(m)::value>(x, w, K, rows, out, ldo, prefetch);
  });
}

#ifdef LORAFUSE_NF4_AVX512
#define LORAFUSE_AVX512_TARGET __attribute__((target("avx512f,avx512bw")))

// x (M, K) as fp32 in nf4_dot_block's order: per 32 columns the even ones, then the odd ones.
std::vector<float> deinterleave_x(const at::Tensor& xf) {
  const int64_t n = xf.numel();
  const float* x = xf.const_data_ptr<float>();
  std::vector<float> xs(n);
  for (int64_t i = 0; i < n; i += 32) {
    for (int64_t e = 0; e < 16; ++e) {
      xs[i + e] = x[i + 2 * e];
      xs[i + 16 + e] = x[i + 2 * e + 1];
    }
  }
  return xs;
}

// A block's 16 weight values: round_T(code[i] · absmax) widened back to fp32, the values
// nf4.cpp's dequantiser stores (the same fp32 product; bf16 rounded to nearest even on the bits
// as c10 rounds, fp16 by vcvtps2ph). A weight depends only on its code and its block's absmax,
// so rounding these 16 once per block replaces rounding each of the 64 weights. The absmax is
// finite here (nf4_decode_registers), so no value is NaN and c10's NaN rule has nothing to do.
template <typename T>
LORAFUSE_AVX512_TARGET inline __m512 scaled_code(__m512 code, float absmax) {
  const __m512 v = _mm512_mul_ps(code, _mm512_set1_ps(absmax));
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
        _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// am[i] = nf4_block_absmax(b0 + i) for i < n, 16 at a time (the scalar one's volatile round trip
// cost a fifth of the kernel); returns whether all are finite. Explicitly rounded mul and add
// (never contracted into an FMA) keep torch's two roundings.
LORAFUSE_AVX512_TARGET bool block_absmaxes(const int8_t* q, const float* scale, float offset,
                                           int64_t b0, int64_t n, float* am) {
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 off = _mm512_set1_ps(offset);
  __mmask16 finite = 0xFFFF;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const int64_t b = b0 + i, first_next = kNF4Block2 - b % kNF4Block2;  // lanes >= it: next scale
    __m512 s = _mm512_set1_ps(scale[b / kNF4Block2]);
    if (first_next < 16) {
      s = _mm512_mask_mov_ps(s, static_cast<__mmask16>(0xFFFFu << first_next),
                             _mm512_set1_ps(scale[b / kNF4Block2 + 1]));
    }
    const __m512 qf = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b))));
    const __m512 a = _mm512_add_round_ps(_mm512_mul_round_ps(qf, s, kRne), off, kRne);
    finite &= _mm512_cmp_ps_mask(_mm512_sub_ps(a, a), _mm512_setzero_ps(), _CMP_EQ_OQ);
    _mm512_storeu_ps(am + i, a);
  }
  bool ok = finite == 0xFFFF;
  for (; i < n; ++i) {
    am[i] = nf4_block_absmax(q, scale, offset, b0 + i);
    ok = ok && std::isfinite(am[i]);
  }
  return ok;
}

// dot_block from the codes: out[m·ldo + j] = Σ_k xs[m·K + k]·w[j, k] for R weight rows whose
// codes start at `codes` (K/2 bytes a row) and absmaxes at am (K/64 a row). Byte i of a block
// holds weights 2i (high nibble) and 2i+1 (low); vpermps reads only an index's low 4 bits, so
// the zero-extended bytes index the scaled code table as they are (odd weights) and shifted
// right by 4 (even ones): the even and odd weights of 32 come out in two vectors, and xs holds
// x in that order (deinterleave_x). The next R rows' codes are prefetched as dot_block does.
template <typename T, int M, int R>
LORAFUSE_AVX512_TARGET void nf4_dot_block(const float* xs, const uint8_t* codes, const float* am,
                                          int64_t K, float* out, int64_t ldo) {
  const int64_t nb = K / kNF4Block, row_bytes = K / 2;
  const __m512 code = _mm512_loadu_ps(kNF4Code);
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (b % 2 == 0) {  // a cache line holds two blocks' codes
      for (int j = 0; j < R; ++j) __builtin_prefetch(codes + (R + j) * row_bytes + b * 32);
    }
    for (int j = 0; j < R; ++j) {
      const __m512 t = scaled_code<T>(code, am[j * nb + b]);
      const uint8_t* c = codes + j * row_bytes + b * 32;
      const __m128i* c16 = reinterpret_cast<const __m128i*>(c);
      const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(c16));
      const __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(c16 + 1));
      const __m512 w[4] = {_mm512_permutexvar_ps(_mm512_srli_epi32(c0, 4), t),
                           _mm512_permutexvar_ps(c0, t),
                           _mm512_permutexvar_ps(_mm512_srli_epi32(c1, 4), t),
                           _mm512_permutexvar_ps(c1, t)};
      for (int m = 0; m < M; ++m) {
        const float* xb = xs + m * K + b * kNF4Block;
        for (int v = 0; v < 4; ++v)
          acc[m][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16 * v), w[v], acc[m][j]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) out[m * ldo + j] = _mm512_reduce_add_ps(acc[m][j]);
}

// nf4_dot_block over `rows` weight rows, rows_per_block<M>() at a time.
template <typename T, int M>
LORAFUSE_AVX512_TARGET void nf4_dot_rows(const float* xs, const uint8_t* codes, const float* am,
                                         int64_t K, int64_t rows, float* out, int64_t ldo) {
  constexpr int R = rows_per_block<M>();  // 7 (M = 3) or 3 (M = 6) rows measured no faster
  const int64_t nb = K / kNF4Block;
  int64_t n = 0;
  for (; n + R <= rows; n += R)
    nf4_dot_block<T, M, R>(xs, codes + n * K / 2, am + n * nb, K, out + n, ldo);
  for (; n < rows; ++n)
    nf4_dot_block<T, M, 1>(xs, codes + n * K / 2, am + n * nb, K, out + n, ldo);
}

template <typename T>
void nf4_dot_rows_any(int64_t M, const float* xs, const uint8_t* codes, const float* am,
                      int64_t K, int64_t rows, float* out, int64_t ldo) {
  with_rows(M, [&](auto m) {
    nf4_dot_rows<T, decltype(m)::value>(xs, codes, am, K, rows, out, ldo);
  });
}
#endif

// y[m, n0 + i] = round_T(acc[m, i] + bias[n0 + i]) for i in [0, rows).
template <typename T>
void store_rows(const float* acc, int64_t ldo, const T* bias, T* y, int64_t M, int64_t N,
                int64_t n0, int64_t rows) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t i = 0; i < rows; ++i) {
      const float b = bias ? static_cast<float>(bias[n0 + i]) : 0.f;
      y[m * N + n0 + i] = static_cast<T>(acc[m * ldo + i] + b);
    }
  }
}

// y = x·Wᵀ + b by tiles of W's rows, the tiles split over the threads: products(t, rows, acc)
// puts the fp32 sums of rows [t, t + rows) into acc (M x rows, a tile's sums stay in L1), then
// each output is rounded once with its bias.
template <typename T, typename Products>
void by_tiles(int64_t M, int64_t N, int64_t K, const T* bias, T* y, const Products& products) {
  const int64_t tile_rows = tile_rows_for(K);
  // Equal shares, not common.h's dealt chunks: dealing a ~50 µs one-row call measured 0.81x
  // (per-chunk overhead, and short runs of weight rows the prefetchers pick up late).
  at::parallel_for(0, N, tile_rows, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(M * tile_rows);
    for (int64_t t = n0; t < n1; t += tile_rows) {
      const int64_t rows = std::min(tile_rows, n1 - t);
      products(t, rows, acc.data());
      store_rows<T>(acc.data(), rows, bias, y, M, N, t, rows);
    }
  });
}

// x (..., K) as its (M, K) rows, checked: 1 to kMaxRows rows of bf16/fp16 on CPU. x keeps its
// leading dims ((batch, 1, K) as a decoder layer passes it): a reshape and a view around the call
// cost more than a small layer's product.
at::Tensor rows_of(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K && x.is_contiguous() && x.device().is_cpu(), op,
              ": x must be a contiguous CPU (..., ", K, ") tensor, got ", x.sizes(), " on ",
              x.device());
  const at::Tensor rows = x.view({-1, K});
  TORCH_CHECK(rows.size(0) >= 1 && rows.size(0) <= kMaxRows, op, ": takes 1 to ", kMaxRows,
              " rows, got ", rows.size(0));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, op,
              ": x must be bfloat16 or float16, got ", x.scalar_type());
  return rows;
}

// The (..., N) output for x (..., K).
at::Tensor output_for(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  return at::empty(sizes, x.options());
}

const void* bias_ptr(const OptTensor& bias, const at::Tensor& x, int64_t N, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                  bias->scalar_type() == x.scalar_type(),
              op, ": bias must be a contiguous (", N, ",) ", x.scalar_type(), " tensor");
  return bias->const_data_ptr();
}

// An NF4 weight (N, K) as nf4_decode_linear receives it.
struct NF4Codes {
  const uint8_t* codes;
  const int8_t* q;
  const float* scale;
  float offset;
  int64_t N, K;
};

// Rows [t, t + rows) by the tile path: dequantised into `dense` (stays in cache), multiplied.
template <typename T>
void nf4_tile_products(const NF4Codes& w, const float* x, int64_t M, int64_t t, int64_t rows,
                       std::vector<T>& dense, float* acc) {
  const int64_t K = w.K, nb = K / kNF4Block;
  dense.resize(rows * K);
  nf4_dequantize_range<T>(w.codes, w.q, w.scale, w.offset, dense.data(), w.N * K, t * nb,
                          (t + rows) * nb, true);
  dot_rows_any<T>(M, x, dense.data(), K, rows, acc, rows, false);
}

// y = x·Wᵀ + b, a tile of rows at a time per thread: from the codes in registers (AVX-512 and
// registers = true) or by the tile path. A tile with an absmax NaN or ±inf (a broken
// checkpoint) takes the tile path, which keeps c10's NaN rule.
template <typename T>
void nf4_decode(const at::Tensor& xf, const NF4Codes& w, const T* bias, T* y, bool registers) {
  const int64_t M = xf.size(0), K = w.K;
  std::vector<float> xs;
#ifdef LORAFUSE_NF4_AVX512
  if (registers) xs = deinterleave_x(xf);
#endif
  by_tiles<T>(M, w.N, K, bias, y, [&](int64_t t, int64_t rows, float* acc) {
#ifdef LORAFUSE_NF4_AVX512
    const int64_t nb = K / kNF4Block;
    thread_local std::vector<float> am;  // the tile's absmaxes
    am.resize(rows * nb);
    if (registers && block_absmaxes(w.q, w.scale, w.offset, t * nb, rows * nb, am.data())) {
      return nf4_dot_rows_any<T>(M, xs.data(), w.codes + t * K / 2, am.data(), K, rows, acc,
                                 rows);
    }
#endif
    thread_local std::vector<T> dense;  // the tile dequantised
    nf4_tile_products<T>(w, xf.const_data_ptr<float>(), M, t, rows, dense, acc);
  });
}

}  // namespace

at::Tensor nf4_decode_linear(const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& absmax_q, const at::Tensor& absmax_scale,
                             const at::Tensor& absmax_offset, int64_t N, const OptTensor& bias,
                             bool simd) {
  LORAFUSE_PROFILE_RANGE("nf4_decode_linear");
  const char* op = "nf4_decode_linear";
  const int64_t K = x.dim() >= 1 ? x.size(-1) : 0;
  const at::Tensor rows = rows_of(x, K, op);
  TORCH_CHECK(K % kNF4Block == 0, "nf4_decode_linear: in_features must be a multiple of ",
              kNF4Block, " (each row whole 64-blocks), got ", K);
  const int64_t nb = N * K / kNF4Block;
  const NF4Buffers buf = nf4_checked_buffers(codes, absmax_q, absmax_scale, absmax_offset, nb, op);
  const void* bp = bias_ptr(bias, x, N, op);
  const at::Tensor xf = rows.to(at::kFloat);
  at::Tensor y = output_for(x, N);
  const NF4Codes w{buf.codes, buf.q, buf.scale, buf.offset, N, K};
  bool registers = false;  // the AVX-512 body where the CPU has it (simd=false: the tile path)
#ifdef LORAFUSE_NF4_AVX512
  registers = simd && nf4_have_avx512();
#endif
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "nf4_decode_linear", [&] {
    nf4_decode<scalar_t>(xf, w, static_cast<const scalar_t*>(bp), y.mutable_data_ptr<scalar_t>(),
                         registers);
  });
  return y;
}

at::Tensor decode_linear_forward(const at::Tensor& x, const at::Tensor& weight,
                                 const OptTensor& bias) {
  LORAFUSE_PROFILE_RANGE("decode_linear");
  const char* op = "decode_linear_forward";
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be (N, K), got ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  const at::Tensor rows = rows_of(x, K, op);
  const int64_t M = rows.size(0);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.device().is_cpu(),
              op, ": weight must be a contiguous CPU ", x.scalar_type(), " tensor, got ",
              weight.scalar_type(), weight.is_contiguous() ? "" : " (not contiguous)", " on ",
              weight.device());
  const void* bp = bias_ptr(bias, x, N, op);
  const at::Tensor xf = rows.to(at::kFloat);
  at::Tensor y = output_for(x, N);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "decode_linear_forward", [&] {
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    by_tiles<scalar_t>(M, N, K, static_cast<const scalar_t*>(bp), y.mutable_data_ptr<scalar_t>(),
                       [&](int64_t t, int64_t rows, float* acc) {
                         dot_rows_any<scalar_t>(M, xf.const_data_ptr<float>(), w + t * K, K, rows,
                                                acc, rows, true);
                       });
  });
  return y;
}

}  // namespace lorafuse
