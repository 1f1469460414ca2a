// Fused LoRA linear: y = x·Wᵀ (+ b) + s·(dropout(x)·Aᵀ)·Bᵀ and its backward (the contract of
// ops/lora_linear.py: _torch_forward / _torch_backward).
//
// Versus the torch reference this saves the (N, k) temporaries of `F.linear(xa, B)`, `* s` and
// `y + ...` (the LoRA term is accumulated into y by one in-place addmm_), fuses the dropout
// multiplier (mask / keep) into one pass, and computes bf16/fp16 products in fp32 where those
// GEMMs are not native (common.h). Shapes: x (N,d), W (k,d), b (k,), A (r,d), B (k,r), mask (N,d).
//
// Where bf16/fp16 GEMMs ARE native, the backward still computes the rank-r products gB = s·g·B,
// dA = gBᵀ·x and dB = s·gᵀ·xa in fp32 and rounds each result once, instead of rounding gB to bf16
// first as the torch reference and stock autograd do: dA sums N terms gB[i]·x[i] that can cancel,
// and a rounded gB put an error of 2^-9·|gB|·sqrt(N) into every element, ~0.75 on an element of
// -1.5 at (N, d, r) = (111, 129, 1), 30x its own rounding. Cost: fp32 copies of g and x for
// products of rank r; the (N, k, d) dx product stays a native bf16 GEMM.
#include "common.h"

namespace lorafuse {
namespace {

// out = mask ? src * inv_keep : 0  (one pass instead of mask.to(), div_(), mul())
template <typename T>
void masked_scale(const T* src, const bool* mask, T* out, int64_t n, float inv_keep) {
  at::parallel_for(0, n, 32768, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      out[i] = mask[i] ? static_cast<T>(static_cast<float>(src[i]) * inv_keep) : T(0);
    }
  });
}

// dst += mask ? src * inv_keep : 0
template <typename T>
void masked_axpy(T* dst, const T* src, const bool* mask, int64_t n, float inv_keep) {
  at::parallel_for(0, n, 32768, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      if (mask[i]) dst[i] = static_cast<T>(static_cast<float>(dst[i]) +
                                           static_cast<float>(src[i]) * inv_keep);
    }
  });
}

// The LoRA branch input dropout(x) in dtype `dt`: x itself when no cast and no mask.  (N, d)
at::Tensor dropped(const at::Tensor& x, const OptTensor& mask, double keep, at::ScalarType dt) {
  at::Tensor xs = x.scalar_type() == dt ? x : x.to(dt);
  if (!mask.has_value() || !mask->defined()) return xs;
  const at::Tensor& m = *mask;
  at::Tensor out = at::empty_like(xs);
  const float inv_keep = static_cast<float>(1.0 / keep);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "lora_dropped", [&] {
    masked_scale<scalar_t>(xs.const_data_ptr<scalar_t>(), m.const_data_ptr<bool>(),
                           out.mutable_data_ptr<scalar_t>(), xs.numel(), inv_keep);
  });
  return out;
}

at::Tensor as(const at::Tensor& t, at::ScalarType dt) {
  return t.scalar_type() == dt ? t : t.to(dt);
}

bool has(const OptTensor& t) { return t.has_value() && t->defined(); }

void check_mask(const OptTensor& mask, const at::Tensor& x, double keep) {
  if (!has(mask)) return;
  TORCH_CHECK(mask->scalar_type() == at::kBool, "lora_linear: mask must be bool, got ",
              mask->scalar_type());
  TORCH_CHECK(mask->sizes() == x.sizes() && mask->is_contiguous(),
              "lora_linear: mask must be contiguous with shape ", x.sizes(), ", got ",
              mask->sizes());
  TORCH_CHECK(keep > 0.0 && keep <= 1.0, "lora_linear: keep must be in (0, 1], got ", keep);
}

void check_shapes(const at::Tensor& x, const at::Tensor& w, const at::Tensor& A,
                  const at::Tensor& B) {
  check_2d(x, "lora_linear", "x");
  check_2d(w, "lora_linear", "weight");
  check_2d(A, "lora_linear", "lora_A");
  check_2d(B, "lora_linear", "lora_B");
  TORCH_CHECK(w.size(1) == x.size(1), "lora_linear: weight ", w.sizes(), " does not match x ",
              x.sizes());
  TORCH_CHECK(A.size(1) == x.size(1), "lora_linear: lora_A ", A.sizes(), " does not match x ",
              x.sizes());
  TORCH_CHECK(B.size(0) == w.size(0) && B.size(1) == A.size(0), "lora_linear: lora_B ",
              B.sizes(), " does not match weight ", w.sizes(), " and lora_A ", A.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "lora_linear: x dtype ", x.scalar_type(),
              " != weight dtype ", w.scalar_type());
  TORCH_CHECK(A.scalar_type() == B.scalar_type(), "lora_linear: lora_A dtype ",
              A.scalar_type(), " != lora_B dtype ", B.scalar_type());
}

