// The common training call of lora_linear / lora_conv2d (dense frozen weight, no dropout, no
// autocast, not traced by torch.compile, backend cpp on CPU) as ONE C++ autograd Function each:
// forward and backward call the same kernels as the Python path (lora_linear.cpp, lora_conv.cpp),
// so outputs and gradients are bit for bit those of ops/lora_linear.py's LoRALinearFunction and
// ops/lora_conv.py's LoRAConv2dFunction with backend="cpp".
//
// Why: at SD1.5's shapes (N = 4..1024 tokens, rank 8) the LoRA arithmetic is small; what a
// Python autograd.Function costs per call (Python forward and backward, ctx, checks, the
// reshape nodes around it) made lorafuse's per-call overhead larger than kohya's ~10 extra ATen
// ops through C++ autograd (docs/image.md has the per-layer numbers before and after).
// Here: one pybind call, checks in C++, no view nodes (x is flattened inside the Function and
// dx reshaped back), kernels dispatched below autograd, one CppNode in the graph.
//
// Entry points return None (nullopt) when the call is not the plain case they serve: a shape or
// dtype the op's Python checks reject (those raise the op's ValueError there), a trainable base
// weight under grad mode, autocast on (the Python entry points cast first, then call again with
// autocast off), an unbatched conv. The Python entry points then run their general path; they
// never depend on these checks for errors.
//
// Saved: x (flattened, contiguous), the frozen weight (a reference, no copy), the adapters and
// the rank-r activation (xa (N, r) or t (N, r, H', W')), as the Python Functions save them, via
// save_for_backward: saved-tensor hooks and non-reentrant checkpointing see them. Double backward
// (create_graph=True) returns gradients whose own backward raises a clear error, as
// @once_differentiable does; under no_grad (or when nothing needs a gradient) the kernel runs
// without a graph node.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <ATen/autocast_mode.h>

#include "common.h"

namespace lorafuse {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool has(const OptTensor& t) { return t.has_value() && t->defined(); }

bool cpu(const at::Tensor& t) { return t.device().is_cpu(); }

// Gradients of a backward run with create_graph=True: aliases whose own backward raises (what
// @once_differentiable does in Python), so a double backward fails loudly instead of silently
// differentiating only part of the op.
variable_list refuse_double_backward(variable_list grads, const char* op) {
  variable_list fake;
  fake.reserve(grads.size());
  for (auto& g : grads) {
    if (!g.defined()) {
      fake.emplace_back();
      continue;
    }
    at::Tensor d = g.detach();
    d.set_requires_grad(true);
    fake.push_back(std::move(d));
  }
  auto err = std::make_shared<torch::autograd::DelayedError>(
      std::string("lorafuse ") + op +
          ": double backward (create_graph=True through the fused op) is not supported; run "
          "the layer unfused for higher-order gradients",
      static_cast<int64_t>(fake.size()));
  return (*err)(std::move(fake));
}

// Autograd and autocast off for the kernels' own ATen calls: the Function is the only graph
// node, and a backward called inside autocast sees the forward's dtypes (the Python Functions
// disable autocast in backward for the same reason).
struct KernelGuard {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::impl::ExcludeDispatchKeyGuard no_autocast{
      c10::DispatchKeySet(c10::DispatchKey::AutocastCPU)};
};

}  // namespace

// ---- lora_linear ------------------------------------------------------------------------------

