// int8 products for a frozen base weight (ops/int8_linear.py): the forward x·Wᵀ and the input
// gradient g·W of a projection whose W is stored as int8 with one fp32 scale per output row.
//
//   W ≈ diag(sw)·Wq, sw[o] = max|W[o, :]| / 127, Wq = round(W / sw) in [-127, 127]
//   forward:  xq = round(x / sx) per row (sx[n] = max|x[n, :]| / 127);  y = (xq·Wqᵀ)·sx[n]·sw[o]
//   backward: g' = g·diag(sw);  gq = round(g' / sg) per row;          dx = (gq·Wq)·sg[n]
//
// The integer products run in oneDNN's brgemm micro-kernel as torch exports it (cpublas): AMX-INT8
// tiles or AVX-512-VNNI dot products, chosen by oneDNN at run time on the CPU it finds; every
// build variant compiles this file, and int8_linear_available() says (by a self-test) whether the
// micro-kernel runs here. The micro-kernel multiplies u8 by s8, so the row-quantized operand is
// stored shifted by 128 and the shift's contribution, 128·(column sums of the weight operand), is
// subtracted from each int32 accumulator (exact: integer arithmetic).
//
// Layout: each weight operand B (K x N) is packed once, when the weight is quantized, into panels
// of NP = 64 columns in the VNNI layout (K/4, 64, 4) (K padded to a multiple of 4 with zero rows,
// N to a multiple of 64 with zero columns): packed_fwd is B = Wqᵀ (K = in, N = out), packed_bwd is
// B = Wq (K = out, N = in). Two int8 copies: 2 bytes a weight, as bf16's one copy.
#include <ATen/native/CPUBlas.h>

#include <cmath>
#include <cstring>

#include "common.h"

namespace lorafuse {
namespace {

namespace cpublas = at::native::cpublas;
constexpr int64_t NP = 64;  // columns per packed panel (oneDNN's widest)
// Rows of the quantized operand per micro-kernel call, at most: each call sets up its kernel (AMX
// tile configuration included), so 32-row calls spent more time there than in the products at
// 2048 tokens. The int32 block (256 x 64) stays in L2.
constexpr int64_t MB = 256;

int64_t up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// out (k/4 x n x 4) = the VNNI layout of in (k x n, row stride ld): rows 4i..4i+3 interleaved.
void pack_vnni4(int64_t k, int64_t n, int64_t ld, const int8_t* in, int8_t* out) {
  for (int64_t i = 0; i < k; i += 4) {
    int8_t* o = out + i * n;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t t = 0; t < 4; ++t) o[4 * j + t] = in[(i + t) * ld + j];
    }
  }
}

// ---- row quantization -------------------------------------------------------------------------
// kW rounded floats in [1, 255] -> kW bytes at q.
inline void store_u8(const fVec& a, uint8_t* q) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(a)));
#else
  alignas(64) int32_t t[kW];
  at::vec::convert<int32_t>(a).store(t);
  for (int64_t j = 0; j < kW; ++j) q[j] = static_cast<uint8_t>(t[j]);
#endif
}

// q[n, :K] = round(v / s) + 128 with v = x[n, :] (· colscale where given), s = max|v| / 127,
// rounding to nearest even as torch.round; q[n, K:Kp] = 128 (zero). scale[n] = s.
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t K, int64_t Kp, const float* colscale,
                   uint8_t* q, float* scale) {
  parallel_rows(rows, row_grain(K), [&](int64_t r0, int64_t r1) {
    std::vector<float> v(K + kW);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * K;
      int64_t c = 0;
      fVec vmax(0.f);
      for (; c + kW <= K; c += kW) {
        fVec a = load_f<T>(xr + c);
        if (colscale) a = a * fVec::loadu(colscale + c);
        a.store(v.data() + c);
        vmax = at::vec::maximum(vmax, a.abs());
      }
      float amax = hmax(vmax);
      for (; c < K; ++c) {
        const float a = static_cast<float>(xr[c]) * (colscale ? colscale[c] : 1.f);
        v[c] = a;
        amax = std::max(amax, std::fabs(a));
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      scale[r] = amax / 127.f;
      uint8_t* qr = q + r * Kp;
      const fVec vinv(inv), lo(-127.f), hi(127.f), shift(128.f);
      for (c = 0; c + kW <= K; c += kW) {
        store_u8(at::vec::clamp((fVec::loadu(v.data() + c) * vinv).round(), lo, hi) + shift,
                 qr + c);
      }
      for (; c < K; ++c) {
        const float a = std::min(127.f, std::max(-127.f, std::nearbyint(v[c] * inv)));
        qr[c] = static_cast<uint8_t>(static_cast<int>(a) + 128);
      }
      std::memset(qr + K, 128, Kp - K);
    }
  });
}

