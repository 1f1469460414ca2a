// Causal self-attention for training on CPU, GQA, no mask tensor:
//   out = softmax(scale * q kᵀ + causal) v      per (batch, query head); kv head = head / G.
// Shapes: q (B,Hq,T,D), k/v (B,Hk,T,D) with any batch/head/time strides and unit stride on D;
// out (B,T,Hq,D) contiguous (the layout o_proj reads, so no transpose copy), lse (B,Hq,T) fp32.
// Storage fp32, or bf16 where this CPU multiplies bf16 natively (AVX-512-BF16, AMX).
//
// Why not ATen's flash kernel: on a 2-core AVX2 box it spends ~40 GFLOP/s on these shapes. Here
// the work is split into row blocks of br queries of the query heads that share a kv head (see
// Blocking); a block only multiplies against the keys it can see (the causal triangle is skipped
// block-wise), the products run single-threaded inside a task, and the softmax is one vectorised
// pass over an M x BC scratch. Threads take tasks from a shared counter, the dear late blocks of
// the triangle first and the cheap early ones last (common.h's parallel_tasks), so they finish
// together even on cores of unequal speed. Backward recomputes P from the saved log-sum-exp
// (nothing of size T x T is kept).
//
// Products (one body, two product sets in attention_products.h, chosen in one place,
// with_products):
// * BlasProducts: the operands as stored. fp32 -> BLAS sgemm; bf16 -> MKL's gemm_bf16bf16f32
//   (bf16 operands, fp32 accumulation), which packs both operands again on every call.
// * BrgemmProducts (bf16 where oneDNN has a bf16 micro-kernel, AMX or AVX-512-BF16, and
//   D % 16 == 0): oneDNN's brgemm micro-kernel as torch exports it (at::native::cpublas), the one
//   torch's own CPU flash kernel runs. K and V are packed once per (batch, kv head) into its VNNI
//   layout (by oneDNN where it packs bf16, AMX; by us on AVX-512-BF16) and read by
//   every row block of every query head of the group. Backward accumulates dKᵀ += Qᵀ·dS and
//   dVᵀ += dOᵀ·P, so that dS and P are B operands (packed by oneDNN, about twice as fast as
//   transposing them into A operands).
// Every softmax, log-sum-exp, row sum and gradient accumulator is fp32; the only roundings to bf16
// are the operands a product needs (P before P·V and Pᵀ·dO, dS before dS·K and dSᵀ·Q, as the
// flash kernel does) and each output once at the end.
//
// The passes between the products (row max, exp + row sum + the P copy, dS: about half of the
// kernel's time at SmolLM2-135M's shape, perf) are bound by vector arithmetic and by L1/L2 traffic
// over the scratches. So they run common.h's exp_fast (13 AVX-512 operations, within 2 ulp; ATen's
// exp_u20: 19, 20 ulp), plain max instructions for the row max, cache-line aligned scratch
// (Scratch), and, where the CPU has AVX-512-BF16, its VCVTNEPS2BF16 for the roundings (one
// instruction per 16 values instead of ~10). That instruction treats denormal inputs as zero; a
// vector holding one is rounded by ATen's conversion instead, so every rounding is still exactly
// tensor.to(bfloat16). (For P and dS it would not matter: the bf16 product units, AMX and MKL's
// bf16 GEMM, treat denormal operands as zero anyway, and P < 2^-126 is exp(< -87) of a row whose
// largest term is 1.) Measured (`benchmarks/probes/attention_length.py --kernel --threads 1
// --clock cpu`, bf16, AMX Xeon): forward -13% at 4 x 512, -27% at 1 x 4096; backward -15% at
// 1 x 512, -22% at 1 x 4096 (4 x 512 within noise).
#include <cstring>
#include <limits>

#include "attention_products.h"
#include "attention_rows.h"
#include "common.h"

