// Fused LoRA Conv2d: y = conv(x, W, b) + s·up ⊛ conv(x, down) and its backward (the contract of
// ops/lora_conv.py: _torch_forward / _torch_backward). Shapes: x (N, Cin, H, W),
// W (Cout, Cin/groups, kh, kw), b (Cout,), down (r, Cin, kh, kw), up (Cout, r, 1, 1),
// t = conv(x, down) (N, r, H', W'), g (N, Cout, H', W').
//
// The convolutions are ATen's (oneDNN on CPU); what this file adds is one op boundary per
// direction and no temporaries: the rank-r up-projection is accumulated into the base output by
// one in-place baddbmm_ over (N, Cout, H'W'), and bf16/fp16 convolutions run in fp32 where
// those products are not native (common.h), as lora_linear's GEMMs do.
//
// 1x1, stride-1, unpadded, ungrouped convs (SD1.5's proj_in/proj_out, ResNet shortcuts) run both
// passes as batched matrix products on (N, C, H·W) views instead (pointwise(), as the torch
// backend's _pointwise): no per-call convolution setup, and dx's two terms accumulate into one
// buffer instead of the concatenation below, which copied W every call (1.6 MiB at 640
// channels). Measured in benchmarks/ops/lora_linear.py --sd15-targets (docs/image.md).
//
// Backward: gt = s·upᵀ·g (N, r, H', W') by one batched product; d_up = s·Σ_n g_n·t_nᵀ; d_down
// from convolution_backward of gt. dx = convT(g, W) + convT(gt, down): where the layer's input
// is large next to its weight, as ONE transposed convolution over cat([W, down]) and
// cat([g, gt]) (same stride/padding/dilation, groups == 1); that copies W and g each call, which
// costs more than it saves at the deep, weight-dominated UNet levels. ATen's
// convolution_backward, separate / concatenated time (2 threads, fp32, medians of 3x7 runs;
// benchmarks/ops/lora_conv.py times the whole op): 3x3 Cin=320 at 64x64 r=8 1.19x, r=32 1.03x;
// 640 at 32x32 r=32 1.19x; 1280 at 16x16 r=32 1.09x, at 8x8 r=8 0.82x and r=128 0.59x; 1x1 320
// at 64x64 r=32 1.21x (1x1 convs run pointwise()).
// Rule: concat when the weight has at most 16x the input's elements (kConcatRatio): 320/64
// (0.7x) and 640/32 (5.6x) concat, 1280/16 (45x, a marginal win) and 1280/8 (180x) do not.
//
// With bf16/fp16 adapters on native units the rank-r products (gt, d_up, d_down) are computed
// in fp32 and each result rounded once, as lora_linear.cpp does: d_up and d_down are sums over
// N·H'·W' terms that can cancel, and a bf16-rounded gt would put 2^-9·|gt|·sqrt(N·H'·W') of
// error into each. Cost: fp32 copies of g, t and x for products of rank r.
#include "common.h"

