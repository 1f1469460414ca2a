// Fused mixture-of-experts LoRA, forward and backward: the contract of ops/moe_lora_groups.py
// (forward / backward), with its loop over the non-empty expert groups here in C++.
//
// The routed pairs arrive sorted by expert (tok: the token row of each pair, ws: its router
// weight, counts: pairs per expert), so expert e owns one contiguous slice. Per group (n rows):
//   gu = x_e·W_guᵀ (+ b) + s·(x_e·Aᵀ)·Bᵀ       one GEMM in x's dtype, rank-r products in fp32
//   h  = act(gu)                                 one fp32 pass, rounded once (kernel below)
//   out[tok] += ws·(h·W_dᵀ (+ b) + s·(h·Aᵀ)·Bᵀ)  the down GEMM, then one pass that adds the LoRA
//                                                term, the bias and the weight into fp32 rows
// Backward takes gu (and x·Aᵀ) as forward saved them (else recomputes them per group), recomputes
// h, then u = g_e·W_d,eff (n, I) in fp32 sums, and one pass gives the router
// weight's gradient Σ h·u (+ g·b), dh = ws·u and the activation's backward dgu (fp32); then the
// LoRA gradients (fp32 GEMMs of rank r) and dx_e = dgu·W_gu,eff scattered back per token.
// Within a group every token appears once (top-k picks distinct experts), so the scatters run
// rows in parallel without races. Experts without pairs are never visited. Base weights are
// dense (E, out, in) / (E, in, out) stacks or NF4 stacks (codes, absmax_q, scale, offset with
// one row per expert), dequantised per group into a transient buffer.
#include "common.h"

#include <cmath>
#include <tuple>
#include <utility>

namespace lorafuse {
namespace {

constexpr int64_t kSwiglu = 0;         // silu(gate)·up
constexpr int64_t kClampedSwiglu = 1;  // gpt-oss: (clamp(up, ±l) + 1)·g·sigmoid(α·g), g = min(gate, l)

struct Act {
  int64_t kind;
  bool interleaved;
  float alpha, limit;
};

// One projection of every expert: base stack (dense or NF4), bias, LoRA factors.
struct Stack {
  OptTensor w;                   // (E, a, b) dense, or none for NF4
  std::vector<at::Tensor> nf4;   // codes (E, ·), absmax_q (E, ·), scale (E, ·), offset (E,)
  std::vector<int64_t> shape;    // (E, a, b): the storage layout
  OptTensor bias, A, B;          // (E, out), (E, r, in), (E, out, r)
  double s;
  bool transposed;               // storage (E, in, out) (gpt-oss)