// ---- the product --------------------------------------------------------------------------------
// out[n, j] (= or +=) (acc[n, j] - comp[j]) · sq[n] · (sw ? sw[j] : 1) (+ bias[j]) for n < rows,
// j < N, acc = q (rows x Kp, u8) · packed (Kp x Np panels). Tasks: (row block, panel).
template <typename T>
void product(const uint8_t* q, const float* sq, int64_t rows, int64_t Kp, const int8_t* packed,
             const int32_t* comp, const float* sw, const T* bias, int64_t N, T* out, bool add) {
  const int64_t panels = up(N, NP) / NP, blocks = (rows + MB - 1) / MB;
  const int64_t mb = (rows + blocks - 1) / blocks;  // equal blocks of at most MB rows
  parallel_tasks(blocks * panels, [&](int64_t task) {
    const int64_t b = task / panels, p = task % panels;
    const int64_t r0 = b * mb, m = std::min(mb, rows - r0), j0 = p * NP;
    const int64_t w = std::min(NP, N - j0);
    thread_local std::vector<int32_t> scratch;
    scratch.resize(MB * NP);
    int32_t* acc = scratch.data();
    cpublas::brgemm(m, NP, Kp, Kp, NP, NP, false, q + r0 * Kp, packed + p * Kp * NP, acc);
    using iVec = at::vec::Vectorized<int32_t>;
    static_assert(iVec::size() == kW, "int32 and float vectors of one width");
    for (int64_t i = 0; i < m; ++i) {
      const float s = sq[r0 + i];
      const fVec vs(s);
      const int32_t* a = acc + i * NP;
      T* o = out + (r0 + i) * N + j0;
      int64_t j = 0;
      for (; j + kW <= w; j += kW) {  // (acc - comp) exact in int32, then fp32
        fVec v = at::vec::convert<float>(iVec::loadu(a + j) - iVec::loadu(comp + j0 + j));
        v = v * (sw ? vs * fVec::loadu(sw + j0 + j) : vs);
        if (bias) v = v + load_f<T>(bias + j0 + j);
        if (add) v = v + load_f<T>(o + j);
        store_f<T>(o + j, v);
      }
      for (; j < w; ++j) {
        float v = static_cast<float>(a[j] - comp[j0 + j]) * (sw ? s * sw[j0 + j] : s);
        if (bias) v += static_cast<float>(bias[j0 + j]);
        o[j] = static_cast<T>(add ? static_cast<float>(o[j]) + v : v);
      }
    }
  }, [] { cpublas::brgemm_release(); });
}

void check_packed(const at::Tensor& packed, const at::Tensor& comp, int64_t K, int64_t N,
                  const char* what) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.numel() == up(K, 4) * up(N, NP),
              what, ": packed weight must be contiguous int8 of ", up(K, 4) * up(N, NP),
              " elements, got ", packed.sizes(), " ", packed.scalar_type());
  TORCH_CHECK(comp.scalar_type() == at::kInt && comp.numel() == up(N, NP), what,
              ": compensation must be int32 of ", up(N, NP), " elements");
}

// Self-test of the layout and the calling convention on small integers (exact): q (3 x 8) u8,
// B (8 x 64) s8; every product checked.
bool int8_works() {
  constexpr int64_t K = 8, M = 3;
  uint8_t q[M * K];
  int8_t B[K * NP], packed[K * NP];
  int32_t acc[M * NP];
  for (int64_t i = 0; i < M * K; ++i) q[i] = static_cast<uint8_t>(100 + 13 * i % 150);
  for (int64_t i = 0; i < K * NP; ++i) B[i] = static_cast<int8_t>((7 * i) % 255 - 127);
  pack_vnni4(K, NP, NP, B, packed);
  cpublas::brgemm(M, NP, K, K, NP, NP, false, q, packed, acc);
  cpublas::brgemm_release();
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < NP; ++j) {
      int32_t want = 0;
      for (int64_t k = 0; k < K; ++k) want += int32_t(q[i * K + k]) * int32_t(B[k * NP + j]);
      if (acc[i * NP + j] != want) return false;
    }
  }
  return true;
}

}  // namespace

