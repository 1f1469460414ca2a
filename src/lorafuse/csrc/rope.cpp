// Rotary embedding (HF rotate_half layout), q and k in one call:
//   out = t*cos + rotate_half(t)*sin, rotate_half(t) = cat(-t[D/2:], t[:D/2])
// i.e. with h = D/2, for j < h:  out[j] = t[j]cos[j] - t[j+h]sin[j]
//                                out[j+h] = t[j+h]cos[j+h] + t[j]sin[j+h]
// Backward applies the transpose (the inverse rotation when cos²+sin²=1):
//   dt[j] = do[j]cos[j] + do[j+h]sin[j+h],  dt[j+h] = do[j+h]cos[j+h] - do[j]sin[j]
// Shapes: q (B,Hq,T,D), k (B,Hk,T,D), cos/sin (B or 1,T,D), fp32 or q's dtype; fp32 math, one
// rounding per output (rope_stepwise: transformers' roundings, for decoding).
#include "common.h"

namespace lorafuse {
namespace {

template <typename T, bool kInverse>
void rotate_row(const T* t, const float* c, const float* s, T* o, int64_t h) {
  int64_t j = 0;
  for (; j + kW <= h; j += kW) {
    fVec t1 = load_f(t + j), t2 = load_f(t + h + j);
    fVec c1 = fVec::loadu(c + j), c2 = fVec::loadu(c + h + j);
    fVec s1 = fVec::loadu(s + j), s2 = fVec::loadu(s + h + j);
    if (kInverse) {
      store_f(o + j, t1 * c1 + t2 * s2);
      store_f(o + h + j, t2 * c2 - t1 * s1);
    } else {
      store_f(o + j, t1 * c1 - t2 * s1);
      store_f(o + h + j, t2 * c2 + t1 * s2);
    }
  }
  for (; j < h; ++j) {
    float t1 = static_cast<float>(t[j]), t2 = static_cast<float>(t[h + j]);
    if (kInverse) {
      o[j] = static_cast<T>(t1 * c[j] + t2 * s[h + j]);
      o[h + j] = static_cast<T>(t2 * c[h + j] - t1 * s[j]);
    } else {
      o[j] = static_cast<T>(t1 * c[j] - t2 * s[j]);
      o[h + j] = static_cast<T>(t2 * c[h + j] + t1 * s[h + j]);
    }
  }
}

// transformers' own roundings: each product rounded to T, then their sum (apply_rotary_pos_emb's
// q*cos + rotate_half(q)*sin in T's arithmetic), so decoding through it keeps transformers' values
// bit for bit. -t2*s rounds as -(t2*s): round-to-nearest-even is symmetric.
template <typename T>
void rotate_row_stepwise(const T* t, const float* c, const float* s, T* o, int64_t h) {
  int64_t j = 0;
  for (; j + kW <= h; j += kW) {
    fVec t1 = load_f(t + j), t2 = load_f(t + h + j);
    fVec a1 = round_to<T>(t1 * fVec::loadu(c + j)), b1 = round_to<T>(t2 * fVec::loadu(s + j));
    fVec a2 = round_to<T>(t2 * fVec::loadu(c + h + j));
    fVec b2 = round_to<T>(t1 * fVec::loadu(s + h + j));
    store_f(o + j, a1 - b1);
    store_f(o + h + j, a2 + b2);
  }
  for (; j < h; ++j) {
    float t1 = static_cast<float>(t[j]), t2 = static_cast<float>(t[h + j]);
    o[j] = static_cast<T>(round_to_s<T>(t1 * c[j]) - round_to_s<T>(t2 * s[j]));
    o[h + j] = static_cast<T>(round_to_s<T>(t2 * c[h + j]) + round_to_s<T>(t1 * s[h + j]));
  }
}

template <typename T, bool kInverse, bool kStepwise>
void rotate_all(const T* q, const T* k, const float* c, const float* s, T* qo, T* ko,
                int64_t B, int64_t Hq, int64_t Hk, int64_t T_, int64_t D, int64_t cos_batch) {
  const int64_t rq = B * Hq * T_, rk = B * Hk * T_;
  parallel_rows(rq + rk, row_grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const bool is_q = row < rq;
      const int64_t rr = is_q ? row : row - rq;
      const int64_t H = is_q ? Hq : Hk;
      const int64_t b = rr / (H * T_), t = rr % T_;
      const int64_t crow = (cos_batch == 1 ? 0 : b) * T_ + t;
      const T* src = (is_q ? q : k) + rr * D;
      T* dst = (is_q ? qo : ko) + rr * D;
      if constexpr (kStepwise) {
        rotate_row_stepwise<T>(src, c + crow * D, s + crow * D, dst, D / 2);
      } else {
        rotate_row<T, kInverse>(src, c + crow * D, s + crow * D, dst, D / 2);
      }
    }
  });
}

template <bool kInverse, bool kStepwise = false>
std::tuple<at::Tensor, at::Tensor> rope_apply(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = kStepwise ? "rope_stepwise" : kInverse ? "rope backward" : "rope";
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, op, ": q and k must be (B, H, T, D), got ",
              q.sizes(), " and ", k.sizes());
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous(), op, ": q and k must be contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), T_ = q.size(2), D = q.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(2) == T_ && k.size(3) == D, op, ": k ", k.sizes(),
              " does not match q ", q.sizes());
  TORCH_CHECK(D % 2 == 0, op, ": head dim must be even, got ", D);
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), op, ": q dtype ", q.scalar_type(),
              " != k dtype ", k.scalar_type());
  // Its roundings to bf16/fp16 keep each product apart; in fp32 the compiler may contract a
  // product and the sum into one FMA, which transformers' separate ops do not.
  TORCH_CHECK(!kStepwise || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "rope_stepwise: q must be bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(1) == T_ &&
                  cos.size(2) == D && (cos.size(0) == B || cos.size(0) == 1),
              op, ": cos/sin must be (", B, " or 1, ", T_, ", ", D, "), got ", cos.sizes(),
              " and ", sin.sizes());
  // cos/sin are (B,T,D): small next to q/k (no head dim), so one fp32 copy is cheap.
  at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  at::Tensor qo = at::empty_like(q), ko = at::empty_like(k);
  LORAFUSE_DISPATCH(q.scalar_type(), "rope", [&] {
    rotate_all<scalar_t, kInverse, kStepwise>(
        q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(), c.const_data_ptr<float>(),
        s.const_data_ptr<float>(), qo.mutable_data_ptr<scalar_t>(),
        ko.mutable_data_ptr<scalar_t>(), B, Hq, k.size(1), T_, D, c.size(0));
  });
  return {qo, ko};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rope_forward(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& cos, const at::Tensor& sin) {
  LORAFUSE_PROFILE_RANGE("rope_forward");
  return rope_apply<false>(q, k, cos, sin);
}

std::tuple<at::Tensor, at::Tensor> rope_stepwise(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& cos, const at::Tensor& sin) {
  LORAFUSE_PROFILE_RANGE("rope_stepwise");
  return rope_apply<false, true>(q, k, cos, sin);
}

std::tuple<at::Tensor, at::Tensor> rope_backward(const at::Tensor& dq, const at::Tensor& dk,
                                                 const at::Tensor& cos, const at::Tensor& sin) {
  LORAFUSE_PROFILE_RANGE("rope_backward");
  return rope_apply<true>(dq, dk, cos, sin);
}

}  // namespace lorafuse
