// One layer of the decode engine's step (decode_engine.h), called by every thread of the step's
// OpenMP region: each `omp for` deals its items (heads, (row, head) pairs, tiles of weight rows)
// and ends in the barrier the next stage needs.
#include "decode_engine.h"

#include <cmath>

namespace lorafuse {


namespace {

bool whole_qk_norm(const DecodeLayer& L, int64_t D) {  // OLMo's norms over all heads at once
  return (L.q_norm.defined() && L.q_norm.size(0) != D) ||
         (L.k_norm.defined() && L.k_norm.size(0) != D);
}

float gelu_tanh(float x) {  // torch's gelu(approximate="tanh") in fp32
  const float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2 / pi), as torch
  const float inner = kBeta * (x + kKappa * (x * x * x));
  return 0.5f * x * (1.f + std::tanh(inner));
}

const LoraRef* lora_of(const DecodeLayer& L, Proj p, int64_t adapter) {
  if (adapter < 0 || adapter >= static_cast<int64_t>(L.lora[p].size())) return nullptr;
  const LoraRef& ref = L.lora[p][adapter];
  return ref.A ? &ref : nullptr;
}

}  // namespace

void DecodeModel::lora_down(const Rows& rows, const DecodeLayer& L, const Proj* ps, int64_t n,
                            const float* in, int64_t ldin) {
  // xa[p][m] = A·in[m] (r values) for every row m whose adapter has a LoRA on projection p.
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < n * rows.R; ++item) {
    const Proj p = ps[item / rows.R];
    const int64_t m = item % rows.R;
    const LoraRef* ref = lora_of(L, p, rows.adapter[m]);
    if (ref == nullptr) continue;
    WeightView a;
    a.fmt = WFmt::F32;
    a.data = ref->A;
    a.N = ref->r;
    a.K = ref->keep_A.size(1);
    gemv_rows(a, in + m * ldin, 1, ldin, buf_.xa.data() + (p * rows.R + m) * lora_rank_, 0, 0,
              ref->r);
  }
}

void DecodeModel::lora_up(const Rows& rows, const DecodeLayer& L, Proj p, float* y, int64_t ldy,
                          int64_t n0, int64_t n1) const {
  // y[m, n] += s · B[n]·xa[p][m] for n in [n0, n1): PEFT's base(x) + s·B(A(x)).
  if (!rows.lora) return;
  for (int64_t m = 0; m < rows.R; ++m) {
    const LoraRef* ref = lora_of(L, p, rows.adapter[m]);
    if (ref == nullptr) continue;
    const float* xa = buf_.xa.data() + (p * rows.R + m) * lora_rank_;
    for (int64_t n = n0; n < n1; ++n) {
      const float* b = ref->B + n * ref->r;
      float s = 0.f;
      for (int64_t j = 0; j < ref->r; ++j) s += b[j] * xa[j];
      y[m * ldy + n] += s * ref->scale;
    }
  }
}

void DecodeModel::project_qkv(const Rows& rows, int64_t li) {
  // One item per head of q, k and v: its D rows of the weight, then (same thread) bias, LoRA,
  // q/k norm and RoPE, and for k and v the write into the row's cache slot; with norms over the
  // whole projection (OLMo) those wait for every head (qk_whole_norms).
  const DecodeLayer& L = layers_[li];
  const int64_t D = c_.head_dim, Hq = c_.heads, Hk = c_.kv_heads, R = rows.R;
  const int64_t rd = cos_[L.rope_table].size(1);  // rotated dims of a head (Phi-3: partial)
  const float* cos = cos_[L.rope_table].const_data_ptr<float>();
  const float* sin = sin_[L.rope_table].const_data_ptr<float>();
  const bool whole = whole_qk_norm(L, D);
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < Hq + 2 * Hk; ++item) {
    const Proj p = item < Hq ? kQ : item < Hq + Hk ? kK : kV;
    const int64_t head = p == kQ ? item : p == kK ? item - Hq : item - Hq - Hk;
    float* y = p == kQ ? buf_.q.data() : p == kK ? buf_.k.data() : buf_.v.data();
    const int64_t ld = (p == kQ ? Hq : Hk) * D, n0 = head * D, n1 = n0 + D;
    gemv_rows(L.w[p], buf_.x.data(), R, c_.hidden, y, ld, n0, n1);
    add_bias(L.bias[p], y, ld, R, n0, n1);
    lora_up(rows, L, p, y, ld, n0, n1);
    if (whole) continue;
    for (int64_t m = 0; m < R; ++m) {
      float* hv = y + m * ld + n0;
      const at::Tensor& norm = p == kQ ? L.q_norm : L.k_norm;
      if (p != kV && norm.defined()) rms_norm_row(hv, norm.const_data_ptr<float>(), hv, D, c_.eps);
      if (p != kV && L.rope) rope_row(hv, cos + rows.pos[m] * rd, sin + rows.pos[m] * rd, rd);
      if (p != kQ) {
        float* dst = kv_at(rows.slot[m], li, p == kK ? 0 : 1, head) + rows.pos[m] * D;
        std::copy(hv, hv + D, dst);
      }
    }
  }
  if (whole) qk_whole_norms(rows, li);
}