bool int8_linear_available() {
  static const bool works = [] {
    try {  // torch raises where oneDNN has no int8 micro-kernel (no VNNI / AMX)
      return int8_works();
    } catch (const std::exception&) {
      return false;
    }
  }();
  return works;
}

// W (out, in) float / bf16 / fp16 -> (sw fp32 (out), packed_fwd int8, comp_fwd int32 (up(out, 64)),
// packed_bwd int8, comp_bwd int32 (up(in, 64))). See the file comment for the layout.
std::vector<at::Tensor> int8_quantize_weight(const at::Tensor& weight) {
  LORAFUSE_PROFILE_RANGE("int8_quantize_weight");
  TORCH_CHECK(weight.dim() == 2, "int8_quantize_weight: weight must be 2-D, got ", weight.sizes());
  const at::Tensor w = weight.contiguous().to(at::kFloat);
  const int64_t out = w.size(0), in = w.size(1);
  at::Tensor sw = at::empty({out}, w.options());
  at::Tensor wq = at::empty({out, in}, w.options().dtype(at::kChar));
  const float* wp = w.const_data_ptr<float>();
  float* swp = sw.data_ptr<float>();
  int8_t* qp = wq.data_ptr<int8_t>();
  at::parallel_for(0, out, row_grain(in), [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) {
      float amax = 0.f;
      for (int64_t i = 0; i < in; ++i) amax = std::max(amax, std::fabs(wp[o * in + i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      swp[o] = amax / 127.f;
      for (int64_t i = 0; i < in; ++i) {
        const float v = std::min(127.f, std::max(-127.f, std::nearbyint(wp[o * in + i] * inv)));
        qp[o * in + i] = static_cast<int8_t>(v);
      }
    }
  });
  auto pack = [&](bool transposed) {  // B = Wqᵀ (K = in) or Wq (K = out), padded, in panels
    const int64_t K = transposed ? in : out, N = transposed ? out : in;
    const int64_t Kp = up(K, 4), Np = up(N, NP);
    at::Tensor b = at::zeros({Kp, Np}, wq.options());
    at::Tensor comp = at::zeros({Np}, w.options().dtype(at::kInt));
    int8_t* bp = b.data_ptr<int8_t>();
    int32_t* cp = comp.data_ptr<int32_t>();
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t n = 0; n < N; ++n) {
        const int8_t v = transposed ? qp[n * in + k] : qp[k * in + n];
        bp[k * Np + n] = v;
        cp[n] += 128 * int32_t(v);
      }
    }
    at::Tensor packed = at::empty({Kp * Np}, wq.options());
    int8_t* pp = packed.data_ptr<int8_t>();
    at::parallel_for(0, Np / NP, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) pack_vnni4(Kp, NP, Np, bp + p * NP, pp + p * Kp * NP);
    });
    return std::make_pair(packed, comp);
  };
  auto [fwd, comp_fwd] = pack(true);
  auto [bwd, comp_bwd] = pack(false);
  return {sw, fwd, comp_fwd, bwd, comp_bwd};
}

