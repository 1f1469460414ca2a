// SwiGLU: h = silu(gate) * up, silu(z) = z * sigmoid(z); fp32 math, gate's dtype out.
// Backward recomputes sigmoid from gate (nothing but gate/up is saved):
//   dgate = g * up * s * (1 + gate * (1 - s)),  dup = g * gate * s,  s = sigmoid(gate).
#include "common.h"

#include <cmath>

namespace lorafuse {
namespace {

inline fVec sigmoid(const fVec& z) {
  const fVec one(1.f);
  return one / (one + z.neg().exp());
}
inline float sigmoid_s(float z) { return 1.f / (1.f + std::exp(-z)); }

template <typename T>
void forward_elems(const T* gate, const T* up, T* h, int64_t n) {
  at::parallel_for(0, n, 32768, [&](int64_t b, int64_t e) {
    int64_t i = b;
    for (; i + kW <= e; i += kW) {
      fVec z = load_f(gate + i);
      store_f(h + i, z * sigmoid(z) * load_f(up + i));
    }
    for (; i < e; ++i) {
      float z = static_cast<float>(gate[i]);
      h[i] = static_cast<T>(z * sigmoid_s(z) * static_cast<float>(up[i]));
    }
  });
}

template <typename T>
void backward_elems(const T* g, const T* gate, const T* up, T* dgate, T* dup, int64_t n) {
  at::parallel_for(0, n, 32768, [&](int64_t b, int64_t e) {
    const fVec one(1.f);
    int64_t i = b;
    for (; i + kW <= e; i += kW) {
      fVec z = load_f(gate + i), u = load_f(up + i), gv = load_f(g + i);
      fVec s = sigmoid(z);
      store_f(dgate + i, gv * u * s * (one + z * (one - s)));
      store_f(dup + i, gv * z * s);
    }
    for (; i < e; ++i) {
      float z = static_cast<float>(gate[i]), u = static_cast<float>(up[i]);
      float gv = static_cast<float>(g[i]), s = sigmoid_s(z);
      dgate[i] = static_cast<T>(gv * u * s * (1.f + z * (1.f - s)));
      dup[i] = static_cast<T>(gv * z * s);
    }
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
                                                   const at::Tensor& up) {
  check_pair(gate, up, "swiglu backward", "gate", "up");
  check_2d(g, "swiglu backward", "grad_output");
  TORCH_CHECK(g.sizes() == gate.sizes(), "swiglu backward: grad_output ", g.sizes(),
              " != gate ", gate.sizes());
  at::Tensor gc = g.scalar_type() == gate.scalar_type() ? g : g.to(gate.scalar_type());
  at::Tensor dgate = at::empty_like(gate), dup = at::empty_like(up);
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
