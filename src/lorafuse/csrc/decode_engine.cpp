// The decode engine's step (decode_engine.h): every layer for R rows in one OpenMP region, the
// work of each stage dealt in tiles from `omp for` loops whose ends are the only barriers.
// Per layer (decode_layer.cpp): RMSNorm (where the family has one before attention); Q/K/V by
// heads (bias, LoRA, per-head q/k norms, RoPE and the cache writes in the tile that made the
// head; whole-projection q/k norms in a pass by rows after them); attention by (row, head); O
// with the residual (through an output norm where the family has one); RMSNorm; gate/up with
// act(gate)·up in the tile; down with the residual (likewise). LoRA adds one rank-r pass per
// input (the rows' own adapters' A) before the projections read it. Embedding scale, residual
// scale and the logits' divisor / soft-cap are the family's options (DecodeOptions).
#include "decode_engine.h"

#include <cmath>

namespace lorafuse {


namespace {

void grow(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

const char* const kProjNames[kProjs] = {"q", "k", "v", "o", "gate", "up", "down", "conv_in",
                                         "conv_out"};

int proj_index(const std::string& name) {
  for (int p = 0; p < kProjs; ++p)
    if (name == kProjNames[p]) return p;
  return -1;
}

}  // namespace

void StepBuffers::fit(const DecodeConfig& c, int64_t R, int64_t L, int64_t lora_cols) {
  const int64_t qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  grow(h, R * c.hidden);
  grow(x, R * std::max(c.hidden, qd));
  grow(q, R * qd);
  grow(k, R * kvd);
  grow(v, R * kvd);
  grow(att, R * qd);
  grow(g, R * c.intermediate);
  grow(u, R * c.intermediate);
  grow(xa, kProjs * R * std::max<int64_t>(1, lora_cols));
  grow(xl, L * c.hidden);
  if (c.conv_len > 0) grow(bcx, R * 3 * c.hidden);
  if (c.experts == 0) return;
  const int64_t P = R * c.top_k;  // (row, choice) pairs
  choice_e.resize(std::max<int64_t>(choice_e.size(), P));
  pair_row.resize(std::max<int64_t>(pair_row.size(), P));
  choice_pair.resize(std::max<int64_t>(choice_pair.size(), P));
  expert_off.resize(c.experts + 1);
  grow(choice_w, P);
  grow(pair_w, P);
  grow(xe, P * c.hidden);
  grow(ge, P * c.moe_intermediate);
  grow(ue, P * c.moe_intermediate);
  grow(de, P * c.hidden);
}

DecodeModel::DecodeModel(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t intermediate, int64_t vocab, int64_t layers, double eps,
                         double attn_scale, at::Tensor cos, at::Tensor sin)
    : c_{hidden, heads, kv_heads, head_dim, intermediate, vocab, layers, eps, attn_scale} {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0 &&
                  layers > 0 && hidden > 0 && intermediate > 0 && vocab > 0,
              "DecodeModel: bad shapes");
  set_rope(cos, sin, 0);
  layers_.resize(layers);
}

void DecodeModel::set_rope(const at::Tensor& cos, const at::Tensor& sin, int64_t table) {
  TORCH_CHECK(table >= 0 && table < 16, "DecodeModel.set_rope: table ", table, " out of range");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(1) <= c_.head_dim && t->size(1) % 2 == 0 &&
                    t->size(1) > 0 && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->size(0) == cos.size(0) && t->size(1) == cos.size(1),
                "DecodeModel: cos/sin must be contiguous fp32 (positions, rotary), rotary even "
                "and <= ", c_.head_dim);
  }
  if (static_cast<int64_t>(cos_.size()) <= table) {
    cos_.resize(table + 1);
    sin_.resize(table + 1);
  }
  cos_[table] = cos;
  sin_[table] = sin;
}

