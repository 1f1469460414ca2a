// gemv_rows (decode_gemv.h): the plain C++ body, the choice of body by CPU, and the op
// quant_linear_forward that tests and ops/quant_linear.py call (x·Wᵀ for any rows, threaded).
#include "decode_gemv.h"

#include "common.h"

#include <cstring>
#include <string>

namespace lorafuse {
namespace {

float weight_at(const WeightView& w, int64_t n, int64_t k) {
  const int64_t i = n * w.K + k;
  switch (w.fmt) {
    case WFmt::F32: return static_cast<const float*>(w.data)[i];
    case WFmt::BF16: {
      uint16_t b = static_cast<const uint16_t*>(w.data)[i];
      return static_cast<float>(c10::BFloat16(b, c10::BFloat16::from_bits()));
    }
    case WFmt::F16: {
      uint16_t b = static_cast<const uint16_t*>(w.data)[i];
      return static_cast<float>(c10::Half(b, c10::Half::from_bits()));
    }
    case WFmt::I8: {
      const float s = w.scales[n * (w.K / kGroup) + k / kGroup];
      return static_cast<float>(static_cast<const int8_t*>(w.data)[i]) * s;
    }
    case WFmt::Q4: {
      const uint8_t* g = static_cast<const uint8_t*>(w.data) + (n * w.K + k / kGroup * kGroup) / 2;
      const int64_t j = k % kGroup;
      const int code = j < 16 ? (g[j] & 15) : (g[j - 16] >> 4);
      return static_cast<float>(code - 8) * w.scales[n * (w.K / kGroup) + k / kGroup];
    }
  }
  return 0.f;
}

// The portable body: one fp32 sum per output, in k order (aarch64 and the tests of the others).
void gemv_scalar(const WeightView& w, const float* x, int64_t M, int64_t ldx, float* y,
                 int64_t ldy, int64_t n0, int64_t n1) {
  std::vector<float> row(w.K);
  for (int64_t n = n0; n < n1; ++n) {
    dequantize_row(w, n, row.data());
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < w.K; ++k) s += x[m * ldx + k] * row[k];
      y[m * ldy + n] = s;
    }
  }
}

struct Choice {
  GemvFn fn;
  const char* name;
};

Choice best() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (gemv_avx512() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return {gemv_avx512(), "avx512"};
  }
  if (gemv_avx2() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return {gemv_avx2(), "avx2"};
  }
#endif
  return {&gemv_scalar, "scalar"};
}

Choice& chosen() {
  static Choice c = best();
  return c;
}

}  // namespace

void dequantize_row(const WeightView& w, int64_t n, float* out) {
  if (w.fmt == WFmt::F32) {
    std::memcpy(out, static_cast<const float*>(w.data) + n * w.K, w.K * sizeof(float));
    return;
  }
  for (int64_t k = 0; k < w.K; ++k) out[k] = weight_at(w, n, k);
}

void gemv_rows(const WeightView& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,
               int64_t n0, int64_t n1) {
  chosen().fn(w, x, M, ldx, y, ldy, n0, n1);
}

const char* gemv_isa() { return chosen().name; }

void set_gemv_isa(const char* isa) {
  const std::string want(isa);
  const Choice top = best();
  if (want == "auto") {
    chosen() = top;
  } else if (want == "scalar") {
    chosen() = {&gemv_scalar, "scalar"};
  } else if (want == "avx2") {
    TORCH_CHECK(std::string(top.name) != "scalar" && gemv_avx2(), "this CPU has no AVX2 body");
    chosen() = {gemv_avx2(), "avx2"};
  } else {
    TORCH_CHECK(want == "avx512", "set_gemv_isa: one of auto, avx512, avx2, scalar; got ", want);
    TORCH_CHECK(std::string(top.name) == "avx512", "this CPU has no AVX-512 body");
    chosen() = top;
  }
}

WeightView weight_view(int64_t fmt, const at::Tensor& data, const OptTensor& scales, int64_t N,
                       int64_t K, const char* op) {
  TORCH_CHECK(fmt >= 0 && fmt <= 4, op, ": unknown weight format ", fmt);
  WeightView w;
  w.fmt = static_cast<WFmt>(fmt);
  w.N = N;
  w.K = K;
  static const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf, at::kChar,
                                          at::kByte};
  const int64_t numel = w.fmt == WFmt::Q4 ? N * K / 2 : N * K;
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous() && data.scalar_type() == dtypes[fmt] &&
                  data.numel() == numel,
              op, ": weight data must be a contiguous CPU ", dtypes[fmt], " tensor of ", numel,
              " elements, got ", data.scalar_type(), " ", data.sizes());
  w.data = data.const_data_ptr();
  if (w.fmt == WFmt::I8 || w.fmt == WFmt::Q4) {
    TORCH_CHECK(K % kGroup == 0, op, ": a grouped weight needs K % ", kGroup, " == 0, got ", K);
    TORCH_CHECK(scales.has_value() && scales->defined() && scales->is_contiguous() &&
                    scales->scalar_type() == at::kFloat && scales->numel() == N * K / kGroup,
                op, ": scales must be a contiguous fp32 tensor of ", N * K / kGroup, " elements");
    w.scales = scales->const_data_ptr<float>();
  }
  return w;
}

at::Tensor quant_linear_forward(const at::Tensor& x, int64_t fmt, const at::Tensor& data,
                                const OptTensor& scales, int64_t N) {
  LORAFUSE_PROFILE_RANGE("quant_linear");
  const char* op = "quant_linear_forward";
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), op, ": x must be a 2-D CPU tensor");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  const WeightView w = weight_view(fmt, data, scales, N, K, op);
  at::Tensor y = at::empty({M, N}, xf.options());
  const float* xp = xf.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { gemv_rows(w, xp, M, K, yp, N, n0, n1); });
  return y;
}

}  // namespace lorafuse