  bool lora() const { return A.has_value() && A->defined(); }
  bool has_bias() const { return bias.has_value() && bias->defined(); }
  // Expert e's base weight in its storage layout (a, b), in dtype dt.
  at::Tensor weight(int64_t e, at::ScalarType dt) const {
    if (w.has_value() && w->defined()) return w->select(0, e);
    at::Tensor out = at::empty({shape[1], shape[2]}, at::TensorOptions().dtype(dt));
    nf4_dequantize_forward(nf4[0].select(0, e), nf4[1].select(0, e), nf4[2].select(0, e),
                           nf4[3].select(0, e), out, true);
    return out;
  }
  // v·W_eᵀ (n, out) and g·W_e (n, in) in v's / g's dtype.
  at::Tensor apply(const at::Tensor& v, int64_t e) const;
  at::Tensor apply_t(const at::Tensor& g, int64_t e) const;
  at::Tensor apply_t_f32(const at::Tensor& g, int64_t e) const;
  at::Tensor Af(int64_t e) const { return A->select(0, e).to(at::kFloat); }  // (r, in)
  at::Tensor Bf(int64_t e) const { return B->select(0, e).to(at::kFloat); }  // (out, r)
};

// a·b in a's dtype, the product run in matmul_dtype (fp32 where bf16 / fp16 GEMMs are emulated).
at::Tensor product(const at::Tensor& a, const at::Tensor& b) {
  const at::ScalarType dt = a.scalar_type(), mdt = matmul_dtype(dt);
  if (mdt == dt) return at::mm(a, b);
  return at::mm(a.to(mdt), b.to(mdt)).to(dt);
}

// a·b with fp32 sums and an fp32 result, unrounded (the router weight's gradient and dh come from
// it): bf16 operands through MKL's bf16 GEMM (exact products, fp32 sums) where it is available,
// else the operands widened to fp32.
at::Tensor product_f32(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kFloat) return at::mm(a, b.to(at::kFloat));
  const bool rows = b.stride(1) == 1, cols = b.stride(0) == 1;
  if (a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 &&
      matmul_dtype(at::kBFloat16) == at::kBFloat16 && bf16_gemm_available() && a.is_contiguous() &&
      (rows || cols) && a.size(0) > 0) {
    at::Tensor c = at::empty({a.size(0), b.size(1)}, a.options().dtype(at::kFloat));
    bf16_gemm(false, !rows, a.size(0), b.size(1), a.size(1), 1.f,
              a.const_data_ptr<at::BFloat16>(), a.stride(0), b.const_data_ptr<at::BFloat16>(),
              rows ? b.stride(0) : b.stride(1), 0.f, c.mutable_data_ptr<float>(), b.size(1));
    return c;
  }
  return at::mm(a.to(at::kFloat), b.to(at::kFloat));
}

at::Tensor Stack::apply(const at::Tensor& v, int64_t e) const {
  const at::Tensor we = weight(e, v.scalar_type());
  return product(v, transposed ? we : we.t());
}
at::Tensor Stack::apply_t(const at::Tensor& g, int64_t e) const {
  const at::Tensor we = weight(e, g.scalar_type());
  return product(g, transposed ? we.t() : we);
}
at::Tensor Stack::apply_t_f32(const at::Tensor& g, int64_t e) const {
  const at::Tensor we = weight(e, g.scalar_type());
  return product_f32(g, transposed ? we.t() : we);
}

Stack make_stack(const OptTensor& w, const std::vector<at::Tensor>& nf4,
                 const std::vector<int64_t>& shape, const OptTensor& bias, const OptTensor& A,
                 const OptTensor& B, double s, bool transposed) {
  TORCH_CHECK(shape.size() == 3, "moe_lora: weight shape must be (E, a, b)");
  TORCH_CHECK((w.has_value() && w->defined()) || nf4.size() == 4,
              "moe_lora: a base weight needs a dense stack or four NF4 buffers");
  return Stack{w, nf4, shape, bias, A, B, s, transposed};
}

inline float sigmoid(float z) { return 1.f / (1.f + std::exp(-z)); }

// Column j of gate / up in a gu row of width 2I.
inline int64_t gate_col(const Act& a, int64_t j, int64_t I) { return a.interleaved ? 2 * j : j; }
inline int64_t up_col(const Act& a, int64_t j, int64_t I) { return a.interleaved ? 2 * j + 1 : I + j; }

inline float act_value(const Act& a, float gate, float up) {
  if (a.kind == kSwiglu) return gate * sigmoid(gate) * up;
  const float g = std::min(gate, a.limit);
  const float u = std::min(std::max(up, -a.limit), a.limit);
  return (u + 1.f) * g * sigmoid(g * a.alpha);
}

// h (n, I) in gu's dtype from gu (n, 2I).
at::Tensor activate(const at::Tensor& gu, const Act& a) {
  const int64_t n = gu.size(0), I = gu.size(1) / 2;
  at::Tensor h = at::empty({n, I}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "moe_act", [&] {
    const scalar_t* src = gu.const_data_ptr<scalar_t>();
    scalar_t* dst = h.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, row_grain(I), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* row = src + r * 2 * I;
        for (int64_t j = 0; j < I; ++j) {
          const float gate = static_cast<float>(row[gate_col(a, j, I)]);
          const float up = static_cast<float>(row[up_col(a, j, I)]);
          dst[r * I + j] = static_cast<scalar_t>(act_value(a, gate, up));
        }
      }
    });
  });
  return h;
}