void DecodeModel::set_options(int64_t act, double embed_scale, double residual_scale,
                              double attn_softcap, double logit_divisor, double logit_softcap) {
  TORCH_CHECK((act == 0 || act == 1) && attn_softcap >= 0 && logit_softcap >= 0 &&
                  logit_divisor != 0, "DecodeModel.set_options: bad options");
  o_ = {act, embed_scale, residual_scale, attn_softcap, logit_divisor, logit_softcap};
}

void DecodeModel::set_moe(int64_t experts, int64_t intermediate, int64_t top_k, bool norm_topk,
                          bool sigmoid, double norm_eps, double scale) {
  TORCH_CHECK(experts > 0 && intermediate > 0 && top_k > 0 && top_k <= experts && top_k <= 64,
              "DecodeModel.set_moe: bad experts / intermediate / top_k (1 to 64)");
  c_.experts = experts;
  c_.moe_intermediate = intermediate;
  c_.top_k = top_k;
  c_.norm_topk = norm_topk;
  c_.sigmoid_router = sigmoid;
  c_.route_eps = norm_eps;
  c_.route_scale = scale;
}

void DecodeModel::set_weight(int64_t layer, const std::string& name, int64_t fmt,
                             const at::Tensor& data, const OptTensor& scales) {
  const int64_t N = data.size(0), K = fmt == 4 ? data.size(1) * 2 : data.size(1);
  const int64_t qd = c_.heads * c_.head_dim, kvd = c_.kv_heads * c_.head_dim;
  if (layer < 0) {
    TORCH_CHECK(name == "embed" || name == "lm_head", "DecodeModel: unknown weight ", name);
    TORCH_CHECK(N == c_.vocab && K == c_.hidden, "DecodeModel: ", name, " must be (vocab, hidden)");
    WeightView w = weight_view(fmt, data, scales, N, K, "DecodeModel.set_weight");
    at::Tensor* keep = name == "embed" ? keep_embed_ : keep_head_;
    keep[0] = data;
    keep[1] = scales.has_value() ? *scales : at::Tensor();
    (name == "embed" ? embed_ : lm_head_) = w;
    return;
  }
  TORCH_CHECK(layer < c_.layers, "DecodeModel: layer ", layer, " out of range");
  if (name == "router" || name.rfind("experts_", 0) == 0) {
    set_moe_weight(layers_[layer], name, fmt, data, scales);
    return;
  }
  const int p = proj_index(name);
  TORCH_CHECK(p >= 0, "DecodeModel: unknown projection ", name);
  const int64_t want[kProjs][2] = {{qd, c_.hidden}, {kvd, c_.hidden}, {kvd, c_.hidden},
                                   {c_.hidden, qd}, {c_.intermediate, c_.hidden},
                                   {c_.intermediate, c_.hidden}, {c_.hidden, c_.intermediate},
                                   {3 * c_.hidden, c_.hidden}, {c_.hidden, c_.hidden}};
  TORCH_CHECK(N == want[p][0] && K == want[p][1], "DecodeModel: ", name, " must be (", want[p][0],
              ", ", want[p][1], "), got (", N, ", ", K, ")");
  DecodeLayer& L = layers_[layer];
  L.w[p] = weight_view(fmt, data, scales, N, K, "DecodeModel.set_weight");
  L.keep[p][0] = data;
  L.keep[p][1] = scales.has_value() ? *scales : at::Tensor();
}

