// The decode engine's short-convolution layers (decode_engine.h): LFM2's token mixer in place of
// attention, for every row of a step, as transformers' Lfm2ShortConv computes it:
//   B, C, x = in_proj·norm(h) (three blocks of hidden rows), bx = B ⊙ x,
//   y = C ⊙ (conv_b + Σ_j conv_w[:, j] ⊙ bx[p - (L - 1) + j]) (a depthwise causal convolution
//   over the last L positions, zeros before the first), h += out_proj·y.
// Each row's bx is written into its slot's convolution history at its position before any row
// convolves (the stage's barrier), as keys and values are: prefill chunks and decoding rows mix
// freely, a fork copies the history with the keys and values. The history keeps every position
// (hidden floats a token per conv layer, the cache's layout); only the last L - 1 are read.
#include "decode_engine.h"

namespace lorafuse {

float* DecodeModel::conv_at(int64_t slot, int64_t conv_index, int64_t pos) {
  at::Tensor& t = conv_[slot];
  return t.data_ptr<float>() + (conv_index * t.size(1) + pos) * c_.hidden;
}

void DecodeModel::set_conv(int64_t layer, const at::Tensor& weight, const OptTensor& bias) {
  TORCH_CHECK(layer >= 0 && layer < c_.layers, "DecodeModel.set_conv: layer out of range");
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  TORCH_CHECK(w.dim() == 2 && w.size(0) == c_.hidden && w.size(1) >= 1 &&
                  (c_.conv_len == 0 || w.size(1) == c_.conv_len),
              "DecodeModel.set_conv: weight must be (hidden, L), one L for every layer; got ",
              w.sizes());
  TORCH_CHECK(kv_.empty(), "DecodeModel.set_conv: set the layers before opening sequences");
  DecodeLayer& L = layers_[layer];
  if (L.conv_index < 0) L.conv_index = conv_layers_++;
  L.conv_w = w;
  L.conv_b = bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!L.conv_b.defined() || L.conv_b.numel() == c_.hidden, "DecodeModel.set_conv: bias "
              "must have hidden values");
  c_.conv_len = w.size(1);
}

void DecodeModel::conv_step(const Rows& rows, int64_t li) {
  const DecodeLayer& L = layers_[li];
  const int64_t H = c_.hidden, R = rows.R, K = c_.conv_len, tile = tile_rows(H);
  const int64_t n_tiles = (H + tile - 1) / tile;
  static const Proj kIn[] = {kConvIn}, kOut[] = {kConvOut};
  float* bcx = buf_.bcx.data();  // (R, 3H): B | C | x
  norm_rows(rows, L.in_norm);
  if (rows.lora) lora_down(rows, L, kIn, 1, buf_.x.data(), H);
#pragma omp for schedule(dynamic, 1)
  for (int64_t t = 0; t < n_tiles; ++t) {  // B, C and x of the tile's channels, then bx
    const int64_t n0 = t * tile, n1 = std::min(H, n0 + tile);
    for (int64_t part = 0; part < 3; ++part) {
      const int64_t a = part * H + n0, b = part * H + n1;
      gemv_rows(L.w[kConvIn], buf_.x.data(), R, H, bcx, 3 * H, a, b);
      add_bias(L.bias[kConvIn], bcx, 3 * H, R, a, b);
      lora_up(rows, L, kConvIn, bcx, 3 * H, a, b);
    }
    for (int64_t m = 0; m < R; ++m) {
      float* dst = conv_at(rows.slot[m], L.conv_index, rows.pos[m]);
      const float* r = bcx + m * 3 * H;
      for (int64_t n = n0; n < n1; ++n) dst[n] = r[n] * r[2 * H + n];
    }
  }
  const float* w = L.conv_w.const_data_ptr<float>();
  const float* cb = L.conv_b.defined() ? L.conv_b.const_data_ptr<float>() : nullptr;
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < R * n_tiles; ++item) {  // y into B's place (bx is in the history)
    const int64_t m = item / n_tiles, n0 = item % n_tiles * tile, n1 = std::min(H, n0 + tile);
    float* r = bcx + m * 3 * H;
    const int64_t p = rows.pos[m];
    for (int64_t n = n0; n < n1; ++n) r[n] = cb ? cb[n] : 0.f;
    for (int64_t j = std::max<int64_t>(0, K - 1 - p); j < K; ++j) {
      const float* bx = conv_at(rows.slot[m], L.conv_index, p - (K - 1) + j);
      for (int64_t n = n0; n < n1; ++n) r[n] += w[n * K + j] * bx[n];
    }
    for (int64_t n = n0; n < n1; ++n) r[n] *= r[H + n];
  }
  if (rows.lora) lora_down(rows, L, kOut, 1, bcx, 3 * H);
  project_residual(rows, L, kConvOut, bcx, 3 * H, L.attn_out_norm);
}

}  // namespace lorafuse