namespace lorafuse {
namespace {

// Where a product's operand lives: the fp32 scratch itself for fp32 storage, else its T copy.
template <typename T>
T* operand_buffer(Scratch<float>& scratch, Scratch<T>& copy) {
  if constexpr (std::is_same_v<T, float>) {
    return scratch.data();
  } else {
    return copy.data();
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16,
              "attention: q, k, v must be fp32 or bf16, got ", dt);
  TORCH_CHECK(blas_ready(),
              "attention: this torch build exports no usable BLAS sgemm_; use backend='torch'");
  TORCH_CHECK(dt == at::kFloat || use_brgemm(q.size(3)) || bf16_gemm_available(),
              "attention: this torch build exports no usable cblas_gemm_bf16bf16f32 (MKL); "
              "pass fp32 inputs");
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == dt && t->stride(3) == 1,
                "attention: q, k, v must share a dtype and be (B, H, T, D) with unit stride on D, "
                "got ", t->scalar_type(), " ", t->sizes(), " strides ", t->strides());
  }
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0,
              "attention: q ", q.sizes(), " and k/v ", k.sizes(), ", ", v.sizes(),
              " must be (B, Hq, T, D) and (B, Hk, T, D) with Hq a multiple of Hk");
}

// Query heads that share a kv head are multiplied together: the rows of up to `pack` heads
// (their query blocks stacked, g-major) form one product against each key/value block, so the
// BLAS packs K and V once for them and runs an M = pack·br product instead of pack products of
// M = br.
struct Blocking {
  int64_t br;     // query rows per head per block (divides BC, so no row sees zero keys)
  int64_t pack;   // query heads per product (G or a divisor of it)
  int64_t packs;  // G / pack
};

// The largest product M = pack·br up to 256 rows (the backward's four M x BC scratches stay in
// a 2 MiB L2), preferring the smaller br on ties: a diagonal block wastes ~br/T of the work on
// masked keys, so br = 128 is only a candidate from 2048 tokens on.
Blocking blocking(int64_t T, int64_t G) {
  Blocking best{0, 0, 0};
  for (int64_t br : {64, 128}) {
    if (br == 128 && T < 2048) break;
    int64_t pack = std::max<int64_t>(1, std::min<int64_t>(G, 256 / br));
    while (G % pack) --pack;  // equal packs
    if (pack * br > best.pack * best.br) best = {br, pack, G / pack};
  }
  return best;
}

// Stack rows [s0, s0+rows) of heads h0..h0+pack of x (row stride st, head stride sh) into dst
// (pack·rows x D, row g·rows + i).
template <typename T>
void stack_rows(T* dst, const T* x, int64_t st, int64_t sh, int64_t pack, int64_t rows,
                int64_t D) {
  for (int64_t g = 0; g < pack; ++g) {
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(dst + (g * rows + i) * D, x + g * sh + i * st, D * sizeof(T));
    }
  }
}