void DecodeModel::set_vector(int64_t layer, const std::string& name, const at::Tensor& v) {
  const at::Tensor f = v.to(at::kFloat).contiguous();
  TORCH_CHECK(f.dim() == 1, "DecodeModel: ", name, " must be 1-D");
  const int64_t qd = c_.heads * c_.head_dim, kvd = c_.kv_heads * c_.head_dim;
  if (layer < 0) {
    TORCH_CHECK(name == "norm" && f.size(0) == c_.hidden, "DecodeModel: bad vector ", name);
    norm_ = f;
    return;
  }
  TORCH_CHECK(layer < c_.layers, "DecodeModel: layer ", layer, " out of range");
  DecodeLayer& L = layers_[layer];
  struct Slot {
    const char* name;
    at::Tensor* dst;
    int64_t n;
  } slots[] = {{"in_norm", &L.in_norm, c_.hidden},  {"attn_out_norm", &L.attn_out_norm, c_.hidden},
               {"mlp_norm", &L.mlp_norm, c_.hidden}, {"mlp_out_norm", &L.mlp_out_norm, c_.hidden},
               {"q_norm", &L.q_norm, c_.head_dim},  {"k_norm", &L.k_norm, c_.head_dim},
               {"q_bias", &L.bias[kQ], qd},         {"k_bias", &L.bias[kK], kvd},
               {"v_bias", &L.bias[kV], kvd},        {"o_bias", &L.bias[kO], c_.hidden},
               {"gate_bias", &L.bias[kGate], c_.intermediate},
               {"up_bias", &L.bias[kUp], c_.intermediate},
               {"down_bias", &L.bias[kDown], c_.hidden},
               {"conv_in_bias", &L.bias[kConvIn], 3 * c_.hidden},
               {"conv_out_bias", &L.bias[kConvOut], c_.hidden},
               {"expert_bias", &L.expert_bias, c_.experts}};
  for (Slot& s : slots) {
    if (name == s.name) {
      // q/k norms: one head's (Qwen3, Gemma 3) or the whole projection's (OLMo 2/3)
      const int64_t whole = name == "q_norm" ? qd : name == "k_norm" ? kvd : s.n;
      TORCH_CHECK(f.size(0) == s.n || f.size(0) == whole, "DecodeModel: ", name, " must have ",
                  s.n, s.n == whole ? "" : " or " + std::to_string(whole), " values");
      *s.dst = f;
      return;
    }
  }
  TORCH_CHECK(false, "DecodeModel: unknown vector ", name);
}

void DecodeModel::set_layer(int64_t layer, bool rope, int64_t window, int64_t rope_table) {
  TORCH_CHECK(layer >= 0 && layer < c_.layers && window >= 0 && rope_table >= 0 &&
                  rope_table < static_cast<int64_t>(cos_.size()) && cos_[rope_table].defined(),
              "DecodeModel.set_layer: bad args (set the layer's rope table first)");
  layers_[layer].rope = rope;
  layers_[layer].window = window;
  layers_[layer].rope_table = rope_table;
}

void DecodeModel::set_lora(int64_t layer, const std::string& proj, int64_t adapter,
                           const at::Tensor& A, const at::Tensor& B, double scale) {
  const int p = proj_index(proj);
  TORCH_CHECK(layer >= 0 && layer < c_.layers && p >= 0 && adapter >= 0,
              "DecodeModel.set_lora: bad layer / projection / adapter");
  const WeightView& w = layers_[layer].w[p];
  TORCH_CHECK(w.data != nullptr, "DecodeModel.set_lora: set the weight of ", proj, " first");
  const int64_t r = A.size(0);
  TORCH_CHECK(A.dim() == 2 && B.dim() == 2 && A.size(1) == w.K && B.size(0) == w.N &&
                  B.size(1) == r && A.scalar_type() == at::kFloat &&
                  B.scalar_type() == at::kFloat && A.is_contiguous() && B.is_contiguous(),
              "DecodeModel.set_lora: A (r, ", w.K, ") and B (", w.N, ", r) must be contiguous "
              "fp32, got ", A.sizes(), " and ", B.sizes());
  auto& refs = layers_[layer].lora[p];
  if (static_cast<int64_t>(refs.size()) <= adapter) refs.resize(adapter + 1);
  refs[adapter] = {A.const_data_ptr<float>(), B.const_data_ptr<float>(), r,
                   static_cast<float>(scale), A, B};
  lora_rank_ = std::max(lora_rank_, r);
}

void DecodeModel::clear_lora() {
  for (DecodeLayer& L : layers_)
    for (auto& refs : L.lora) refs.clear();
  lora_rank_ = 0;
}