namespace lorafuse {
namespace {

constexpr int64_t kConcatRatio = 16;  // see the header comment

at::Tensor as(const at::Tensor& t, at::ScalarType dt) {
  return t.scalar_type() == dt ? t : t.to(dt);
}

bool low_precision(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

void check_shapes(const at::Tensor& x, const at::Tensor& w, const at::Tensor& down,
                  const at::Tensor& up, int64_t groups) {
  TORCH_CHECK(x.dim() == 4 && w.dim() == 4 && down.dim() == 4 && up.dim() == 4,
              "lora_conv2d: x, weight, lora_down and lora_up must be 4-D, got ", x.sizes(), ", ",
              w.sizes(), ", ", down.sizes(), ", ", up.sizes());
  TORCH_CHECK(x.device().is_cpu(), "lora_conv2d: tensors must be on the CPU, got ", x.device());
  TORCH_CHECK(groups >= 1 && w.size(1) * groups == x.size(1), "lora_conv2d: weight ",
              w.sizes(), " with groups=", groups, " does not match x ", x.sizes());
  TORCH_CHECK(down.size(1) == x.size(1) && down.size(2) == w.size(2) && down.size(3) == w.size(3),
              "lora_conv2d: lora_down ", down.sizes(), " does not match x ", x.sizes(),
              " and weight ", w.sizes());
  TORCH_CHECK(up.size(0) == w.size(0) && up.size(1) == down.size(0) && up.size(2) == 1 &&
                  up.size(3) == 1,
              "lora_conv2d: lora_up ", up.sizes(), " does not match weight ", w.sizes(),
              " and lora_down ", down.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "lora_conv2d: x dtype ", x.scalar_type(),
              " != weight dtype ", w.scalar_type());
  TORCH_CHECK(down.scalar_type() == up.scalar_type(), "lora_conv2d: lora_down dtype ",
              down.scalar_type(), " != lora_up dtype ", up.scalar_type());
}

at::Tensor conv(const at::Tensor& x, const at::Tensor& w, const OptTensor& b,
                at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                int64_t groups) {
  return at::convolution(x, w, b, stride, padding, dilation, false, {0, 0}, groups);
}

// (d input, d weight) of conv(x, w) for the gradient g; undefined where not asked for.
std::tuple<at::Tensor, at::Tensor> conv_backward(const at::Tensor& g, const at::Tensor& x,
                                                 const at::Tensor& w, at::IntArrayRef stride,
                                                 at::IntArrayRef padding,
                                                 at::IntArrayRef dilation, int64_t groups,
                                                 bool need_input, bool need_weight) {
  auto [dx, dw, db] = at::convolution_backward(g, x, w, c10::nullopt, stride, padding, dilation,
                                               false, {0, 0}, groups,
                                               {need_input, need_weight, false});
  (void)db;
  return {dx, dw};
}

// A 1x1, stride-1, unpadded, ungrouped conv (SD1.5's proj_in/proj_out, the ResNet shortcuts): a
// per-image matrix product over channels, run as one (ops/lora_conv.py's _pointwise; dilation
// does not act on a 1x1 kernel). No convolution machinery per call, and no concatenated copy of
// W in backward (see kConcatRatio): dx's two terms accumulate into one buffer.
bool pointwise(const at::Tensor& w, at::IntArrayRef stride, at::IntArrayRef padding,
               int64_t groups) {
  return w.size(2) == 1 && w.size(3) == 1 && groups == 1 && stride[0] == 1 && stride[1] == 1 &&
         padding[0] == 0 && padding[1] == 0;
}

// w2 @ x3[n] (+ bias) for every image: w2 (M, K), x3 (N, K, L) -> (N, M, L)
at::Tensor bmm_each(const at::Tensor& w2, const at::Tensor& x3, const OptTensor& bias) {
  at::Tensor w = w2.expand({x3.size(0), w2.size(0), w2.size(1)});  // stride-0 view, no copy
  if (!bias.has_value() || !bias->defined()) return at::bmm(w, x3);
  return at::baddbmm(bias->view({1, -1, 1}), w, x3);
}

// Σ_n a3[n]·b3[n]ᵀ: a3 (N, M, L), b3 (N, K, L) -> (M, K). One batch (the UNet's training batch
// of 1) is one mm, without bmm's (N, M, K) result and the sum over it (a copy of M·K floats:
// 0.6 MiB at Cout=1280, r=128).
at::Tensor sum_products(const at::Tensor& a3, const at::Tensor& b3) {
  if (a3.size(0) == 1) return at::mm(a3[0], b3[0].t());
  return at::bmm(a3, b3.transpose(1, 2)).sum(0);
}

// (dx, d_down) of a pointwise conv (see pointwise()) from gt = s·upᵀ·g (N, r, H, W) in the
// rank-r product dtype: d_down = Σ_n gt_n·x_nᵀ, dx = Wᵀ·g + downᵀ·gt, on (N, C, HW) views.
std::tuple<at::Tensor, at::Tensor> pointwise_backward(const at::Tensor& g, const at::Tensor& x,
                                                      const at::Tensor& weight,
                                                      const at::Tensor& lora_down,
                                                      const at::Tensor& gt, bool need_dx,
                                                      bool need_down) {
  const auto cx = matmul_dtype(x.scalar_type()), ca = matmul_dtype(lora_down.scalar_type());
  const int64_t n = x.size(0), cin = x.size(1), cout = weight.size(0), r = lora_down.size(0);
  auto flat = [n](const at::Tensor& v) { return v.reshape({n, v.size(1), -1}); };  // (N, C, HW)
  at::Tensor gt3 = flat(gt);  // (N, r, HW)
  at::Tensor dx, d_down;
  if (need_down) {
    at::Tensor dw = sum_products(gt3, flat(as(x, gt.scalar_type())));  // (r, Cin)
    d_down = as(dw, lora_down.scalar_type()).view(lora_down.sizes());  // (r, Cin, 1, 1)
  }
  if (need_dx) {
    at::Tensor down_t = as(lora_down, ca).reshape({r, cin}).t();                   // (Cin, r)
    dx = bmm_each(as(weight, cx).reshape({cout, cin}).t(), flat(as(g, cx)), c10::nullopt);
    at::Tensor gtc = as(gt3, ca);  // a term of dx, not a sum that cancels: native product
    if (ca == cx) {
      dx.baddbmm_(down_t.expand({n, cin, r}), gtc);  // LoRA part accumulated in place
    } else {
      dx = dx.add(bmm_each(down_t, gtc, c10::nullopt));
    }
    dx = as(dx, x.scalar_type()).view(x.sizes());  // (N, Cin, H, W)
  }
  return {dx, d_down};
}

// (dx, d_down) of any other conv, from gt as pointwise_backward takes it. d_down from
// convolution_backward of gt; dx as the header says. Without the concatenation and with
// adapters whose products are not widened (gt already in their dtype), d_down and the LoRA term
// of dx come from ONE convolution_backward (input and weight gradients), as the torch backend
// computes them: two calls instead of three (benchmarks/ops/lora_conv.py, fp32, 2 threads, 9
// repeats: cpp/torch time at 1280 @ 8x8 r=8 0.75 with two calls, 1.14 with three).
std::tuple<at::Tensor, at::Tensor> conv_path_backward(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& lora_down, const at::Tensor& gt, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, bool need_dx,
    bool need_down) {
  const auto cx = matmul_dtype(x.scalar_type()), ca = matmul_dtype(lora_down.scalar_type());
  const auto cr = gt.scalar_type();
  const bool concat =
      need_dx && groups == 1 && ca == cx && weight.numel() <= kConcatRatio * x.numel();
  at::Tensor xc = as(x, cx);
  at::Tensor dw, dl;  // d_down in cr; the LoRA term of dx in ca (when not concatenated)
  if (cr == ca && !concat) {
    if (need_down || need_dx) {
      std::tie(dl, dw) = conv_backward(gt, ca == cx ? xc : as(x, ca), as(lora_down, ca), stride,
                                       padding, dilation, 1, need_dx, need_down);
    }
  } else {
    if (need_down) {
      dw = std::get<1>(conv_backward(gt, as(x, cr), as(lora_down, cr), stride, padding,
                                     dilation, 1, false, true));
    }
    if (need_dx && !concat) {  // a term of dx, not a sum that cancels: native product
      dl = std::get<0>(conv_backward(as(gt, ca), ca == cx ? xc : as(x, ca), as(lora_down, ca),
                                     stride, padding, dilation, 1, true, false));
    }
  }
  at::Tensor d_down = need_down ? as(dw, lora_down.scalar_type()) : at::Tensor();
  if (!need_dx) return {at::Tensor(), d_down};
  at::Tensor dx;
  if (concat) {  // one transposed convolution over [W; down] and [g, gt]
    at::Tensor wcat = at::cat({as(weight, cx), as(lora_down, cx)}, 0);  // (Cout + r, Cin, ..)
    at::Tensor gcat = at::cat({as(g, cx), as(gt, ca)}, 1);              // (N, Cout + r, ..)
    dx = std::get<0>(conv_backward(gcat, xc, wcat, stride, padding, dilation, 1, true, false));
  } else {
    dx = std::get<0>(conv_backward(as(g, cx), xc, as(weight, cx), stride, padding, dilation,
                                   groups, true, false));
    dx = ca == cx ? dx.add_(dl) : dx.add(dl);
  }
  return {as(dx, x.scalar_type()), d_down};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> lora_conv2d_forward(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
    const at::Tensor& lora_down, const at::Tensor& lora_up, double scaling,
    std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
    int64_t groups) {
  LORAFUSE_PROFILE_RANGE("lora_conv2d_forward");
  check_shapes(x, weight, lora_down, lora_up, groups);
  const auto cx = matmul_dtype(x.scalar_type());          // base convolution dtype
  const auto ca = matmul_dtype(lora_down.scalar_type());  // LoRA branch dtype
  at::Tensor xc = as(x, cx);
  OptTensor bc = bias.has_value() && bias->defined() ? OptTensor(as(*bias, cx)) : OptTensor();
  at::Tensor xl = ca == cx ? xc : as(x, ca);
  at::Tensor y, t;  // (N, Cout, H', W'), (N, r, H', W')
  if (pointwise(weight, stride, padding, groups)) {
    const int64_t n = x.size(0), h = x.size(2), w = x.size(3);
    auto flat = [&](const at::Tensor& v) { return v.reshape({n, v.size(1), h * w}); };  // view
    y = bmm_each(as(weight, cx).reshape({weight.size(0), -1}), flat(xc), bc).view({n, -1, h, w});
    t = bmm_each(as(lora_down, ca).reshape({lora_down.size(0), -1}), flat(xl), c10::nullopt)
            .view({n, -1, h, w});
  } else {
    y = conv(xc, as(weight, cx), bc, stride, padding, dilation, groups);
    t = conv(xl, as(lora_down, ca), c10::nullopt, stride, padding, dilation, 1);
  }
  const int64_t n = t.size(0), r = t.size(1), cout = y.size(1);
  // The LoRA term accumulated by one baddbmm_: in place on y (viewed as (N, Cout, H'W')) when
  // the dtypes agree and y is NCHW; else into ONE promoted copy of y, rounded once at the end.
  const auto wide = at::promote_types(cx, ca);
  at::Tensor up = as(lora_up, wide).reshape({cout, r});  // (Cout, r)
  at::Tensor acc = as(y.reshape({n, cout, -1}), wide);   // (N, Cout, H'W')
  acc.baddbmm_(up.expand({n, cout, r}), as(t.reshape({n, r, -1}), wide), /*beta=*/1,
               /*alpha=*/scaling);
  return {as(acc.view(y.sizes()), x.scalar_type()), as(t, lora_down.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_conv2d_backward(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& lora_down, const at::Tensor& lora_up, const at::Tensor& t, double scaling,
    std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
    int64_t groups, std::tuple<bool, bool, bool, bool> needs) {
  LORAFUSE_PROFILE_RANGE("lora_conv2d_backward");
  check_shapes(x, weight, lora_down, lora_up, groups);
  TORCH_CHECK(g.dim() == 4 && g.size(0) == t.size(0) && g.size(1) == weight.size(0) &&
                  g.size(2) == t.size(2) && g.size(3) == t.size(3),
              "lora_conv2d backward: grad_output ", g.sizes(), " does not match t ", t.sizes(),
              " and weight ", weight.sizes());
  auto [need_dx, need_down, need_up, need_db] = needs;
  const auto cx = matmul_dtype(x.scalar_type());
  const auto ca = matmul_dtype(lora_down.scalar_type());
  const auto cr = low_precision(ca) ? at::kFloat : ca;  // rank-r products (header comment)
  const int64_t n = t.size(0), r = t.size(1), cout = weight.size(0);
  at::Tensor dx, d_down, d_up, db;
  at::Tensor gr = as(g, cr).reshape({n, cout, -1});  // (N, Cout, H'W')
  if (need_up) {
    at::Tensor t3 = as(t, cr).reshape({n, r, -1});                        // (N, r, H'W')
    at::Tensor s = sum_products(gr, t3).mul_(scaling);                   // (Cout, r)
    d_up = as(s, lora_up.scalar_type()).view(lora_up.sizes());
  }
  if (need_dx || need_down) {
    at::Tensor upt = as(lora_up, cr).reshape({cout, r}).t();                        // (r, Cout)
    at::Tensor gt = bmm_each(upt, gr, c10::nullopt).mul_(scaling).view(t.sizes());  // in cr
    if (pointwise(weight, stride, padding, groups)) {
      std::tie(dx, d_down) = pointwise_backward(g, x, weight, lora_down, gt, need_dx, need_down);
    } else {
      std::tie(dx, d_down) = conv_path_backward(g, x, weight, lora_down, gt, stride, padding,
                                                dilation, groups, need_dx, need_down);
    }
  }
  if (need_db) db = at::sum(g, {0, 2, 3}, false, at::kFloat).to(g.scalar_type());  // (Cout,)
  return {dx, d_down, d_up, db};
}

}  // namespace lorafuse
