// The decode engine's routed experts (decode_engine.h): a mixture-of-experts MLP as transformers'
// Qwen3-MoE / Mixtral / OLMoE blocks compute it, for every row of a step.
//   route:   logits = router·x (experts values), p = softmax(logits) (LFM2-MoE: sigmoid), the
//            top_k largest p (+ the layer's expert bias where set: it steers the choice only;
//            the lower expert index first among equal ones), renormalised where norm_topk
//            (w / (Σw + route_eps)), times route_scale.
//   experts: for each chosen expert e of a row, y_e = down_e(act(gate_e·x) · (up_e·x));
//            h += s · Σ_e w_e · y_e, the sum in ascending expert order (transformers' index_add_
//            over the experts it hit), through the MLP output norm where the layer has one.
// The (row, choice) pairs are ordered by expert, so each expert's rows are one contiguous block:
// its weights are read once per step for all the rows that chose it (a prefill chunk's rows
// share most experts), as the dense projections read theirs once for the whole step.
#include "decode_engine.h"

#include <algorithm>
#include <cmath>

namespace lorafuse {

namespace {

// Rows [row0, row0 + n) of w as a weight of their own (one expert's block of a stacked weight).
WeightView rows_of(const WeightView& w, int64_t row0, int64_t n) {
  WeightView v = w;
  v.N = n;
  const int64_t off = row0 * w.K;
  switch (w.fmt) {
    case WFmt::F32: v.data = static_cast<const float*>(w.data) + off; break;
    case WFmt::BF16:
    case WFmt::F16: v.data = static_cast<const uint16_t*>(w.data) + off; break;
    case WFmt::I8: v.data = static_cast<const int8_t*>(w.data) + off; break;
    case WFmt::Q4: v.data = static_cast<const uint8_t*>(w.data) + off / 2; break;
  }
  if (w.scales != nullptr) v.scales = w.scales + row0 * (w.K / kGroup);
  return v;
}

float gate_act(float a, int64_t act) {  // torch's silu x / (1 + e^-x); Gemma's gelu-tanh
  if (act == 0) return a / (1.f + std::exp(-a));
  const float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  return 0.5f * a * (1.f + std::tanh(kBeta * (a + kKappa * (a * a * a))));
}

}  // namespace

void DecodeModel::set_moe_weight(DecodeLayer& L, const std::string& name, int64_t fmt,
                                 const at::Tensor& data, const OptTensor& scales) {
  TORCH_CHECK(c_.experts > 0, "DecodeModel: set_moe before the expert weights");
  const int64_t E = c_.experts, H = c_.hidden, I = c_.moe_intermediate;
  const int64_t N = data.size(0), K = fmt == 4 ? data.size(1) * 2 : data.size(1);
  int which;
  int64_t want_n, want_k;
  if (name == "router") {
    which = 0, want_n = E, want_k = H;
  } else if (name == "experts_gate_up") {
    which = 1, want_n = E * 2 * I, want_k = H;
  } else {
    TORCH_CHECK(name == "experts_down", "DecodeModel: unknown weight ", name);
    which = 2, want_n = E * H, want_k = I;
  }
  TORCH_CHECK(N == want_n && K == want_k, "DecodeModel: ", name, " must be (", want_n, ", ",
              want_k, "), got (", N, ", ", K, ")");
  WeightView* dst[] = {&L.router, &L.experts_gate_up, &L.experts_down};
  *dst[which] = weight_view(fmt, data, scales, N, K, "DecodeModel.set_weight");
  L.keep_moe[which][0] = data;
  L.keep_moe[which][1] = scales.has_value() ? *scales : at::Tensor();
  L.moe = true;
}

void DecodeModel::route(const Rows& rows, const DecodeLayer& L) {
  // Each row's top_k experts and weights (choice_e / choice_w), then the pairs by expert.
  const int64_t E = c_.experts, k = c_.top_k, H = c_.hidden;
#pragma omp for schedule(static)
  for (int64_t m = 0; m < rows.R; ++m) {
    thread_local std::vector<float> p;
    p.resize(E);
    gemv_rows(L.router, buf_.x.data() + m * H, 1, H, p.data(), E, 0, E);
    if (c_.sigmoid_router) {
      for (int64_t e = 0; e < E; ++e) p[e] = 1.f / (1.f + std::exp(-p[e]));
    } else {
      float top = p[0];
      for (int64_t e = 1; e < E; ++e) top = std::max(top, p[e]);
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(p[e] - top);
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    }
    const float* bias = L.expert_bias.defined() ? L.expert_bias.const_data_ptr<float>() : nullptr;
    int64_t* ce = buf_.choice_e.data() + m * k;
    float* cw = buf_.choice_w.data() + m * k;
    float chosen = 0.f;
    for (int64_t j = 0; j < k; ++j) {  // selection: k is small (2-8)
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken = taken || ce[i] == e;
        const float score = bias ? p[e] + bias[e] : p[e];
        if (!taken && (best < 0 || score > (bias ? p[best] + bias[best] : p[best]))) best = e;
      }
      ce[j] = best;
      cw[j] = p[best];
      chosen += p[best];
    }
    const float eps = static_cast<float>(c_.route_eps), scale = static_cast<float>(c_.route_scale);
    for (int64_t j = 0; j < k; ++j) {
      if (c_.norm_topk) cw[j] = cw[j] / (chosen + eps);
      if (scale != 1.f) cw[j] *= scale;
    }
  }
#pragma omp single
  {  // counting sort of the pairs by expert (stable: rows ascending within an expert)
    int64_t* off = buf_.expert_off.data();
    std::fill(off, off + E + 1, 0);
    for (int64_t i = 0; i < rows.R * k; ++i) ++off[buf_.choice_e[i] + 1];
    for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
    std::vector<int64_t> next(off, off + E);
    for (int64_t i = 0; i < rows.R * k; ++i) {
      const int64_t at = next[buf_.choice_e[i]]++;
      buf_.pair_row[at] = i / k;
      buf_.choice_pair[i] = at;
      buf_.pair_w[at] = buf_.choice_w[i];
    }
  }  // the barrier at the end of `single`: every thread sees the order
#pragma omp for schedule(static)
  for (int64_t i = 0; i < rows.R * k; ++i) {
    const float* x = buf_.x.data() + buf_.pair_row[i] * H;
    std::copy(x, x + H, buf_.xe.data() + i * H);
  }
}