namespace {

template <typename T>
void forward_as(const at::Tensor& x, const at::Tensor& sw, const at::Tensor& packed,
                const at::Tensor& comp, const at::Tensor& bias, at::Tensor& q, at::Tensor& sq,
                at::Tensor& y) {
  const int64_t rows = x.size(0), in = x.size(1), Kp = q.size(1);
  quantize_rows<T>(x.const_data_ptr<T>(), rows, in, Kp, nullptr, q.data_ptr<uint8_t>(),
                   sq.data_ptr<float>());
  product<T>(q.const_data_ptr<uint8_t>(), sq.const_data_ptr<float>(), rows, Kp,
             packed.const_data_ptr<int8_t>(), comp.const_data_ptr<int32_t>(),
             sw.const_data_ptr<float>(), bias.defined() ? bias.const_data_ptr<T>() : nullptr,
             sw.numel(), y.data_ptr<T>(), false);
}

template <typename T>
void input_grad_as(const at::Tensor& g, const at::Tensor& sw, const at::Tensor& packed,
                   const at::Tensor& comp, at::Tensor& q, at::Tensor& sq, at::Tensor& dx,
                   bool add) {
  const int64_t rows = g.size(0), out = g.size(1), Kp = q.size(1);
  quantize_rows<T>(g.const_data_ptr<T>(), rows, out, Kp, sw.const_data_ptr<float>(),
                   q.data_ptr<uint8_t>(), sq.data_ptr<float>());
  product<T>(q.const_data_ptr<uint8_t>(), sq.const_data_ptr<float>(), rows, Kp,
             packed.const_data_ptr<int8_t>(), comp.const_data_ptr<int32_t>(), nullptr, nullptr,
             dx.size(1), dx.data_ptr<T>(), add);
}

void check_dtype(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              ": float32 or bfloat16 only, got ", t.scalar_type());
}

}  // namespace

// y (N, out) in x's dtype = x (N, in) · Wᵀ (+ bias) with x quantized per row (file comment).
at::Tensor int8_linear_forward(const at::Tensor& x, const at::Tensor& sw,
                               const at::Tensor& packed, const at::Tensor& comp,
                               const c10::optional<at::Tensor>& bias) {
  LORAFUSE_PROFILE_RANGE("int8_linear_forward");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int8_linear_forward: x must be contiguous 2-D");
  check_dtype(x, "int8_linear_forward");
  const int64_t rows = x.size(0), in = x.size(1), out = sw.numel();
  check_packed(packed, comp, in, out, "int8_linear_forward");
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0) return y;
  at::Tensor q = at::empty({rows, up(in, 4)}, x.options().dtype(at::kByte));
  at::Tensor sq = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor b = bias.has_value() ? bias->to(x.scalar_type()).contiguous() : at::Tensor();
  if (x.scalar_type() == at::kFloat) {
    forward_as<float>(x, sw, packed, comp, b, q, sq, y);
  } else {
    forward_as<at::BFloat16>(x, sw, packed, comp, b, q, sq, y);
  }
  return y;
}

// dx (N, in) in g's dtype = g (N, out) · W, with g·diag(sw) quantized per row; written into a new
// tensor, or added into `into` (N, in) of g's dtype (the sum over projections of one input; the
// sum formed in fp32, rounded once).
at::Tensor int8_linear_input_grad(const at::Tensor& g, const at::Tensor& sw,
                                  const at::Tensor& packed, const at::Tensor& comp, int64_t in,
                                  const c10::optional<at::Tensor>& into) {
  LORAFUSE_PROFILE_RANGE("int8_linear_input_grad");
  TORCH_CHECK(g.dim() == 2 && g.is_contiguous(), "int8_linear_input_grad: g must be contiguous 2-D");
  check_dtype(g, "int8_linear_input_grad");
  const int64_t rows = g.size(0), out = g.size(1);
  TORCH_CHECK(sw.numel() == out, "int8_linear_input_grad: g has ", out, " columns, sw ", sw.numel());
  check_packed(packed, comp, out, in, "int8_linear_input_grad");
  const bool add = into.has_value();
  at::Tensor dx = add ? *into : at::empty({rows, in}, g.options());
  if (add) {
    TORCH_CHECK(dx.sizes() == at::IntArrayRef({rows, in}) && dx.is_contiguous() &&
                    dx.scalar_type() == g.scalar_type(),
                "int8_linear_input_grad: into must be contiguous (", rows, ", ", in, ") ",
                g.scalar_type());
  }
  if (rows == 0) return dx;
  at::Tensor q = at::empty({rows, up(out, 4)}, g.options().dtype(at::kByte));
  at::Tensor sq = at::empty({rows}, g.options().dtype(at::kFloat));
  if (g.scalar_type() == at::kFloat) {
    input_grad_as<float>(g, sw, packed, comp, q, sq, dx, add);
  } else {
    input_grad_as<at::BFloat16>(g, sw, packed, comp, q, sq, dx, add);
  }
  return dx;
}

}  // namespace lorafuse
