// SwiGLU: h = silu(gate) * up, silu(z) = z * sigmoid(z); fp32 math, gate's dtype out.
// Backward recomputes sigmoid from gate (nothing but gate/up is saved), dgate optionally into g:
//   dgate = g * up * s * (1 + gate * (1 - s)),  dup = g * gate * s,  s = sigmoid(gate).
// Every element goes through the same vector math (the ragged end too, via fp32 buffers), so the
// results do not depend on where the thread split falls. Accuracy against float64 and the speed
// against the previous kernel: tests/ops/test_swiglu.py, benchmarks/ops/swiglu.py.
#include "common.h"

#include <type_traits>

namespace lorafuse {
namespace {

using bf16 = at::BFloat16;

// a where z >= 0 (or NaN), b where z < 0. AVX-512: a compare into a mask register and a masked
// blend, where ATen's operator< and blendv take two instructions each (a vector mask).
inline fVec where_negative(const fVec& z, const fVec& a, const fVec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ), a, b);
#else
  return fVec::blendv(a, b, z < fVec(0.f));
#endif
}

// sigmoid(z) and 1 - sigmoid(z) from e = exp(-|z|) and r = 1 / (1 + e):
//   z >= 0: s = r, 1 - s = e·r;     z < 0: s = e·r, 1 - s = r.
// exp's argument is never positive, so 1 + e stays in [1, 2]: no inf / inf as z -> -inf, s keeps
// its relative accuracy down to the denormals (1 / (1 + exp(-z)) is 0 below z = -88.7), and 1 - s
// needs no subtraction (no cancellation as s -> 1). exp_fast (common.h) is within 2 ulp, the
// division and the product round once each: s and 1 - s are within 3 ulp of the true values.
// A division, not rcp14 and a Newton step: that ran no faster here (the loop is bound by its
// ~30 other vector operations, not the divider), and the division rounds correctly everywhere.
inline void sigmoid_parts(const fVec& z, fVec& s, fVec* one_minus_s) {
  const fVec e = exp_fast(z | fVec(-0.f));  // exp(-|z|): the sign bit set; NaN stays NaN
  const fVec r = fVec(1.f) / (fVec(1.f) + e);
  const fVec er = e * r;
  s = where_negative(z, r, er);
  if (one_minus_s) *one_minus_s = where_negative(z, er, r);
}

inline fVec silu_times(const fVec& z, const fVec& u) {  // z * sigmoid(z) * u
  fVec s;
  sigmoid_parts(z, s, nullptr);
  return z * s * u;
}

inline void silu_grads(const fVec& z, const fVec& u, const fVec& g, fVec& dgate, fVec& dup) {
  fVec s, c;
  sigmoid_parts(z, s, &c);
  // s times its own factor first: near z = -87, where s nears the denormals, s·(1 + z(1 - s))
  // is ~|z|·s, so it stays a normal float where g·up·s (the reference's order) might not.
  dgate = s * at::vec::fmadd(z, c, fVec(1.f)) * u * g;
  dup = z * s * g;
}

// The ragged end (n < kW elements) as zero-padded fp32 vectors, and back rounded to T (the same
// round-to-nearest-even as the vector stores).
template <typename T>
inline fVec load_part(const T* p, int64_t n) {
  alignas(64) float buf[kW] = {};
  for (int64_t k = 0; k < n; ++k) buf[k] = static_cast<float>(p[k]);
  return fVec::loadu(buf);
}
template <typename T>
inline void store_part(T* p, const fVec& v, int64_t n) {
  alignas(64) float buf[kW];
  v.store(buf);
  for (int64_t k = 0; k < n; ++k) p[k] = static_cast<T>(buf[k]);
}

template <typename T, typename Rounding>
void forward_range(const T* gate, const T* up, T* h, int64_t b, int64_t e) {
  int64_t i = b;
  for (; i + kW <= e; i += kW) {
    Rounding::store(h + i, silu_times(load_f(gate + i), load_f(up + i)));
  }
  if (i < e) {
    const int64_t n = e - i;
    store_part(h + i, silu_times(load_part(gate + i, n), load_part(up + i, n)), n);
  }
}

template <typename T, typename Rounding>
void backward_range(const T* g, const T* gate, const T* up, T* dgate, T* dup, int64_t b,
                    int64_t e) {
  fVec dg, du;
  int64_t i = b;
  for (; i + kW <= e; i += kW) {
    silu_grads(load_f(gate + i), load_f(up + i), load_f(g + i), dg, du);
    Rounding::store(dgate + i, dg);
    Rounding::store(dup + i, du);
  }
  if (i < e) {
    const int64_t n = e - i;
    silu_grads(load_part(gate + i, n), load_part(up + i, n), load_part(g + i, n), dg, du);
    store_part(dgate + i, dg, n);
    store_part(dup + i, du, n);
  }
}

