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
// -1.5 at (N, d, r) = (111, 129, 1), 30x its own rounding. The (N, k, d) dx product stays a
// native bf16 GEMM.
//
// Every rank-r product with fp32 operands (fp32 adapters, PEFT's default, on any base; the fp32
// products above) runs through lora_rank.cpp: the bf16/fp16 operand (x or g) is converted to fp32
// by row tiles in cache and the up-projections are added into the low-precision output tile by
// tile with one rounding, so no (N, d) or (N, k) fp32 tensor is formed (the dropout mask is folded
// into those tiles too). Same fp32 products as `x.to(fp32) @ ...`, up to summation order.
#include "common.h"
#include "lora_rank.h"

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

// Whether the rank-r products run through lora_rank.cpp: they are fp32 (`rank`) and the outputs
// they add into are fp32/bf16/fp16 (`base`; a float64 base keeps the plain products).
bool rank_fp32(at::ScalarType rank, at::ScalarType base) {
  return rank == at::kFloat && (base == at::kFloat || low_precision(base));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> lora_linear_forward(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
    const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling, const OptTensor& mask,
    double keep) {
  LORAFUSE_PROFILE_RANGE("lora_linear_forward");
  check_shapes(x, weight, lora_A, lora_B);
  check_mask(mask, x, keep);
  const auto cx = matmul_dtype(x.scalar_type());       // base product dtype
  const auto ca = matmul_dtype(lora_A.scalar_type());  // LoRA branch dtype
  at::Tensor xc = as(x, cx);
  at::Tensor wt = as(weight, cx).t();  // (d, k) view
  at::Tensor y = has(bias) ? at::addmm(as(*bias, cx), xc, wt) : at::mm(xc, wt);  // (N, k)
  if (rank_fp32(ca, cx)) {  // fp32 adapters: by tiles, no fp32 copy of x, no (N, k) fp32 term
    at::Tensor xa = rank_down(ca == cx ? xc : x, as(lora_A, at::kFloat), mask, keep);  // (N, r)
    rank_up_add_(y, xa, as(lora_B, at::kFloat), scaling);  // y = round(y + s·xa·Bᵀ)
    return {as(y, x.scalar_type()), as(xa, lora_A.scalar_type())};
  }
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
  LORAFUSE_PROFILE_RANGE("lora_linear_backward");
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
  const auto at_ = lora_A.scalar_type();
  // A native low-precision branch keeps the rank-r products (gB, dB, dA) in fp32, each result
  // rounded once (see the header comment); fp32 adapters compute them in fp32 anyway.
  const bool exact_r = low_precision(ca);
  const auto cr = exact_r ? at::kFloat : ca;
  at::Tensor gc = need_dx ? as(g, cx) : at::Tensor();  // (N, k) in the base product dtype
  at::Tensor gB;                                        // (N, r) in cr
  if (rank_fp32(cr, cx)) {  // by tiles (lora_rank.cpp): no fp32 copy of g or x
    // g as the base product reads it when that is an fp32 copy made anyway (emulated bf16)
    const at::Tensor& gr = gc.defined() && gc.scalar_type() == at::kFloat ? gc : g;
    auto [gB_, dB_] = rank_grads(gr, as(lora_B, at::kFloat), as(xa, at::kFloat), scaling,
                                 need_dx || need_dA, need_dB);
    gB = gB_;
    if (need_dB) dB = as(dB_, at_);                                       // (k, r)
    if (need_dA) dA = as(rank_dA(gB, x, mask, keep), at_);                // (r, d)
  } else {
    at::Tensor gr = as(g, cr);  // (N, k)
    if (need_dx || need_dA) gB = at::mm(gr, as(lora_B, cr)).mul_(scaling);
    if (need_dB) dB = as(at::mm(gr.t(), as(xa, cr)).mul_(scaling), at_);  // (k, r)
    if (need_dA) dA = as(at::mm(gB.t(), dropped(x, mask, keep, cr)), at_);  // (r, d)
  }
  if (need_dx) {
    at::Tensor dxc = at::mm(gc, as(weight, cx));  // (N, d)
    if (ca == at::kFloat && rank_fp32(ca, cx)) {
      rank_dx_add_(dxc, gB, as(lora_A, at::kFloat), mask, keep);  // one rounding, by tiles
    } else {
      // exact_r: gB rounded to the adapter dtype, a term of dx, not a sum that cancels: native
      at::Tensor gBc = as(gB, ca);
      at::Tensor Ac = as(lora_A, ca);
      if (!has(mask)) {
        if (ca == cx) {
          dxc.addmm_(gBc, Ac);
        } else {
          dxc.add_(at::mm(gBc, Ac));
        }
      } else {
        at::Tensor dl = as(at::mm(gBc, Ac), cx);  // (N, d)
        const float inv_keep = static_cast<float>(1.0 / keep);
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cx, "lora_dx_mask", [&] {
          masked_axpy<scalar_t>(dxc.mutable_data_ptr<scalar_t>(), dl.const_data_ptr<scalar_t>(),
                                mask->const_data_ptr<bool>(), dxc.numel(), inv_keep);
        });
      }
    }
    dx = as(dxc, x.scalar_type());
  }
  if (need_db) db = at::sum(g, {0}, false, at::kFloat).to(g.scalar_type());  // (k,)
  return {dx, dA, dB, db};
}

}  // namespace lorafuse
