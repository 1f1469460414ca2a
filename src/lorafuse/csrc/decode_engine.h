// The decode engine's model: a decoder of the Llama shape (Llama, Mistral, Qwen2/3, SmolLM3,
// Gemma 1/2/3, OLMo 2/3, Granite, Phi-3; Qwen3-MoE, Mixtral, OLMoE with routed experts; LFM2
// with short convolutions in some layers' attention place) held as
// frozen weights in decode formats (decode_gemv.h), per-sequence KV-cache blocks, and the LoRA
// adapters of each row, run one step at a time (decode_engine.cpp). What differs between the
// families is data, not code: the options of DecodeOptions, which of a layer's four norms are
// set, whether its MLP is dense or routed experts and its mixer attention or a short
// convolution (DecodeLayer).
//
// A step takes R rows, each one token of some sequence (its cache slot) at some position, and
// runs every layer for all of them in one OpenMP region: prefill chunks (consecutive positions
// of one slot) and decoding rows (one per running sequence) mix freely. Each layer writes every
// row's keys and values into its slot before any row attends, so a row at position p attends to
// positions [start, p] of its own slot (start: the layer's sliding window), its own chunk
// included: causal attention without a mask.
//
// The math is transformers' decoder layers op for op in fp32 (RMSNorm as LlamaRMSNorm, with
// Gemma's (1 + w) folded into the weight by the caller; RoPE from the model's own cos/sin tables,
// one per layer type, over the first `rotary` dims of a head; softmax attention with optional
// logit soft-capping; SiLU- or GELU-tanh-gated MLP; PEFT LoRA as base + s·B·A·x per row), with
// the weights in their stored format: fp32 weights give transformers' fp32 numbers up to
// summation order.
#pragma once

#include "common.h"
#include "decode_gemv.h"

#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace lorafuse {

