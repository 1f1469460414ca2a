// The decode engine's model: a dense Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM3)
// held as frozen weights in decode formats (decode_gemv.h), per-sequence KV-cache blocks, and
// the LoRA adapters of each row, run one step at a time (decode_engine.cpp).
//
// A step takes R rows, each one token of some sequence (its cache slot) at some position, and
// runs every layer for all of them in one OpenMP region: prefill chunks (consecutive positions
// of one slot) and decoding rows (one per running sequence) mix freely. Each layer writes every
// row's keys and values into its slot before any row attends, so a row at position p attends to
// positions [start, p] of its own slot (start: the layer's sliding window), its own chunk
// included: causal attention without a mask.
//
// The math is transformers' LlamaDecoderLayer op for op in fp32 (RMSNorm as LlamaRMSNorm, RoPE
// from the model's own cos/sin table, softmax attention, SiLU-gated MLP, PEFT LoRA as
// base + s·B·A·x per row), with the weights in their stored format: fp32 weights give
// transformers' fp32 numbers up to summation order.
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

enum Proj : int { kQ = 0, kK, kV, kO, kGate, kUp, kDown, kProjs };

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
  at::Tensor in_norm, post_norm, q_norm, k_norm;  // fp32; q/k norms: Qwen3
  bool rope = true;     // SmolLM3's NoPE layers: false
  int64_t window = 0;   // sliding window (tokens, the current one included), 0 = none
  std::vector<LoraRef> lora[kProjs];  // by adapter index
};

// Shapes and constants of the decoder.
struct DecodeConfig {
  int64_t hidden, heads, kv_heads, head_dim, intermediate, vocab, layers;
  double eps, attn_scale;
};

// Scratch of one step, grown to the largest step seen (never shrunk, never per step).
struct StepBuffers {
  std::vector<float> h, x, q, k, v, att, g, u, xa, xl;
  void fit(const DecodeConfig& c, int64_t rows, int64_t logit_rows, int64_t lora_cols);
};

class DecodeModel {
 public:
  DecodeModel(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
              int64_t intermediate, int64_t vocab, int64_t layers, double eps, double attn_scale,
              at::Tensor cos, at::Tensor sin);
  // name: q, k, v, o, gate, up, down (layer >= 0); embed, lm_head (layer -1).
  void set_weight(int64_t layer, const std::string& name, int64_t fmt, const at::Tensor& data,
                  const OptTensor& scales);
  // name: in_norm, post_norm, q_norm, k_norm, q_bias, k_bias, v_bias (layer >= 0); norm (-1).
  void set_vector(int64_t layer, const std::string& name, const at::Tensor& v);
  void set_layer(int64_t layer, bool rope, int64_t window);
  void set_rope(const at::Tensor& cos, const at::Tensor& sin);  // a longer table
  void set_lora(int64_t layer, const std::string& proj, int64_t adapter, const at::Tensor& A,
                const at::Tensor& B, double scale);
  void clear_lora();
  // KV blocks: slot's capacity grows to at least `tokens` (contents kept); copy_slot copies the
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
  void project_residual(const Rows& rows, const DecodeLayer& L, Proj p, const float* in,
                        int64_t ldin);
  void project_mlp(const Rows& rows, const DecodeLayer& L);
  void lora_down(const Rows& rows, const DecodeLayer& L, const Proj* ps, int64_t n,
                 const float* in, int64_t ldin);
  void lora_up(const Rows& rows, const DecodeLayer& L, Proj p, float* y, int64_t ldy, int64_t n0,
               int64_t n1) const;

  DecodeConfig c_;
  at::Tensor cos_, sin_;  // (positions, head_dim) fp32
  WeightView embed_, lm_head_;
  at::Tensor keep_embed_[2], keep_head_[2], norm_;
  std::vector<DecodeLayer> layers_;
  std::vector<at::Tensor> kv_;  // per slot: (layers, 2, kv_heads, capacity, head_dim) fp32
  int64_t lora_rank_ = 0;       // the largest rank set
  StepBuffers buf_;
};

// Row helpers (decode_attention.cpp), serial.
// out = w * (x * rsqrt(mean(x²) + eps)), as LlamaRMSNorm in fp32.
void rms_norm_row(const float* x, const float* w, float* out, int64_t n, double eps);
// x (D) rotated in place as apply_rotary_pos_emb: x·cos + rotate_half(x)·sin.
void rope_row(float* x, const float* cos, const float* sin, int64_t D);
// out (D) = softmax(scale · q·Kᵀ) · V over keys/values [start, end) of a (capacity, D) block;
// scores: room for end - start floats.
void attend_row(const float* q, const float* K, const float* V, int64_t start, int64_t end,
                int64_t D, double scale, float* scores, float* out);

}  // namespace lorafuse