void DecodeModel::reserve(int64_t slot, int64_t tokens) {
  TORCH_CHECK(slot >= 0 && slot < (1 << 20) && tokens >= 0, "DecodeModel.reserve: bad slot");
  if (slot >= static_cast<int64_t>(kv_.size())) kv_.resize(slot + 1);
  at::Tensor& t = kv_[slot];
  const int64_t cap = capacity(slot);
  if (cap >= tokens) return;
  const int64_t grown = std::max<int64_t>({tokens, 2 * cap, 16});
  at::Tensor n = at::zeros({c_.layers, 2, c_.kv_heads, grown, c_.head_dim}, at::kFloat);
  if (cap > 0) n.narrow(3, 0, cap).copy_(t);
  t = n;
  if (conv_layers_ == 0) return;
  if (slot >= static_cast<int64_t>(conv_.size())) conv_.resize(slot + 1);
  at::Tensor c = at::zeros({conv_layers_, grown, c_.hidden}, at::kFloat);
  if (cap > 0) c.narrow(1, 0, cap).copy_(conv_[slot]);
  conv_[slot] = c;
}

void DecodeModel::copy_slot(int64_t src, int64_t dst, int64_t tokens) {
  TORCH_CHECK(capacity(src) >= tokens && src != dst, "DecodeModel.copy_slot: bad slots");
  reserve(dst, tokens);
  kv_[dst].narrow(3, 0, tokens).copy_(kv_[src].narrow(3, 0, tokens));
  if (conv_layers_ > 0) conv_[dst].narrow(1, 0, tokens).copy_(conv_[src].narrow(1, 0, tokens));
}

void DecodeModel::release(int64_t slot) {
  if (slot >= 0 && slot < static_cast<int64_t>(kv_.size())) kv_[slot] = at::Tensor();
  if (slot >= 0 && slot < static_cast<int64_t>(conv_.size())) conv_[slot] = at::Tensor();
}

int64_t DecodeModel::capacity(int64_t slot) const {
  if (slot < 0 || slot >= static_cast<int64_t>(kv_.size()) || !kv_[slot].defined()) return 0;
  return kv_[slot].size(3);
}

int64_t DecodeModel::cache_bytes() const {
  int64_t n = 0;
  for (const at::Tensor& t : kv_) n += t.defined() ? t.numel() * 4 : 0;
  for (const at::Tensor& t : conv_) n += t.defined() ? t.numel() * 4 : 0;
  return n;
}

float* DecodeModel::kv_at(int64_t slot, int64_t layer, int64_t which, int64_t g) {
  at::Tensor& t = kv_[slot];
  return t.data_ptr<float>() + ((layer * 2 + which) * c_.kv_heads + g) * t.size(3) * c_.head_dim;
}

void DecodeModel::check_ready() const {
  TORCH_CHECK(embed_.data && lm_head_.data && norm_.defined(), "DecodeModel: embed, lm_head and "
              "norm must be set before a step");
  for (int64_t i = 0; i < c_.layers; ++i) {
    const DecodeLayer& L = layers_[i];
    const bool conv = L.conv_w.defined();
    for (int p = 0; p < kProjs; ++p) {  // a MoE layer's MLP is its experts
      const bool needed = p <= kO ? !conv : p <= kDown ? !L.moe : conv;
      TORCH_CHECK(L.w[p].data || !needed, "DecodeModel: layer ", i, " has no ", kProjNames[p],
                  " weight");
    }
    TORCH_CHECK(!L.moe || (L.router.data && L.experts_gate_up.data && L.experts_down.data),
                "DecodeModel: layer ", i, " lacks its router or expert weights");
    TORCH_CHECK(L.in_norm.defined() || L.attn_out_norm.defined(), "DecodeModel: layer ", i,
                " has neither an input nor an attention-output norm");
    TORCH_CHECK(L.mlp_norm.defined() || L.mlp_out_norm.defined(), "DecodeModel: layer ", i,
                " has neither an MLP input nor an MLP output norm");
  }
}