template <typename T, typename Products>
void forward_impl(const at::Tensor& q, const Products& prod, int64_t Hk, at::Tensor& out,
                  at::Tensor& lse) {
  const int64_t B = q.size(0), Hq = q.size(1), T_ = q.size(2), D = q.size(3);
  const int64_t G = Hq / Hk;
  const Blocking bl = blocking(T_, G);
  const int64_t BRr = bl.br, M = bl.pack * BRr;
  const float ss = prod.score_scale();
  const View<T> Q(q);
  T* o = out.data_ptr<T>();
  float* l = lse.data_ptr<float>();
  const int64_t blocks = (T_ + BRr - 1) / BRr;
  // One task per (batch, kv head, head pack, row block), the last row blocks (the most keys)
  // numbered first (parallel_tasks).
  const int64_t heads = B * Hk * bl.packs;
  auto task = [&](int64_t k) {
    thread_local Scratch<float> s, acc, mx, sum;
    thread_local Scratch<T> p, qp;
    s.resize(M * BC), acc.resize(M * D), mx.resize(M), sum.resize(M), qp.resize(M * D);
    if constexpr (!std::is_same_v<T, float>) p.resize(M * BC);
    T* pb = operand_buffer<T>(s, p);  // P as the P·V product reads it
    const int64_t blk = blocks - 1 - k / heads, rest = k % heads;
    const int64_t pk = rest % bl.packs, hk = rest / bl.packs % Hk, b = rest / bl.packs / Hk;
    const int64_t h0 = hk * G + pk * bl.pack;
    const int64_t s0 = blk * BRr, rows = std::min(BRr, T_ - s0), keys = s0 + rows;
    const int64_t m = bl.pack * rows;
    stack_rows<T>(qp.data(), Q.at(b, h0, s0), Q.st, Q.sh, bl.pack, rows, D);
    std::fill(mx.begin(), mx.begin() + m, -std::numeric_limits<float>::infinity());
    std::fill(sum.begin(), sum.begin() + m, 0.f);
    // Online softmax over key blocks of BC (the scratch stays in L2 however long T is).
    for (int64_t c0 = 0; c0 < keys; c0 += BC) {
      const int64_t cols = std::min(BC, keys - c0);
      prod.scores(b, hk, m, c0, cols, qp.data(), D, s.data());
      for (int64_t r = 0; r < m; ++r) {
        const int64_t i = r % rows;
        float* row = s.data() + r * BC;
        const int64_t n = std::min(cols, s0 + i + 1 - c0);  // visible keys in this block
        const float m_old = mx[r];
        const float m_new = std::max(m_old, scaled_max(row, n, ss));
        const float block_sum = exp_row<T, false>(row, n, prod.width(cols), m_new, pb + r * BC, ss);
        const float rescale = std::exp(m_old - m_new);  // 0 on the first block
        sum[r] = sum[r] * rescale + block_sum;
        mx[r] = m_new;
        if (c0 > 0) {
          float* a = acc.data() + r * D;
          at::vec::map([rescale](fVec x) { return x * fVec(rescale); }, a, a, D);
        }
      }
      prod.pv(b, hk, m, c0, cols, pb, D, acc.data());
    }
    for (int64_t r = 0; r < m; ++r) {
      const int64_t g = r / rows, i = r % rows, h = h0 + g;
      float* a = acc.data() + r * D;
      const float inv = 1.f / sum[r];
      at::vec::map([inv](fVec x) { return x * fVec(inv); }, a, a, D);
      store_row<T>(o + ((b * T_ + s0 + i) * Hq + h) * D, a, D);
      l[(b * Hq + h) * T_ + s0 + i] = mx[r] + std::log(sum[r]);
    }
  };
  parallel_tasks(heads * blocks, task, [&] { prod.done(); });
}

// Backward of one (batch, kv head, head pack) over the row blocks blk = part, part + parts, ...:
// dQ rows are written to dq; dK/dV are summed into this task's fp32 accumulators dk_acc/dv_acc
// (prod.acc_rows(T) x D values each, laid out as prod.store_acc reads them).
template <typename T, typename Products>
void backward_rows(int64_t b, int64_t h0, int64_t hk, int64_t part, int64_t parts,
                   const Blocking& bl, const Products& prod, const View<T>& Q, const T* go,
                   const T* o, const float* l, T* dq, float* dk_acc, float* dv_acc, int64_t T_,
                   int64_t Hq, int64_t D, float sc) {
  const int64_t BRr = bl.br, M = bl.pack * BRr;
  const float ss = prod.score_scale();
  thread_local Scratch<float> p, dp, dq_acc, delta;
  thread_local Scratch<T> pb, dsb, qp, dop;
  p.resize(M * BC), dp.resize(M * BC), dq_acc.resize(M * D), delta.resize(M);
  qp.resize(M * D), dop.resize(M * D);
  if constexpr (!std::is_same_v<T, float>) pb.resize(M * BC), dsb.resize(M * BC);
  const int64_t blocks = (T_ + BRr - 1) / BRr;
  for (int64_t blk = part; blk < blocks; blk += parts) {
    const int64_t s0 = blk * BRr, rows = std::min(BRr, T_ - s0), keys = s0 + rows;
    const int64_t m = bl.pack * rows;
    stack_rows<T>(qp.data(), Q.at(b, h0, s0), Q.st, Q.sh, bl.pack, rows, D);
    stack_rows<T>(dop.data(), go + ((b * T_ + s0) * Hq + h0) * D, Hq * D, D, bl.pack, rows, D);
    prod.rows(m, qp.data(), dop.data(), D);
    for (int64_t r = 0; r < m; ++r) {
      const int64_t g = r / rows, i = r % rows;
      delta[r] = dot<T>(dop.data() + r * D, o + ((b * T_ + s0 + i) * Hq + h0 + g) * D, D);
    }
    for (int64_t c0 = 0; c0 < keys; c0 += BC) {
      const int64_t cols = std::min(BC, keys - c0), width = prod.width(cols);
      // P = exp(scale q kᵀ - lse) on the visible keys, 0 beyond the diagonal.
      prod.scores(b, hk, m, c0, cols, qp.data(), D, p.data());
      T* P = operand_buffer<T>(p, pb);
      for (int64_t r = 0; r < m; ++r) {
        const int64_t g = r / rows, i = r % rows;
        const int64_t n = std::min(cols, s0 + i + 1 - c0);
        const float lse_r = l[(b * Hq + h0 + g) * T_ + s0 + i];
        exp_row<T, true>(p.data() + r * BC, n, width, lse_r, P + r * BC, ss);
      }
      prod.transposed_acc(m, c0, cols, P, dop.data(), D, dv_acc, false);  // dV += Pᵀ·dO
      prod.dp(b, hk, m, c0, cols, dop.data(), D, dp.data());
      // dS = P * (dP - rowsum(dO * O)) * scale.
      T* dS = operand_buffer<T>(dp, dsb);
      for (int64_t r = 0; r < m; ++r) {
        ds_row<T>(p.data() + r * BC, dp.data() + r * BC, width, delta[r], sc, dS + r * BC);
      }
      prod.dq(b, hk, m, c0, cols, dS, D, dq_acc.data());
      prod.transposed_acc(m, c0, cols, dS, qp.data(), D, dk_acc, true);  // dK += dSᵀ·Q
    }
    for (int64_t r = 0; r < m; ++r) {
      const int64_t g = r / rows, i = r % rows;
      store_row<T>(dq + ((b * T_ + s0 + i) * Hq + h0 + g) * D, dq_acc.data() + r * D, D);
    }
  }
}