void DecodeModel::project_experts(const Rows& rows, const DecodeLayer& L) {
  const int64_t E = c_.experts, H = c_.hidden, I = c_.moe_intermediate, k = c_.top_k;
  const int64_t* off = buf_.expert_off.data();
  const int64_t ti = tile_rows(I), ni = (I + ti - 1) / ti;
  // gate/up: one item per (expert, tile of its I rows), all the expert's pairs at once
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < E * ni; ++item) {
    const int64_t e = item / ni, n0 = item % ni * ti, n1 = std::min(I, n0 + ti);
    const int64_t P = off[e + 1] - off[e];
    if (P == 0) continue;
    float* g = buf_.ge.data() + off[e] * I;
    float* u = buf_.ue.data() + off[e] * I;
    const float* x = buf_.xe.data() + off[e] * H;
    gemv_rows(rows_of(L.experts_gate_up, e * 2 * I, I), x, P, H, g, I, n0, n1);
    gemv_rows(rows_of(L.experts_gate_up, e * 2 * I + I, I), x, P, H, u, I, n0, n1);
    for (int64_t m = 0; m < P; ++m)
      for (int64_t n = n0; n < n1; ++n) g[m * I + n] = gate_act(g[m * I + n], o_.act) * u[m * I + n];
  }
  // down: one item per (expert, tile of H)
  const int64_t th = tile_rows(H), nh = (H + th - 1) / th;
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < E * nh; ++item) {
    const int64_t e = item / nh, n0 = item % nh * th, n1 = std::min(H, n0 + th);
    const int64_t P = off[e + 1] - off[e];
    if (P == 0) continue;
    gemv_rows(rows_of(L.experts_down, e * H, H), buf_.ge.data() + off[e] * I, P, I,
              buf_.de.data() + off[e] * H, H, n0, n1);
  }
  // each row: Σ w·y over its choices in ascending expert order, then the residual
  const float rs = static_cast<float>(o_.residual_scale);
#pragma omp for schedule(static)
  for (int64_t m = 0; m < rows.R; ++m) {
    float* y = buf_.x.data() + m * H;  // free: the experts' inputs are in xe
    std::fill(y, y + H, 0.f);
    int64_t pairs[64];  // this row's pairs by expert: a pair's index grows with its expert
    std::copy(buf_.choice_pair.data() + m * k, buf_.choice_pair.data() + (m + 1) * k, pairs);
    std::sort(pairs, pairs + k);
    for (int64_t j = 0; j < k; ++j) {
      const float w = buf_.pair_w[pairs[j]];
      const float* d = buf_.de.data() + pairs[j] * H;
      for (int64_t n = 0; n < H; ++n) y[n] += d[n] * w;
    }
    if (L.mlp_out_norm.defined()) rms_norm_row(y, L.mlp_out_norm.const_data_ptr<float>(), y, H, c_.eps);
    float* h = buf_.h.data() + m * H;
    for (int64_t n = 0; n < H; ++n) h[n] += y[n] * rs;
  }
}

}  // namespace lorafuse