#if defined(LORAFUSE_NATIVE_BF16_ROUNDING)
LORAFUSE_NATIVE_BF16_TARGET void forward_range_native(const bf16* gate, const bf16* up, bf16* h,
                                                      int64_t b, int64_t e) {
  forward_range<bf16, Bf16RoundingNative>(gate, up, h, b, e);
}
LORAFUSE_NATIVE_BF16_TARGET void backward_range_native(const bf16* g, const bf16* gate,
                                                       const bf16* up, bf16* dgate, bf16* dup,
                                                       int64_t b, int64_t e) {
  backward_range<bf16, Bf16RoundingNative>(g, gate, up, dgate, dup, b, e);
}
#endif

// Whether bf16 stores run VCVTNEPS2BF16 here (common.h: the same bits as ATen's conversion).
template <typename T>
bool native_rounding_for() {
  return std::is_same_v<T, bf16> && native_bf16_rounding();
}

template <typename T>
void forward_elems(const T* gate, const T* up, T* h, int64_t n) {
  const bool native = native_rounding_for<T>();
  parallel_rows(n, 32768, [&](int64_t b, int64_t e) {
#if defined(LORAFUSE_NATIVE_BF16_ROUNDING)
    if constexpr (std::is_same_v<T, bf16>) {
      if (native) return forward_range_native(gate, up, h, b, e);
    }
#endif
    (void)native;
    forward_range<T, Bf16Rounding>(gate, up, h, b, e);
  });
}

template <typename T>
void backward_elems(const T* g, const T* gate, const T* up, T* dgate, T* dup, int64_t n) {
  const bool native = native_rounding_for<T>();
  parallel_rows(n, 32768, [&](int64_t b, int64_t e) {
#if defined(LORAFUSE_NATIVE_BF16_ROUNDING)
    if constexpr (std::is_same_v<T, bf16>) {
      if (native) return backward_range_native(g, gate, up, dgate, dup, b, e);
    }
#endif
    (void)native;
    backward_range<T, Bf16Rounding>(g, gate, up, dgate, dup, b, e);
  });
}

void check_pair(const at::Tensor& a, const at::Tensor& b, const char* op, const char* na,
                const char* nb) {
  check_2d(a, op, na);
  check_2d(b, op, nb);
  TORCH_CHECK(a.sizes() == b.sizes(), op, ": ", na, " ", a.sizes(), " and ", nb, " ",
              b.sizes(), " differ in shape");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", na, " dtype ", a.scalar_type(),
              " != ", nb, " dtype ", b.scalar_type());
}

}  // namespace

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  LORAFUSE_PROFILE_RANGE("swiglu_forward");
  check_pair(gate, up, "swiglu", "gate", "up");
  at::Tensor h = at::empty_like(gate);
  LORAFUSE_DISPATCH(gate.scalar_type(), "swiglu_fwd",
                                  [&] {
                                    forward_elems<scalar_t>(gate.const_data_ptr<scalar_t>(),
                                                            up.const_data_ptr<scalar_t>(),
                                                            h.mutable_data_ptr<scalar_t>(),
                                                            gate.numel());
                                  });
  return h;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& g, const at::Tensor& gate,
                                                   const at::Tensor& up, bool dgate_into_g) {
  LORAFUSE_PROFILE_RANGE("swiglu_backward");
  check_pair(gate, up, "swiglu backward", "gate", "up");
  check_2d(g, "swiglu backward", "grad_output");
  TORCH_CHECK(g.sizes() == gate.sizes(), "swiglu backward: grad_output ", g.sizes(),
              " != gate ", gate.sizes());
  at::Tensor gc = g.scalar_type() == gate.scalar_type() ? g : g.to(gate.scalar_type());
  // dgate_into_g: every element of g is loaded before its dgate is stored (one vector step, or
  // the ragged end's buffer), so dgate may take g's buffer (or its cast copy's): the fused MLP's
  // backward then holds one (N, I) tensor fewer.
  at::Tensor dgate = dgate_into_g ? gc : at::empty_like(gate), dup = at::empty_like(up);
  LORAFUSE_DISPATCH(gate.scalar_type(), "swiglu_bwd",
                                  [&] {
                                    backward_elems<scalar_t>(
                                        gc.const_data_ptr<scalar_t>(),
                                        gate.const_data_ptr<scalar_t>(),
                                        up.const_data_ptr<scalar_t>(),
                                        dgate.mutable_data_ptr<scalar_t>(),
                                        dup.mutable_data_ptr<scalar_t>(), gate.numel());
                                  });
  return {dgate, dup};
}

}  // namespace lorafuse