inline int step_threads() {  // threads of the step's region (1 outside one, or without OpenMP)
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// Weight rows per work item of a projection with N outputs: ~8 items per thread, 16 to 256 rows.
inline int64_t tile_rows(int64_t N) {
  const int64_t t = N / (8 * std::max(1, step_threads()));
  return std::max<int64_t>(16, std::min<int64_t>(256, t / 16 * 16));
}

// The checked view of a weight's tensors (decode_gemv.cpp).
WeightView weight_view(int64_t fmt, const at::Tensor& data, const OptTensor& scales, int64_t N,
                       int64_t K, const char* op);

// conv_in / conv_out: a short-convolution layer's in_proj (3·hidden, hidden) and out_proj (LFM2)
enum Proj : int { kQ = 0, kK, kV, kO, kGate, kUp, kDown, kConvIn, kConvOut, kProjs };

// One adapter's A (r, K) and B (N, r), fp32 and contiguous, on one projection; null = none.
struct LoraRef {
  const float* A = nullptr;
  const float* B = nullptr;
  int64_t r = 0;
  float scale = 0.f;
  at::Tensor keep_A, keep_B;
};

struct DecodeLayer {
  WeightView w[kProjs];
  at::Tensor keep[kProjs][2];  // data, scales
  at::Tensor bias[kProjs];     // fp32 (Qwen2's q/k/v), or undefined
  // fp32, each optional: in_norm before attention (all but OLMo 2/3), attn_out_norm on the
  // attention's output before the residual add (Gemma 2/3, OLMo), mlp_norm before the MLP (all
  // but OLMo), mlp_out_norm on the MLP's output (Gemma 2/3, OLMo)
  at::Tensor in_norm, attn_out_norm, mlp_norm, mlp_out_norm;
  // q/k norms: per head (head_dim values: Qwen3, Gemma 3) or over the whole projection
  // (heads·head_dim values: OLMo 2/3)
  at::Tensor q_norm, k_norm;
  bool rope = true;     // SmolLM3's NoPE layers: false
  int64_t window = 0;   // sliding window (tokens, the current one included), 0 = none
  int64_t rope_table = 0;  // which cos/sin table (Gemma 3 / OLMo 3: one per layer type)
  std::vector<LoraRef> lora[kProjs];  // by adapter index
  // A mixture-of-experts layer (moe; gate/up/down then unset): the router (experts, hidden),
  // every expert's gate|up rows stacked (experts·2·I, hidden), their down rows (experts·hidden,
  // I), I = DecodeConfig::moe_intermediate (transformers' fused 3-D tensors, flattened).
  bool moe = false;
  WeightView router, experts_gate_up, experts_down;
  at::Tensor keep_moe[3][2];
  at::Tensor expert_bias;  // (experts) fp32 added to the scores for choosing only (LFM2-MoE)
  // A short-convolution layer (conv_w set; q/k/v/o then unset): the depthwise kernel
  // (hidden, conv_len) fp32, its bias or undefined, and the layer's index among such layers
  at::Tensor conv_w, conv_b;
  int64_t conv_index = -1;
};

// Shapes and constants of the decoder.
struct DecodeConfig {
  int64_t hidden, heads, kv_heads, head_dim, intermediate, vocab, layers;
  double eps, attn_scale;
  // routed experts (set_moe): how many, each one's intermediate size, how many a token takes,
  // whether the chosen probabilities are renormalised to sum to 1 (norm_topk_prob; w / (sum +
  // route_eps)), sigmoid scores instead of a softmax (LFM2-MoE), the weights' final scale
  int64_t experts = 0, moe_intermediate = 0, top_k = 0;
  bool norm_topk = false, sigmoid_router = false;
  double route_eps = 0.0, route_scale = 1.0;
  int64_t conv_len = 0;  // short convolutions' kernel length (0: none)
};

// What the families change in the step (defaults: Llama).
struct DecodeOptions {
  int64_t act = 0;              // MLP gate: 0 SiLU, 1 GELU-tanh (Gemma)
  double embed_scale = 1.0;     // embedding · s: Gemma's sqrt(hidden), Granite's multiplier
  double residual_scale = 1.0;  // h += s · block output (Granite's residual_multiplier)
  double attn_softcap = 0.0;    // scores = c · tanh(scores / c) where > 0 (Gemma 2)
  double logit_divisor = 1.0;   // logits / d (Granite's logits_scaling)
  double logit_softcap = 0.0;   // logits = c · tanh(logits / c) where > 0 (Gemma 2/3)
};

// Scratch of one step, grown to the largest step seen (never shrunk, never per step).
struct StepBuffers {
  std::vector<float> h, x, q, k, v, att, g, u, xa, xl;
  // MoE: per (row, choice) its expert, weight and pair; the (row, choice) pairs ordered by expert
  // (pair_row, pair_w, the offset of each expert's run), their inputs, gate/up and down outputs
  std::vector<int64_t> choice_e, choice_pair, pair_row, expert_off;
  std::vector<float> choice_w, pair_w, xe, ge, ue, de;
  std::vector<float> bcx;  // short convolutions: (R, 3·hidden) B | C | x, y in B's place
  void fit(const DecodeConfig& c, int64_t rows, int64_t logit_rows, int64_t lora_cols);
};

class DecodeModel {
 public:
  DecodeModel(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
              int64_t intermediate, int64_t vocab, int64_t layers, double eps, double attn_scale,
              at::Tensor cos, at::Tensor sin);
  // name: q, k, v, o, gate, up, down, router, experts_gate_up, experts_down (layer >= 0);
  // embed, lm_head (layer -1).
  void set_weight(int64_t layer, const std::string& name, int64_t fmt, const at::Tensor& data,
                  const OptTensor& scales);
  // name: in_norm, attn_out_norm, mlp_norm, mlp_out_norm, q_norm, k_norm, {proj}_bias
  // (layer >= 0); norm (-1).
  void set_vector(int64_t layer, const std::string& name, const at::Tensor& v);
  void set_layer(int64_t layer, bool rope, int64_t window, int64_t rope_table);
  // a short-convolution layer: weight (hidden, L), bias (hidden) or none; before any reserve
  void set_conv(int64_t layer, const at::Tensor& weight, const OptTensor& bias);
  // routed experts: set before their weights (router, experts_gate_up, experts_down)
  void set_moe(int64_t experts, int64_t intermediate, int64_t top_k, bool norm_topk,
               bool sigmoid, double norm_eps, double scale);
  void set_options(int64_t act, double embed_scale, double residual_scale, double attn_softcap,
                   double logit_divisor, double logit_softcap);
  // cos/sin table `table` (positions, rotary) fp32, rotary <= head_dim and even; a longer table
  // replaces the old one (every table must cover the step's positions)
  void set_rope(const at::Tensor& cos, const at::Tensor& sin, int64_t table);
  void set_lora(int64_t layer, const std::string& proj, int64_t adapter, const at::Tensor& A,
                const at::Tensor& B, double scale);
  void clear_lora();
  // KV blocks (and the short convolutions' histories, position for position): slot's capacity grows to at least `tokens` (contents kept); copy_slot copies the
  // first `tokens` positions of src into dst (a prompt prefilled once, several samples of it).
  void reserve(int64_t slot, int64_t tokens);
  void copy_slot(int64_t src, int64_t dst, int64_t tokens);
  void release(int64_t slot);
  int64_t capacity(int64_t slot) const;
  int64_t cache_bytes() const;
  // tokens, slots, positions, adapters (-1: none): (R,) int64; logit_rows: (L,) indices of rows
  // whose next-token logits are returned, (L, vocab) fp32.
  at::Tensor step(const at::Tensor& tokens, const at::Tensor& slots, const at::Tensor& positions,
                  const at::Tensor& adapters, const at::Tensor& logit_rows);

 private:
  struct Rows {  // one step's rows
    int64_t R;
    const int64_t *token, *slot, *pos, *adapter;
    bool lora;  // some row has an adapter
  };
  void check_ready() const;
  float* kv_at(int64_t slot, int64_t layer, int64_t which, int64_t g);
  void layer_step(const Rows& rows, int64_t li);
  void project_qkv(const Rows& rows, int64_t li);
  void attention(const Rows& rows, int64_t li);
  void qk_whole_norms(const Rows& rows, int64_t li);
  void project_residual(const Rows& rows, const DecodeLayer& L, Proj p, const float* in,
                        int64_t ldin, const at::Tensor& out_norm);
  void norm_rows(const Rows& rows, const at::Tensor& w);
  void project_mlp(const Rows& rows, const DecodeLayer& L);
  // decode_moe.cpp: route every row (softmax over the router's logits, top k), order the
  // (row, expert) pairs by expert, then gate/up, down and the weighted sum into h
  void route(const Rows& rows, const DecodeLayer& L);
  void conv_step(const Rows& rows, int64_t li);  // decode_conv.cpp
  float* conv_at(int64_t slot, int64_t conv_index, int64_t pos);
  void project_experts(const Rows& rows, const DecodeLayer& L);
  void set_moe_weight(DecodeLayer& L, const std::string& name, int64_t fmt, const at::Tensor& data,
                      const OptTensor& scales);
  void lora_down(const Rows& rows, const DecodeLayer& L, const Proj* ps, int64_t n,
                 const float* in, int64_t ldin);
  void lora_up(const Rows& rows, const DecodeLayer& L, Proj p, float* y, int64_t ldy, int64_t n0,
               int64_t n1) const;

  DecodeConfig c_;
  DecodeOptions o_;
  std::vector<at::Tensor> cos_, sin_;  // per table: (positions, rotary) fp32
  WeightView embed_, lm_head_;
  at::Tensor keep_embed_[2], keep_head_[2], norm_;
  std::vector<DecodeLayer> layers_;
  std::vector<at::Tensor> kv_;  // per slot: (layers, 2, kv_heads, capacity, head_dim) fp32
  std::vector<at::Tensor> conv_;  // per slot: (conv layers, capacity, hidden) fp32 B·x
  int64_t conv_layers_ = 0;
  int64_t lora_rank_ = 0;       // the largest rank set
  StepBuffers buf_;
};

// y[m·ldy + n] += bias[n] for m < R, n in [n0, n1) (nothing where bias is undefined).
inline void add_bias(const at::Tensor& bias, float* y, int64_t ldy, int64_t R, int64_t n0,
                     int64_t n1) {
  if (!bias.defined()) return;
  const float* b = bias.const_data_ptr<float>();
  for (int64_t m = 0; m < R; ++m)
    for (int64_t n = n0; n < n1; ++n) y[m * ldy + n] += b[n];
}

// Row helpers (decode_attention.cpp), serial.
// out = w * (x * rsqrt(mean(x²) + eps)), as LlamaRMSNorm in fp32.
void rms_norm_row(const float* x, const float* w, float* out, int64_t n, double eps);
// x's first D dims rotated in place as apply_rotary_pos_emb: x·cos + rotate_half(x)·sin (the
// rest of a head, Phi-3's partial rotary, passes through).
void rope_row(float* x, const float* cos, const float* sin, int64_t D);
// out (D) = softmax(capped(scale · q·Kᵀ)) · V over keys/values [start, end) of a (capacity, D)
// block, capped(s) = softcap · tanh(s / softcap) where softcap > 0; scores: end - start floats.
void attend_row(const float* q, const float* K, const float* V, int64_t start, int64_t end,
                int64_t D, double scale, double softcap, float* scores, float* out);

}  // namespace lorafuse