// One pass per row: dws[r] = Σ_j h·u (+ g·bias), dgu = act'(gu) · (ws·u), fp32.
void activate_backward(const at::Tensor& gu, const at::Tensor& h, const at::Tensor& u32,
                       const at::Tensor& ws, const Act& a, at::Tensor& dgu, float* dws) {
  const int64_t n = gu.size(0), I = gu.size(1) / 2;
  const float* u = u32.const_data_ptr<float>();
  const float* w = ws.const_data_ptr<float>();
  float* dz = dgu.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "moe_act_bwd", [&] {
    const scalar_t* z = gu.const_data_ptr<scalar_t>();
    const scalar_t* hv = h.const_data_ptr<scalar_t>();
    at::parallel_for(0, n, row_grain(I), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* row = z + r * 2 * I;
        float* drow = dz + r * 2 * I;
        double acc = 0.0;
        for (int64_t j = 0; j < I; ++j) {
          const float uj = u[r * I + j];
          acc += static_cast<double>(static_cast<float>(hv[r * I + j]) * uj);
          const float dh = w[r] * uj;
          const float gate = static_cast<float>(row[gate_col(a, j, I)]);
          const float up = static_cast<float>(row[up_col(a, j, I)]);
          float dgate, dup;
          if (a.kind == kSwiglu) {
            const float s = sigmoid(gate);
            dup = dh * gate * s;
            dgate = dh * up * s * (1.f + gate * (1.f - s));
          } else {
            const float g = std::min(gate, a.limit);
            const float uc = std::min(std::max(up, -a.limit), a.limit);
            const float s = sigmoid(g * a.alpha);
            dup = std::abs(up) <= a.limit ? dh * g * s : 0.f;
            const float dglu = dh * (uc + 1.f) * (s + a.alpha * g * s * (1.f - s));
            dgate = gate <= a.limit ? dglu : 0.f;
          }
          drow[gate_col(a, j, I)] = dgate;
          drow[up_col(a, j, I)] = dup;
        }
        if (dws) dws[r] += static_cast<float>(acc);
      }
    });
  });
}

// acc[tok[r]] += scale[r] · (y[r] (+ extra[r]) (+ bias)), rows in parallel (tokens distinct).
void scatter_rows(at::Tensor& acc, const at::Tensor& tok, const at::Tensor& y,
                  const OptTensor& extra, const OptTensor& bias, const float* scale) {
  const int64_t n = y.size(0), H = y.size(1);
  const int64_t* t = tok.const_data_ptr<int64_t>();
  float* out = acc.mutable_data_ptr<float>();
  const float* ex = extra.has_value() ? extra->const_data_ptr<float>() : nullptr;
  at::Tensor b32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = b32.defined() ? b32.const_data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "moe_scatter", [&] {
    const scalar_t* yv = y.const_data_ptr<scalar_t>();
    at::parallel_for(0, n, row_grain(H), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* o = out + t[r] * H;
        const float sc = scale ? scale[r] : 1.f;
        for (int64_t j = 0; j < H; ++j) {
          float v = static_cast<float>(yv[r * H + j]);
          if (ex) v += ex[r * H + j];
          if (bp) v += bp[j];
          o[j] += sc * v;
        }
      }
    });
  });
}

// gu of expert e for x_e (n, in): (gu in x's dtype, xa (n, r) fp32 or undefined).
std::pair<at::Tensor, at::Tensor> gate_up(const at::Tensor& xe, const Stack& p, int64_t e) {
  at::Tensor gu = p.apply(xe, e);
  if (p.has_bias()) gu.add_(p.bias->select(0, e));
  if (!p.lora()) return {gu, at::Tensor()};
  at::Tensor xa = at::mm(xe.to(at::kFloat), p.Af(e).t());  // (n, r)
  at::Tensor full = gu.to(at::kFloat).addmm_(xa, p.Bf(e).t(), 1.0, p.s);
  return {full.to(xe.scalar_type()), xa};
}

std::vector<int64_t> offsets(const at::Tensor& counts) {
  const at::Tensor c = counts.to(at::kLong).contiguous();
  std::vector<int64_t> off{0};
  const int64_t* p = c.const_data_ptr<int64_t>();
  for (int64_t e = 0; e < c.numel(); ++e) off.push_back(off.back() + p[e]);
  return off;
}

}  // namespace