// Named (not in an anonymous namespace) so the graph node reads
// "torch::autograd::CppNode<lorafuse::LoRALinearFunction>".
struct LoRALinearFunction : public torch::autograd::Function<LoRALinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptTensor& bias, const at::Tensor& A, const at::Tensor& B,
                            double scaling) {
    KernelGuard guard;
    const int64_t d = x.size(-1), k = weight.size(0);
    at::Tensor x2 = x.reshape({-1, d}).contiguous();  // (N, d); a permuted view copies
    auto [y, xa] = lora_linear_forward(x2, weight, bias, A, B, scaling, c10::nullopt, 1.0);
    ctx->save_for_backward({x2, weight, A, B, xa});
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["bias"] = has(bias);
    ctx->saved_data["x_shape"] = x.sizes();
    auto out = x.sizes().vec();
    out.back() = k;
    return x.dim() == 2 ? y : at::_unsafe_view(y, out);  // (..., k), no view relationship
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool create_graph = at::GradMode::is_enabled();
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x2 = saved[0], &weight = saved[1], &A = saved[2], &B = saved[3];
    const bool has_bias = ctx->saved_data["bias"].toBool();
    // edges: x, weight, [bias], A, B (needs_input_grad counts tensor inputs only)
    const size_t ia = has_bias ? 3 : 2;
    const bool need_dx = ctx->needs_input_grad(0), need_db = has_bias && ctx->needs_input_grad(2);
    const bool need_dA = ctx->needs_input_grad(ia), need_dB = ctx->needs_input_grad(ia + 1);
    at::Tensor dx, dA, dB, db;
    {
      KernelGuard guard;
      at::NoGradGuard no_grad;
      at::Tensor g = grads[0].reshape({-1, weight.size(0)}).contiguous();  // (N, k)
      std::tie(dx, dA, dB, db) = lora_linear_backward(
          g, x2, weight, A, B, saved[4], ctx->saved_data["scaling"].toDouble(), c10::nullopt,
          1.0, {need_dx, need_dA, need_dB, need_db});
      if (dx.defined()) dx = dx.view(ctx->saved_data["x_shape"].toIntVector());
    }
    variable_list out = {dx, at::Tensor(), db, dA, dB, at::Tensor()};
    return create_graph ? refuse_double_backward(std::move(out), "lora_linear") : out;
  }
};

namespace {

// The lora_linear op's Python checks, as a yes/no (the messages stay in Python).
bool linear_eligible(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                     const at::Tensor& A, const at::Tensor& B) {
  if (x.dim() < 1 || weight.dim() != 2 || A.dim() != 2 || B.dim() != 2) return false;
  const int64_t d = x.size(-1), k = weight.size(0), r = A.size(0);
  if (weight.size(1) != d || A.size(1) != d || B.size(0) != k || B.size(1) != r) return false;
  if (has(bias) && (bias->dim() != 1 || bias->size(0) != k || !cpu(*bias))) return false;
  if (x.scalar_type() != weight.scalar_type() || A.scalar_type() != B.scalar_type()) return false;
  if (!cpu(x) || !cpu(weight) || !cpu(A) || !cpu(B)) return false;
  if (!weight.is_contiguous() || !A.is_contiguous() || !B.is_contiguous()) return false;
  if (weight.requires_grad() && at::GradMode::is_enabled()) return false;  // Python refuses
  return !at::autocast::is_autocast_enabled(at::kCPU);
}

bool any_requires_grad(std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts) {
    if (t->defined() && t->requires_grad()) return true;
  }
  return false;
}

}  // namespace

// ---- lora_conv2d ------------------------------------------------------------------------------

struct ConvGeometry {
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups;
};

struct LoRAConv2dFunction : public torch::autograd::Function<LoRAConv2dFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptTensor& bias, const at::Tensor& down, const at::Tensor& up,
                            double scaling, const ConvGeometry& geo) {
    KernelGuard guard;
    auto [y, t] = lora_conv2d_forward(x, weight, bias, down, up, scaling, geo.stride,
                                      geo.padding, geo.dilation, geo.groups);
    ctx->save_for_backward({x, weight, down, up, t});
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["bias"] = has(bias);
    ctx->saved_data["stride"] = geo.stride;
    ctx->saved_data["padding"] = geo.padding;
    ctx->saved_data["dilation"] = geo.dilation;
    ctx->saved_data["groups"] = geo.groups;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool create_graph = at::GradMode::is_enabled();
    auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["bias"].toBool();
    const size_t id = has_bias ? 3 : 2;  // edges: x, weight, [bias], down, up
    const bool need_dx = ctx->needs_input_grad(0), need_db = has_bias && ctx->needs_input_grad(2);
    const bool need_down = ctx->needs_input_grad(id), need_up = ctx->needs_input_grad(id + 1);
    at::Tensor dx, d_down, d_up, db;
    {
      KernelGuard guard;
      at::NoGradGuard no_grad;
      std::tie(dx, d_down, d_up, db) = lora_conv2d_backward(
          grads[0].contiguous(), saved[0], saved[1], saved[2], saved[3], saved[4],
          ctx->saved_data["scaling"].toDouble(), ctx->saved_data["stride"].toIntVector(),
          ctx->saved_data["padding"].toIntVector(), ctx->saved_data["dilation"].toIntVector(),
          ctx->saved_data["groups"].toInt(), {need_dx, need_down, need_up, need_db});
    }
    variable_list out = {dx, at::Tensor(), db, d_down, d_up, at::Tensor(), at::Tensor()};
    return create_graph ? refuse_double_backward(std::move(out), "lora_conv2d") : out;
  }
};