void DecodeModel::qk_whole_norms(const Rows& rows, int64_t li) {
  // OLMo 2/3: q_norm over all of a row's q heads, k_norm over its k heads, then RoPE per head
  // and the cache writes; one item per row (after project_qkv's barrier).
  const DecodeLayer& L = layers_[li];
  const int64_t D = c_.head_dim, Hq = c_.heads, Hk = c_.kv_heads, rd = cos_[L.rope_table].size(1);
  const float* cos = cos_[L.rope_table].const_data_ptr<float>();
  const float* sin = sin_[L.rope_table].const_data_ptr<float>();
#pragma omp for schedule(dynamic, 1)
  for (int64_t m = 0; m < rows.R; ++m) {
    float* q = buf_.q.data() + m * Hq * D;
    float* k = buf_.k.data() + m * Hk * D;
    const float* v = buf_.v.data() + m * Hk * D;
    if (L.q_norm.defined()) rms_norm_row(q, L.q_norm.const_data_ptr<float>(), q, Hq * D, c_.eps);
    if (L.k_norm.defined()) rms_norm_row(k, L.k_norm.const_data_ptr<float>(), k, Hk * D, c_.eps);
    const int64_t p = rows.pos[m];
    for (int64_t h = 0; h < Hq && L.rope; ++h) rope_row(q + h * D, cos + p * rd, sin + p * rd, rd);
    for (int64_t h = 0; h < Hk; ++h) {
      if (L.rope) rope_row(k + h * D, cos + p * rd, sin + p * rd, rd);
      std::copy(k + h * D, k + (h + 1) * D, kv_at(rows.slot[m], li, 0, h) + p * D);
      std::copy(v + h * D, v + (h + 1) * D, kv_at(rows.slot[m], li, 1, h) + p * D);
    }
  }
}

void DecodeModel::attention(const Rows& rows, int64_t li) {
  const DecodeLayer& L = layers_[li];
  const int64_t D = c_.head_dim, Hq = c_.heads, group = c_.heads / c_.kv_heads;
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < rows.R * Hq; ++item) {
    const int64_t m = item / Hq, head = item % Hq, p = rows.pos[m];
    const int64_t start = L.window > 0 ? std::max<int64_t>(0, p - L.window + 1) : 0;
    thread_local std::vector<float> scores;
    if (static_cast<int64_t>(scores.size()) < p + 1) scores.resize(p + 1);
    attend_row(buf_.q.data() + (m * Hq + head) * D, kv_at(rows.slot[m], li, 0, head / group),
               kv_at(rows.slot[m], li, 1, head / group), start, p + 1, D, c_.attn_scale,
               o_.attn_softcap, scores.data(), buf_.att.data() + (m * Hq + head) * D);
  }
}