template <typename T, typename Products>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const Products& prod, int64_t Hk,
                   const at::Tensor& out, const at::Tensor& lse, float sc, at::Tensor& dq,
                   at::Tensor& dk, at::Tensor& dv) {
  const int64_t B = q.size(0), Hq = q.size(1), T_ = q.size(2), D = q.size(3);
  const int64_t G = Hq / Hk, TA = prod.acc_rows(T_);
  const Blocking bl = blocking(T_, G);
  const View<T> Q(q);
  const T* go = dout.const_data_ptr<T>();
  const T* o = out.const_data_ptr<T>();
  const float* l = lse.const_data_ptr<float>();
  T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dv.data_ptr<T>();
  // One task per (batch, kv head, head pack, part): a part takes every parts-th row block and
  // sums dK/dV into its own fp32 accumulator, so no two threads write the same rows. Parts > 1
  // only where there are fewer (batch, kv head, pack) triples than threads can share (a batch
  // of one, few kv heads); the parts' accumulators are summed afterwards.
  const int64_t threads = at::get_num_threads(), heads = B * Hk * bl.packs;
  const int64_t blocks = (T_ + bl.br - 1) / bl.br;
  const int64_t parts =
      heads < 2 * threads ? std::min(blocks, (2 * threads + heads - 1) / heads) : 1;
  const int64_t per_kv = bl.packs * parts;  // accumulators per kv head
  auto acc = at::zeros({B * Hk * per_kv, 2, TA, D}, q.options().dtype(at::kFloat));
  float* accp = acc.data_ptr<float>();
  auto task = [&](int64_t task) {
    const int64_t part = task % parts, pk = task / parts % bl.packs;
    const int64_t hk = task / per_kv % Hk, b = task / per_kv / Hk;
    float* dk_acc = accp + task * 2 * TA * D;
    backward_rows<T>(b, hk * G + pk * bl.pack, hk, part, parts, bl, prod, Q, go, o, l, dqp,
                     dk_acc, dk_acc + TA * D, T_, Hq, D, sc);
  };
  parallel_tasks(B * Hk * per_kv, task, [&] { prod.done(); });
  // Sum the accumulators of each kv head and write dK/dV rows in the (B, T, Hk, D) layout.
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hk, hk = task % Hk;
      float* first = accp + task * per_kv * 2 * TA * D;
      for (int64_t j = 1; j < per_kv; ++j) {
        const float* other = first + j * 2 * TA * D;
        at::vec::map2([](fVec a, fVec c) { return a + c; }, first, first, other, 2 * TA * D);
      }
      const int64_t row0 = (b * T_ * Hk + hk) * D;
      prod.store_acc(first, T_, D, dkp + row0, Hk * D);
      prod.store_acc(first + TA * D, T_, D, dvp + row0, Hk * D);
    }
  });
}