namespace {

// The lora_conv2d op's Python checks (batched input only), as a yes/no.
bool conv_eligible(const at::Tensor& x, const at::Tensor& w, const OptTensor& bias,
                   const at::Tensor& down, const at::Tensor& up, const ConvGeometry& geo) {
  if (x.dim() != 4 || w.dim() != 4 || down.dim() != 4 || up.dim() != 4) return false;
  if (geo.stride.size() != 2 || geo.padding.size() != 2 || geo.dilation.size() != 2) return false;
  const int64_t g = geo.groups, cin = x.size(1), cout = w.size(0), kh = w.size(2), kw = w.size(3);
  if (g < 1 || cin % g || w.size(1) != cin / g || cout % g) return false;
  if (down.size(1) != cin || down.size(2) != kh || down.size(3) != kw) return false;
  const int64_t r = down.size(0);
  if (up.size(0) != cout || up.size(1) != r || up.size(2) != 1 || up.size(3) != 1) return false;
  if (has(bias) && (bias->dim() != 1 || bias->size(0) != cout || !cpu(*bias))) return false;
  if (x.scalar_type() != w.scalar_type() || down.scalar_type() != up.scalar_type()) return false;
  if (!cpu(x) || !cpu(w) || !cpu(down) || !cpu(up)) return false;
  if (w.requires_grad() && at::GradMode::is_enabled()) return false;  // Python refuses
  const int64_t ks[2] = {kh, kw};
  for (int i = 0; i < 2; ++i) {
    if (geo.stride[i] < 1 || geo.dilation[i] < 1 || geo.padding[i] < 0) return false;
    const int64_t span = x.size(2 + i) + 2 * geo.padding[i] - geo.dilation[i] * (ks[i] - 1) - 1;
    if (span < 0) return false;  // output size (span / stride + 1) below 1
  }
  return !at::autocast::is_autocast_enabled(at::kCPU);
}

}  // namespace

OptTensor lora_linear_fast(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                           const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling) {
  if (!linear_eligible(x, weight, bias, lora_A, lora_B)) return c10::nullopt;
  const at::Tensor none;
  const bool graph = at::GradMode::is_enabled() &&
                     any_requires_grad({&x, &lora_A, &lora_B, has(bias) ? &*bias : &none});
  if (graph) return LoRALinearFunction::apply(x, weight, bias, lora_A, lora_B, scaling);
  // No graph to build (no_grad, or frozen everything): the forward kernel alone, xa dropped.
  KernelGuard guard;
  const int64_t d = x.size(-1);
  at::Tensor y = std::get<0>(lora_linear_forward(x.reshape({-1, d}).contiguous(), weight, bias,
                                                 lora_A, lora_B, scaling, c10::nullopt, 1.0));
  auto out = x.sizes().vec();
  out.back() = weight.size(0);
  return x.dim() == 2 ? y : at::_unsafe_view(y, out);
}

OptTensor lora_conv2d_fast(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                           const at::Tensor& lora_down, const at::Tensor& lora_up,
                           double scaling, std::vector<int64_t> stride,
                           std::vector<int64_t> padding, std::vector<int64_t> dilation,
                           int64_t groups) {
  ConvGeometry geo{std::move(stride), std::move(padding), std::move(dilation), groups};
  if (!conv_eligible(x, weight, bias, lora_down, lora_up, geo)) return c10::nullopt;
  const at::Tensor none;
  const bool graph = at::GradMode::is_enabled() &&
                     any_requires_grad({&x, &lora_down, &lora_up, has(bias) ? &*bias : &none});
  if (graph) return LoRAConv2dFunction::apply(x, weight, bias, lora_down, lora_up, scaling, geo);
  KernelGuard guard;
  return std::get<0>(lora_conv2d_forward(x, weight, bias, lora_down, lora_up, scaling,
                                         geo.stride, geo.padding, geo.dilation, geo.groups));
}

}  // namespace lorafuse