std::tuple<at::Tensor, OptTensor, OptTensor> moe_lora_forward(
    const at::Tensor& x, const at::Tensor& tok, const at::Tensor& ws, const at::Tensor& counts,
    const OptTensor& w_gu, std::vector<at::Tensor> nf4_gu, std::vector<int64_t> shape_gu,
    const OptTensor& b_gu, const OptTensor& a_gu, const OptTensor& bb_gu, double s_gu, bool t_gu,
    const OptTensor& w_d, std::vector<at::Tensor> nf4_d, std::vector<int64_t> shape_d,
    const OptTensor& b_d, const OptTensor& a_d, const OptTensor& bb_d, double s_d, bool t_d,
    int64_t kind, bool interleaved, double alpha, double limit, bool save) {
  LORAFUSE_PROFILE_RANGE("moe_lora_forward");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "moe_lora: x must be a contiguous (T, H) tensor");
  const Stack gu = make_stack(w_gu, nf4_gu, shape_gu, b_gu, a_gu, bb_gu, s_gu, t_gu);
  const Stack dn = make_stack(w_d, nf4_d, shape_d, b_d, a_d, bb_d, s_d, t_d);
  const Act act{kind, interleaved, static_cast<float>(alpha), static_cast<float>(limit)};
  const at::Tensor tok64 = tok.to(at::kLong).contiguous();
  const at::Tensor ws32 = ws.to(at::kFloat).contiguous();
  at::Tensor acc = at::zeros(x.sizes(), x.options().dtype(at::kFloat));  // (T, H)
  const int64_t S = tok.size(0), width = t_gu ? shape_gu[2] : shape_gu[1];
  at::Tensor z_all = save ? at::empty({S, width}, x.options()) : at::Tensor();  // (S, 2I)
  at::Tensor xa_all = save && gu.lora() ? at::empty({S, gu.A->size(1)}, x.options().dtype(at::kFloat))
                                        : at::Tensor();  // (S, r)
  const std::vector<int64_t> off = offsets(counts);
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(off.size()); ++e) {
    const int64_t a = off[e], b = off[e + 1];
    if (a == b) continue;  // no token: no work
    const at::Tensor te = tok64.slice(0, a, b);
    const at::Tensor xe = x.index_select(0, te);        // (n, H)
    const auto [z, xa] = gate_up(xe, gu, e);             // (n, 2I), (n, r)
    if (z_all.defined()) z_all.slice(0, a, b).copy_(z);
    if (xa_all.defined()) xa_all.slice(0, a, b).copy_(xa);
    const at::Tensor h = activate(z, act);               // (n, I)
    const at::Tensor y = dn.apply(h, e);                 // (n, H) base
    OptTensor lora;
    if (dn.lora()) lora = at::mm(at::mm(h.to(at::kFloat), dn.Af(e).t()), dn.Bf(e).t()).mul_(dn.s);
    scatter_rows(acc, te, y, lora, dn.has_bias() ? OptTensor(dn.bias->select(0, e)) : OptTensor(),
                 ws32.const_data_ptr<float>() + a);
  }
  auto opt = [](const at::Tensor& t) { return t.defined() ? OptTensor(t) : OptTensor(); };
  return {x.scalar_type() == at::kFloat ? acc : acc.to(x.scalar_type()), opt(z_all), opt(xa_all)};
}

