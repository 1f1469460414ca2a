// NF4 linear products of a few rows, as decoding runs them (one new token per sequence):
//   y = x·Wᵀ + b,  x (M, K) with M <= kMaxRows, W (N, K) as NF4 codes, bf16 or fp16 x,
// fp32 sums, the bias added in fp32, one rounding per output (as a GEMM with fp32 accumulation).
// W is dequantised a tile of rows at a time into a per-thread buffer that stays in cache (the
// values nf4_dequantize_forward writes, bit for bit) and multiplied there, so no dense copy of
// the weight is written and read back for every token: decoding reads each weight once per
// token, and 4 bits of it instead of 16 (benchmarks/bench_nf4.py --decode).
#include "nf4.h"

#include <vector>

namespace lorafuse {
namespace {

constexpr int64_t kMaxRows = 8;
// Weights per dequantised NF4 tile: 32 KiB of bf16 stays in L1/L2 between its dequantisation
// and its products.
constexpr int64_t kTileWeights = 16384;

// out[m·ldo + j] = Σ_k x[m·K + k]·w[j·K + k] in fp32 for R weight rows j and M rows of x: M·R
// independent FMA chains, each vector of x and of w loaded once.
template <typename T, int M, int R>
void dot_block(const float* x, const T* w, int64_t K, float* out, int64_t ldo) {
  fVec acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) acc[m][j] = fVec(0.f);
  int64_t k = 0;
  for (; k + kW <= K; k += kW) {
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

// dot_block over `rows` weight rows, four at a time.
template <typename T, int M>
void dot_rows(const float* x, const T* w, int64_t K, int64_t rows, float* out, int64_t ldo) {
  int64_t n = 0;
  for (; n + 4 <= rows; n += 4) dot_block<T, M, 4>(x, w + n * K, K, out + n, ldo);
  for (; n < rows; ++n) dot_block<T, M, 1>(x, w + n * K, K, out + n, ldo);
}

template <typename T>
void dot_rows_any(int64_t M, const float* x, const T* w, int64_t K, int64_t rows, float* out,
                  int64_t ldo) {
  switch (M) {
    case 1: return dot_rows<T, 1>(x, w, K, rows, out, ldo);
    case 2: return dot_rows<T, 2>(x, w, K, rows, out, ldo);
    case 3: return dot_rows<T, 3>(x, w, K, rows, out, ldo);
    case 4: return dot_rows<T, 4>(x, w, K, rows, out, ldo);
    case 5: return dot_rows<T, 5>(x, w, K, rows, out, ldo);
    case 6: return dot_rows<T, 6>(x, w, K, rows, out, ldo);
    case 7: return dot_rows<T, 7>(x, w, K, rows, out, ldo);
    default: return dot_rows<T, 8>(x, w, K, rows, out, ldo);
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
              ": x must be a contiguous CPU (M, ", K, ") tensor, got ", x.sizes());
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
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() >= nb * kNF4Block / 2,
              "nf4_decode_linear: codes must be contiguous uint8 with ", nb * kNF4Block / 2,
              " bytes");
  TORCH_CHECK(absmax_q.scalar_type() == at::kChar && absmax_q.is_contiguous() &&
                  absmax_q.numel() >= nb,
              "nf4_decode_linear: absmax_q must be contiguous int8 with ", nb, " values");
  TORCH_CHECK(absmax_scale.scalar_type() == at::kFloat && absmax_scale.is_contiguous() &&
                  absmax_offset.scalar_type() == at::kFloat && absmax_offset.numel() >= 1,
              "nf4_decode_linear: absmax_scale / absmax_offset must be float32");
  const void* bp = bias_ptr(bias, x, N, "nf4_decode_linear");
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const int8_t* q = absmax_q.const_data_ptr<int8_t>();
  const float* s = absmax_scale.const_data_ptr<float>();
  const float off = *absmax_offset.const_data_ptr<float>();
  const int64_t tile_rows = std::max<int64_t>(1, kTileWeights / K);
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
                               rows);
        store_rows<scalar_t>(acc.data(), rows, static_cast<const scalar_t*>(bp), yp, M, N, t,
                             rows);
      }
    });
  });
  return y;
}

}  // namespace lorafuse