bool low_precision(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

}  // namespace

std::tuple<at::Tensor, at::Tensor> lora_linear_forward(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
    const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling, const OptTensor& mask,
    double keep) {
  check_shapes(x, weight, lora_A, lora_B);
  check_mask(mask, x, keep);
  const auto cx = matmul_dtype(x.scalar_type());       // base product dtype
  const auto ca = matmul_dtype(lora_A.scalar_type());  // LoRA branch dtype
  at::Tensor xc = as(x, cx);
  at::Tensor wt = as(weight, cx).t();  // (d, k) view
  at::Tensor y = has(bias) ? at::addmm(as(*bias, cx), xc, wt) : at::mm(xc, wt);  // (N, k)
  at::Tensor xl = dropped(ca == cx ? xc : x, mask, keep, ca);                    // (N, d)
  at::Tensor xa = at::mm(xl, as(lora_A, ca).t());                                 // (N, r)
  at::Tensor bt = as(lora_B, ca).t();                                             // (r, k)
  if (ca == cx) {
    y.addmm_(xa, bt, /*beta=*/1, /*alpha=*/scaling);  // LoRA term accumulated in place
  } else {
    y.add_(at::mm(xa, bt), scaling);
  }
  return {as(y, x.scalar_type()), as(xa, lora_A.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_linear_backward(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& lora_A, const at::Tensor& lora_B, const at::Tensor& xa, double scaling,
    const OptTensor& mask, double keep, std::tuple<bool, bool, bool, bool> needs) {
  check_shapes(x, weight, lora_A, lora_B);
  check_mask(mask, x, keep);
  check_2d(g, "lora_linear backward", "grad_output");
  TORCH_CHECK(g.size(0) == x.size(0) && g.size(1) == weight.size(0),
              "lora_linear backward: grad_output ", g.sizes(), " does not match (N, k) = (",
              x.size(0), ", ", weight.size(0), ")");
  auto [need_dx, need_dA, need_dB, need_db] = needs;
  const auto cx = matmul_dtype(x.scalar_type());
  const auto ca = matmul_dtype(lora_A.scalar_type());
  at::Tensor dx, dA, dB, db;
  at::Tensor ga = as(g, ca);  // (N, k) in the LoRA branch dtype
  at::Tensor Ac = as(lora_A, ca);
  // A native low-precision branch keeps the rank-r products (gB, dB, dA) in fp32, each result
  // rounded once (see the header comment): g and x are cast for them ((N, k) and (N, d) copies,
  // the size of g and x; the products are rank r, the big dx GEMM stays native).
  const bool exact_r = low_precision(ca);
  const auto cr = exact_r ? at::kFloat : ca;
  at::Tensor gr = as(g, cr);  // (N, k)
  at::Tensor gB;              // (N, r) in cr
  if (need_dx || need_dA) gB = at::mm(gr, as(lora_B, cr)).mul_(scaling);
  if (need_dB) {
    dB = at::mm(gr.t(), as(xa, cr)).mul_(scaling);  // (k, r)
    dB = as(dB, lora_A.scalar_type());
  }
  if (need_dA) {
    at::Tensor xl = dropped(x, mask, keep, cr);  // (N, d) recomputed, never saved
    dA = as(at::mm(gB.t(), xl), lora_A.scalar_type());  // (r, d)
  }
  if (need_dx) {
    if (exact_r) gB = gB.to(ca);  // a term of dx, not a sum that cancels: native product
    at::Tensor dxc = at::mm(ca == cx ? ga : as(g, cx), as(weight, cx));  // (N, d)
    if (!has(mask)) {
      if (ca == cx) {
        dxc.addmm_(gB, Ac);
      } else {
        dxc.add_(at::mm(gB, Ac));
      }
    } else {
      at::Tensor dl = as(at::mm(gB, Ac), cx);  // (N, d)
      const float inv_keep = static_cast<float>(1.0 / keep);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cx, "lora_dx_mask", [&] {
        masked_axpy<scalar_t>(dxc.mutable_data_ptr<scalar_t>(), dl.const_data_ptr<scalar_t>(),
                              mask->const_data_ptr<bool>(), dxc.numel(), inv_keep);
      });
    }
    dx = as(dxc, x.scalar_type());
  }
  if (need_db) db = at::sum(g, {0}, false, at::kFloat).to(g.scalar_type());  // (k,)
  return {dx, dA, dB, db};
}

}  // namespace lorafuse