// Calls f(products) with the product set for these inputs, the one place that chooses: fp32
// storage -> BLAS sgemm; bf16 -> oneDNN's brgemm where it has a bf16 micro-kernel and D % 16 == 0,
// else MKL's bf16 GEMM (check_inputs made sure one of them is there).
template <typename F>
void with_products(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
                   bool backward, const F& f) {
  if (q.scalar_type() == at::kFloat) {
    f(BlasProducts<float>(k, v, scale, backward));
  } else if (use_brgemm(q.size(3))) {
    f(BrgemmProducts(k, v, scale, backward));
  } else {
    f(BlasProducts<bf16>(k, v, scale, backward));
  }
}

}  // namespace

bool attention_available() { return blas_ready(); }
bool attention_bf16_available() { return blas_ready() && bf16_gemm_available(); }
std::string attention_bf16_products(int64_t head_dim) {
  return use_brgemm(head_dim) ? "brgemm" : "mkl";
}

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, double scale) {
  LORAFUSE_PROFILE_RANGE("attention_forward");
  check_inputs(q, k, v);
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hk = k.size(1);
  auto out = at::empty({B, T, Hq, D}, q.options());
  auto lse = at::empty({B, Hq, T}, q.options().dtype(at::kFloat));
  with_products(q, k, v, static_cast<float>(scale), false, [&](const auto& prod) {
    using T_ = typename std::decay_t<decltype(prod)>::Scalar;
    forward_impl<T_>(q, prod, Hk, out, lse);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale) {
  LORAFUSE_PROFILE_RANGE("attention_backward");
  check_inputs(q, k, v);
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hk = k.size(1);
  TORCH_CHECK(dout.is_contiguous() && out.is_contiguous() && dout.sizes() == out.sizes() &&
                  out.sizes() == at::IntArrayRef({B, T, Hq, D}) &&
                  dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "attention backward: dout and out must be contiguous (B, T, Hq, D) in q's dtype");
  TORCH_CHECK(lse.is_contiguous() && lse.sizes() == at::IntArrayRef({B, Hq, T}) &&
                  lse.scalar_type() == at::kFloat,
              "attention backward: lse must be contiguous fp32 (B, Hq, T)");
  // Layouts as the forward's output: (B, T, H, D), returned as (B, H, T, D) views.
  auto dq = at::empty({B, T, Hq, D}, q.options());
  auto dk = at::empty({B, T, Hk, D}, q.options());
  auto dv = at::empty({B, T, Hk, D}, q.options());
  const float sc = static_cast<float>(scale);
  with_products(q, k, v, sc, true, [&](const auto& prod) {
    using T_ = typename std::decay_t<decltype(prod)>::Scalar;
    backward_impl<T_>(dout, q, prod, Hk, out, lse, sc, dq, dk, dv);
  });
  return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)};
}

at::Tensor attention_exp(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() % kW == 0,
              "attention_exp: contiguous fp32 with a multiple of ", kW, " elements");
  auto y = at::empty_like(x);
  const float* src = x.const_data_ptr<float>();
  float* dst = y.data_ptr<float>();
  for (int64_t j = 0; j < x.numel(); j += kW) exp_fast(fVec::loadu(src + j)).store(dst + j);
  return y;
}

std::string attention_bf16_rounding() { return native_bf16_rounding() ? "native" : "aten"; }

at::Tensor attention_round_bf16(const at::Tensor& x, bool native) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(),
              "attention_round_bf16: contiguous fp32");
  auto y = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  round_row_bf16(x.const_data_ptr<float>(), y.data_ptr<at::BFloat16>(), x.numel(), native);
  return y;
}

}  // namespace lorafuse
