// The decode engine's row helpers (decode_engine.h): RMSNorm, RoPE and one query row's
// attention over its sequence's cached keys and values, fp32, in at::vec vectors of the build's
// width.
#include "decode_engine.h"

#include <cmath>

namespace lorafuse {

namespace {

float dot(const float* a, const float* b, int64_t n) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) acc = at::vec::fmadd(fVec::loadu(a + i), fVec::loadu(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void rms_norm_row(const float* x, const float* w, float* out, int64_t n, double eps) {
  // LlamaRMSNorm: variance = mean(x²) in fp32, x · rsqrt(variance + eps), then weight · that.
  const float var = dot(x, x, n) / static_cast<float>(n);
  const float r = 1.f / std::sqrt(var + static_cast<float>(eps));
  int64_t i = 0;
  const fVec rv(r);
  for (; i + kW <= n; i += kW) (fVec::loadu(w + i) * (fVec::loadu(x + i) * rv)).store(out + i);
  for (; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

void rope_row(float* x, const float* cos, const float* sin, int64_t D) {
  // x·cos + rotate_half(x)·sin, rotate_half(x) = (-x[D/2:], x[:D/2]); cos/sin repeat per half.
  const int64_t h = D / 2;
  for (int64_t d = 0; d < h; ++d) {
    const float a = x[d], b = x[d + h];
    const float lo = a * cos[d], hi = b * cos[d + h];
    const float rlo = -b * sin[d], rhi = a * sin[d + h];
    x[d] = lo + rlo;
    x[d + h] = hi + rhi;
  }
}

void attend_row(const float* q, const float* K, const float* V, int64_t start, int64_t end,
                int64_t D, double scale, double softcap, float* scores, float* out) {
  const int64_t n = end - start;
  const float cap = static_cast<float>(softcap);
  float mx = -INFINITY;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = dot(q, K + (start + t) * D, D) * static_cast<float>(scale);
    if (cap > 0.f) scores[t] = std::tanh(scores[t] / cap) * cap;  // Gemma 2's soft-capping
    mx = std::max(mx, scores[t]);
  }
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = std::exp(scores[t] - mx);
    sum += scores[t];
  }
  const float inv = 1.f / sum;
  int64_t d = 0;
  for (; d + kW <= D; d += kW) {
    fVec acc(0.f);
    for (int64_t t = 0; t < n; ++t) {
      acc = at::vec::fmadd(fVec(scores[t]), fVec::loadu(V + (start + t) * D + d), acc);
    }
    (acc * fVec(inv)).store(out + d);
  }
  for (; d < D; ++d) {
    float acc = 0.f;
    for (int64_t t = 0; t < n; ++t) acc += scores[t] * V[(start + t) * D + d];
    out[d] = acc * inv;
  }
}

}  // namespace lorafuse