std::tuple<OptTensor, OptTensor, OptTensor, OptTensor, OptTensor, OptTensor> moe_lora_backward(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& tok, const at::Tensor& ws,
    const at::Tensor& counts, const OptTensor& w_gu, std::vector<at::Tensor> nf4_gu,
    std::vector<int64_t> shape_gu, const OptTensor& b_gu, const OptTensor& a_gu,
    const OptTensor& bb_gu, double s_gu, bool t_gu, const OptTensor& w_d,
    std::vector<at::Tensor> nf4_d, std::vector<int64_t> shape_d, const OptTensor& b_d,
    const OptTensor& a_d, const OptTensor& bb_d, double s_d, bool t_d, int64_t kind,
    bool interleaved, double alpha, double limit, bool need_x, bool need_ws, bool need_lora,
    const OptTensor& z_saved, const OptTensor& xa_saved) {
  LORAFUSE_PROFILE_RANGE("moe_lora_backward");
  const Stack gu = make_stack(w_gu, nf4_gu, shape_gu, b_gu, a_gu, bb_gu, s_gu, t_gu);
  const Stack dn = make_stack(w_d, nf4_d, shape_d, b_d, a_d, bb_d, s_d, t_d);
  const Act act{kind, interleaved, static_cast<float>(alpha), static_cast<float>(limit)};
  const at::Tensor tok64 = tok.to(at::kLong).contiguous();
  const at::Tensor ws32 = ws.to(at::kFloat).contiguous();
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor dx = need_x ? at::zeros(x.sizes(), f32) : at::Tensor();
  at::Tensor dws = need_ws ? at::zeros({tok.size(0)}, f32) : at::Tensor();
  at::Tensor da_gu, db_gu, da_d, db_d;
  if (need_lora && gu.lora()) da_gu = at::zeros_like(*gu.A), db_gu = at::zeros_like(*gu.B);
  if (need_lora && dn.lora()) da_d = at::zeros_like(*dn.A), db_d = at::zeros_like(*dn.B);
  const std::vector<int64_t> off = offsets(counts);
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(off.size()); ++e) {
    const int64_t a = off[e], b = off[e + 1];
    if (a == b) continue;
    const at::Tensor te = tok64.slice(0, a, b);
    const at::Tensor xe = x.index_select(0, te), ge = g.index_select(0, te);  // (n, H)
    at::Tensor z, xa;  // (n, 2I), (n, r): as forward saved them, else recomputed
    if (z_saved.has_value() && z_saved->defined()) {
      z = z_saved->slice(0, a, b);
      if (xa_saved.has_value() && xa_saved->defined()) xa = xa_saved->slice(0, a, b);
    } else {
      std::tie(z, xa) = gate_up(xe, gu, e);
    }
    const at::Tensor h = activate(z, act);                                    // (n, I)
    at::Tensor u = dn.apply_t_f32(ge, e);                                     // (n, I) fp32
    const at::Tensor w_col = ws32.slice(0, a, b).unsqueeze(1);                // (n, 1)
    at::Tensor g32 = ge.to(at::kFloat);
    if (dn.lora()) {
      const at::Tensor gb = at::mm(g32, dn.Bf(e));  // (n, r)
      u.addmm_(gb, dn.Af(e), 1.0, dn.s);
      if (da_d.defined()) {
        const at::Tensor h32 = h.to(at::kFloat);
        const at::Tensor ha = at::mm(h32, dn.Af(e).t());  // (n, r)
        db_d.select(0, e).copy_(at::mm((g32 * w_col).t(), ha).mul_(dn.s));
        da_d.select(0, e).copy_(at::mm((gb * w_col).t(), h32).mul_(dn.s));
      }
    }
    at::Tensor dz = at::empty(z.sizes(), f32);
    float* dws_e = dws.defined() ? dws.mutable_data_ptr<float>() + a : nullptr;
    activate_backward(z, h, u, ws32.slice(0, a, b), act, dz, dws_e);
    if (dws_e && dn.has_bias()) dws.slice(0, a, b).add_(at::mv(g32, dn.bias->select(0, e).to(at::kFloat)));
    if (!dx.defined() && !da_gu.defined()) continue;
    at::Tensor gbz;
    if (gu.lora()) gbz = at::mm(dz, gu.Bf(e)).mul_(gu.s);  // (n, r)
    if (da_gu.defined()) {
      db_gu.select(0, e).copy_(at::mm(dz.t(), xa).mul_(gu.s));
      da_gu.select(0, e).copy_(at::mm(gbz.t(), xe.to(at::kFloat)));
    }
    if (dx.defined()) {
      at::Tensor dxe = gu.apply_t(dz.to(x.scalar_type()), e).to(at::kFloat);  // (n, H)
      if (gbz.defined()) dxe.addmm_(gbz, gu.Af(e));
      scatter_rows(dx, te, dxe, OptTensor(), OptTensor(), nullptr);
    }
  }
  OptTensor dx_out;
  if (dx.defined()) dx_out = x.scalar_type() == at::kFloat ? dx : dx.to(x.scalar_type());
  auto opt = [](const at::Tensor& t) { return t.defined() ? OptTensor(t) : OptTensor(); };
  return {dx_out, opt(dws), opt(da_gu), opt(db_gu), opt(da_d), opt(db_d)};
}

}  // namespace lorafuse