at::Tensor DecodeModel::step(const at::Tensor& tokens, const at::Tensor& slots,
                             const at::Tensor& positions, const at::Tensor& adapters,
                             const at::Tensor& logit_rows) {
  LORAFUSE_PROFILE_RANGE("decode_engine_step");
  check_ready();
  const int64_t R = tokens.numel(), L = logit_rows.numel();
  for (const at::Tensor* t : {&tokens, &slots, &positions, &adapters, &logit_rows}) {
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kLong && t->is_contiguous() &&
                    t->device().is_cpu(), "DecodeModel.step: take 1-D int64 CPU tensors");
  }
  TORCH_CHECK(R >= 1 && slots.numel() == R && positions.numel() == R && adapters.numel() == R,
              "DecodeModel.step: tokens, slots, positions and adapters need one value per row");
  Rows rows{R, tokens.const_data_ptr<int64_t>(), slots.const_data_ptr<int64_t>(),
                  positions.const_data_ptr<int64_t>(), adapters.const_data_ptr<int64_t>(), false};
  const int64_t* lr = logit_rows.const_data_ptr<int64_t>();
  bool lora = false;
  int64_t rope_len = cos_[0].size(0);
  for (const at::Tensor& t : cos_)
    if (t.defined()) rope_len = std::min(rope_len, t.size(0));
  for (int64_t m = 0; m < R; ++m) {
    TORCH_CHECK(rows.token[m] >= 0 && rows.token[m] < c_.vocab, "DecodeModel.step: token ",
                rows.token[m], " out of the vocabulary");
    TORCH_CHECK(rows.pos[m] >= 0 && rows.pos[m] < rope_len, "DecodeModel.step: position ",
                rows.pos[m], " past the rotary table (", rope_len, ")");
    TORCH_CHECK(rows.adapter[m] >= -1, "DecodeModel.step: adapter must be >= -1");
    lora = lora || rows.adapter[m] >= 0;
    if (rows.pos[m] >= capacity(rows.slot[m])) reserve(rows.slot[m], rows.pos[m] + 1);
  }
  for (int64_t i = 0; i < L; ++i)
    TORCH_CHECK(lr[i] >= 0 && lr[i] < R, "DecodeModel.step: logit row out of range");
  rows.lora = lora && lora_rank_ > 0;
  buf_.fit(c_, R, L, lora_rank_);
  at::Tensor logits = at::empty({L, c_.vocab}, at::kFloat);
  float* out = logits.mutable_data_ptr<float>();
  const int64_t H = c_.hidden;
  const float es = static_cast<float>(o_.embed_scale);
  for (int64_t m = 0; m < R; ++m) {
    float* h = buf_.h.data() + m * H;
    dequantize_row(embed_, rows.token[m], h);
    if (o_.embed_scale != 1.0)
      for (int64_t i = 0; i < H; ++i) h[i] *= es;
  }
  const float div = static_cast<float>(o_.logit_divisor);
  const float cap = static_cast<float>(o_.logit_softcap);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    for (int64_t li = 0; li < c_.layers; ++li) layer_step(rows, li);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < L; ++i) {
      rms_norm_row(buf_.h.data() + lr[i] * H, norm_.const_data_ptr<float>(),
                   buf_.xl.data() + i * H, H, c_.eps);
    }
    const int64_t tile = tile_rows(c_.vocab), n_tiles = (c_.vocab + tile - 1) / tile;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_tiles; ++t) {
      const int64_t n0 = t * tile, n1 = std::min(c_.vocab, (t + 1) * tile);
      gemv_rows(lm_head_, buf_.xl.data(), L, H, out, c_.vocab, n0, n1);
      if (div == 1.f && cap == 0.f) continue;
      for (int64_t i = 0; i < L; ++i) {  // Granite's logits / d, Gemma's c · tanh(logits / c)
        for (int64_t n = n0; n < n1; ++n) {
          float& l = out[i * c_.vocab + n];
          if (div != 1.f) l = l / div;
          if (cap > 0.f) l = std::tanh(l / cap) * cap;
        }
      }
    }
  }
  return logits;
}

}  // namespace lorafuse
