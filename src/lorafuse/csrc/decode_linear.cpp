// Linear products of a few rows, as decoding runs them (one new token per sequence):
//   y = x·Wᵀ + b,  x (M, K) with M <= kMaxRows, bf16 or fp16 x and W,
// fp32 sums, the bias added in fp32, one rounding per output (as a GEMM with fp32 accumulation).
// Decoding is bound by reading W once per token, so the products are FMA chains over W's rows
// as stored, converted in registers (dot_block): no packing, no copy of W.
// * decode_linear_forward: W dense (N, K). torch's bf16 product of one row reads the weight at
//   about half the bytes/s of its fp32 one on AVX-512 CPUs (so a bf16 model decoded slower than an
//   fp32 one); these chains, with the next rows prefetched, read it at 1.4-2x torch's bf16 rate
//   (benchmarks/bench_decode.py).
// * nf4_decode_linear: W as NF4 codes, dequantised a tile of rows at a time into a per-thread
//   buffer that stays in cache (the values nf4_dequantize_forward writes, bit for bit) and
//   multiplied there, so no dense copy of the weight is written and read back for every token:
//   4 bits of each weight read instead of 16 (benchmarks/bench_nf4.py --decode).
#include "nf4.h"

#include <vector>

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
// short rows (1-4 KiB) that the hardware prefetchers pick up late: asking ahead took one row of
// SmolLM2's gate/up weights from 10 to 15 GB/s (an ad-hoc probe). Prefetches never fault, so the
// rows after the weight's last need no check.
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

template <typename T>
void dot_rows_any(int64_t M, const float* x, const T* w, int64_t K, int64_t rows, float* out,
                  int64_t ldo, bool prefetch) {
  switch (M) {
    case 1: return dot_rows<T, 1>(x, w, K, rows, out, ldo, prefetch);
    case 2: return dot_rows<T, 2>(x, w, K, rows, out, ldo, prefetch);
    case 3: return dot_rows<T, 3>(x, w, K, rows, out, ldo, prefetch);
    case 4: return dot_rows<T, 4>(x, w, K, rows, out, ldo, prefetch);
    case 5: return dot_rows<T, 5>(x, w, K, rows, out, ldo, prefetch);
    case 6: return dot_rows<T, 6>(x, w, K, rows, out, ldo, prefetch);
    case 7: return dot_rows<T, 7>(x, w, K, rows, out, ldo, prefetch);
    default: return dot_rows<T, 8>(x, w, K, rows, out, ldo, prefetch);
  }
}

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

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_contiguous() && x.device().is_cpu(), op,
              ": x must be a contiguous CPU (M, ", K, ") tensor, got ", x.sizes(), " on ",
              x.device());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, op, ": takes 1 to ", kMaxRows,
              " rows, got ", x.size(0));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, op,
              ": x must be bfloat16 or float16, got ", x.scalar_type());
}

const void* bias_ptr(const OptTensor& bias, const at::Tensor& x, int64_t N, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                  bias->scalar_type() == x.scalar_type(),
              op, ": bias must be a contiguous (", N, ",) ", x.scalar_type(), " tensor");
  return bias->const_data_ptr();
}

}  // namespace

at::Tensor nf4_decode_linear(const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& absmax_q, const at::Tensor& absmax_scale,
                             const at::Tensor& absmax_offset, int64_t N, const OptTensor& bias) {
  const int64_t K = x.size(1), M = x.size(0);
  check_x(x, K, "nf4_decode_linear");
  TORCH_CHECK(K % kNF4Block == 0, "nf4_decode_linear: in_features must be a multiple of ",
              kNF4Block, " (each row whole 64-blocks), got ", K);
  const int64_t nb = N * K / kNF4Block;
  const char* op = "nf4_decode_linear";
  nf4_check_buffer(codes, at::kByte, nb * kNF4Block / 2, "codes", op);
  nf4_check_buffer(absmax_q, at::kChar, nb, "absmax_q", op);
  nf4_check_buffer(absmax_scale, at::kFloat, (nb + kNF4Block2 - 1) / kNF4Block2, "absmax_scale", op);
  nf4_check_buffer(absmax_offset, at::kFloat, 1, "absmax_offset", op);
  const void* bp = bias_ptr(bias, x, N, "nf4_decode_linear");
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const int8_t* q = absmax_q.const_data_ptr<int8_t>();
  const float* s = absmax_scale.const_data_ptr<float>();
  const float off = *absmax_offset.const_data_ptr<float>();
  const int64_t tile_rows = tile_rows_for(K);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "nf4_decode_linear", [&] {
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, N, tile_rows, [&](int64_t n0, int64_t n1) {
      std::vector<scalar_t> dense(std::min(tile_rows, n1 - n0) * K);
      std::vector<float> acc(M * tile_rows);
      for (int64_t t = n0; t < n1; t += tile_rows) {
        const int64_t rows = std::min(tile_rows, n1 - t);
        const int64_t b0 = t * K / kNF4Block, b1 = (t + rows) * K / kNF4Block;
        nf4_dequantize_range<scalar_t>(c, q, s, off, dense.data(), N * K, b0, b1, true);
        dot_rows_any<scalar_t>(M, xf.const_data_ptr<float>(), dense.data(), K, rows, acc.data(),
                               rows, false);  // the tile is in cache
        store_rows<scalar_t>(acc.data(), rows, static_cast<const scalar_t*>(bp), yp, M, N, t,
                             rows);
      }
    });
  });
  return y;
}

at::Tensor decode_linear_forward(const at::Tensor& x, const at::Tensor& weight,
                                 const OptTensor& bias) {
  const char* op = "decode_linear_forward";
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be (N, K), got ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1), M = x.size(0);
  check_x(x, K, op);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.device().is_cpu(),
              op, ": weight must be a contiguous CPU ", x.scalar_type(), " tensor, got ",
              weight.scalar_type(), weight.is_contiguous() ? "" : " (not contiguous)", " on ",
              weight.device());
  const void* bp = bias_ptr(bias, x, N, op);
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor y = at::empty({M, N}, x.options());
  const int64_t tile_rows = tile_rows_for(K);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "decode_linear_forward", [&] {
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, N, tile_rows, [&](int64_t n0, int64_t n1) {
      std::vector<float> acc(M * tile_rows);  // a tile's sums stay in L1
      for (int64_t t = n0; t < n1; t += tile_rows) {
        const int64_t rows = std::min(tile_rows, n1 - t);
        dot_rows_any<scalar_t>(M, xf.const_data_ptr<float>(), w + t * K, K, rows, acc.data(),
                               rows, true);
        store_rows<scalar_t>(acc.data(), rows, static_cast<const scalar_t*>(bp), yp, M, N, t,
                             rows);
      }
    });
  });
  return y;
}

}  // namespace lorafuse