void DecodeModel::project_residual(const Rows& rows, const DecodeLayer& L, Proj p,
                                   const float* in, int64_t ldin, const at::Tensor& out_norm) {
  // h += s · in·Wᵀ (+ bias + LoRA), by tiles of W's rows, through x (free at this point); with
  // an output norm (Gemma 2/3, OLMo) h += s · norm(y) once every tile of a row is done.
  const int64_t N = c_.hidden, R = rows.R, tile = tile_rows(N), n_tiles = (N + tile - 1) / tile;
  const float rs = static_cast<float>(o_.residual_scale);
  const bool normed = out_norm.defined();
  float* y = buf_.x.data();
  float* h = buf_.h.data();
#pragma omp for schedule(dynamic, 1)
  for (int64_t t = 0; t < n_tiles; ++t) {
    const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
    gemv_rows(L.w[p], in, R, ldin, y, N, n0, n1);
    add_bias(L.bias[p], y, N, R, n0, n1);
    lora_up(rows, L, p, y, N, n0, n1);
    if (normed) continue;
    for (int64_t m = 0; m < R; ++m)
      for (int64_t n = n0; n < n1; ++n) h[m * N + n] += y[m * N + n] * rs;
  }
  if (!normed) return;
#pragma omp for schedule(static)
  for (int64_t m = 0; m < R; ++m) {
    float* ym = y + m * N;
    rms_norm_row(ym, out_norm.const_data_ptr<float>(), ym, N, c_.eps);
    for (int64_t n = 0; n < N; ++n) h[m * N + n] += ym[n] * rs;
  }
}

void DecodeModel::norm_rows(const Rows& rows, const at::Tensor& w) {
  // x = norm(h) per row, or x = h where the block has no input norm (OLMo)
  const int64_t H = c_.hidden;
#pragma omp for schedule(static)
  for (int64_t m = 0; m < rows.R; ++m) {
    const float* h = buf_.h.data() + m * H;
    float* x = buf_.x.data() + m * H;
    if (w.defined()) {
      rms_norm_row(h, w.const_data_ptr<float>(), x, H, c_.eps);
    } else {
      std::copy(h, h + H, x);
    }
  }
}

void DecodeModel::project_mlp(const Rows& rows, const DecodeLayer& L) {
  // g = silu(x·Wgᵀ) · (x·Wuᵀ), gate and up rows of one tile in the same thread.
  const int64_t N = c_.intermediate, R = rows.R, tile = tile_rows(N);
  const int64_t n_tiles = (N + tile - 1) / tile;
  float* g = buf_.g.data();
  float* u = buf_.u.data();
#pragma omp for schedule(dynamic, 1)
  for (int64_t t = 0; t < n_tiles; ++t) {
    const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
    gemv_rows(L.w[kGate], buf_.x.data(), R, c_.hidden, g, N, n0, n1);
    gemv_rows(L.w[kUp], buf_.x.data(), R, c_.hidden, u, N, n0, n1);
    add_bias(L.bias[kGate], g, N, R, n0, n1);
    add_bias(L.bias[kUp], u, N, R, n0, n1);
    lora_up(rows, L, kGate, g, N, n0, n1);
    lora_up(rows, L, kUp, u, N, n0, n1);
    for (int64_t m = 0; m < R; ++m) {
      for (int64_t n = n0; n < n1; ++n) {
        const float a = g[m * N + n];
        // torch's silu: x / (1 + e^-x); Gemma: gelu_pytorch_tanh
        const float act = o_.act == 1 ? gelu_tanh(a) : a / (1.f + std::exp(-a));
        g[m * N + n] = act * u[m * N + n];
      }
    }
  }
}

void DecodeModel::layer_step(const Rows& rows, int64_t li) {
  const DecodeLayer& L = layers_[li];
  const int64_t H = c_.hidden, qd = c_.heads * c_.head_dim;
  static const Proj kQKV[] = {kQ, kK, kV}, kOut[] = {kO}, kGU[] = {kGate, kUp}, kDn[] = {kDown};
  if (L.conv_w.defined()) {  // LFM2's short convolution in attention's place
    conv_step(rows, li);
  } else {
    norm_rows(rows, L.in_norm);
    if (rows.lora) lora_down(rows, L, kQKV, 3, buf_.x.data(), H);
    project_qkv(rows, li);
    attention(rows, li);
    if (rows.lora) lora_down(rows, L, kOut, 1, buf_.att.data(), qd);
    project_residual(rows, L, kO, buf_.att.data(), qd, L.attn_out_norm);
  }
  norm_rows(rows, L.mlp_norm);
  if (L.moe) {  // routed experts (no LoRA on them: decode/families.py refuses such a model)
    route(rows, L);
    project_experts(rows, L);
    return;
  }
  if (rows.lora) lora_down(rows, L, kGU, 2, buf_.x.data(), H);
  project_mlp(rows, L);
  if (rows.lora) lora_down(rows, L, kDn, 1, buf_.g.data(), c_.intermediate);
  project_residual(rows, L, kDown, buf_.g.data(), c_.intermediate, L.mlp_out_norm);
}

}  // namespace lorafuse
