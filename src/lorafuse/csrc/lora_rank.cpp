// Rank-r LoRA products between a large operand of any floating dtype (x or g, (N, w)) and fp32
// small ones (A, B, xa, gB), computed by row tiles (declarations and shapes: lora_rank.h).
//
// PEFT's default puts fp32 adapters on a bf16 base. Written as tensor expressions the LoRA
// branch then forms full-size fp32 tensors: x.to(fp32) (N, d) for x·Aᵀ and dA, xa·Bᵀ (N, k)
// before it is added into the bf16 output, g.to(fp32) (N, k) for gB and dB, gB·A (N, d) before
// it is added into dx. Fresh buffers of that size are page-faulted in on every call; at
// SmolLM2-135M's gate/up (N = 2048, k = 1536) those copies, products and adds took ~2.4 s of a
// ~5.4 s bf16 training step on a 2-core AMX Xeon (torch.profiler).
//
// Here each product runs over tiles of T rows: the tile of the large operand is converted into a
// per-thread fp32 scratch that stays in cache (bf16/fp16 -> fp32 is exact, so the products are
// the same fp32 products up to summation order), multiplied there with ATen's fp32 GEMM (MKL
// sgemm), and an up-projection's fp32 tile result is added into the low-precision output with
// one rounding per element, as `y.add_(fp32 term)` rounds once. Reductions over rows (dB, dA)
// accumulate one fp32 partial per parallel chunk and sum them at the end. Tiles are split into at
// most get_num_threads() contiguous chunks (each chunk's GEMMs run single-threaded inside the
// parallel region), so the summation order depends only on N and the thread count.
//
// A dropout mask (bool, (N, d)) is folded into the conversion of x's tiles (dropout(x) =
// mask ? x / keep : 0) and into the add of the dx term, so masked calls form no (N, d) fp32
// tensor either. An fp32 large operand needs no conversion: those calls are one plain GEMM.
//
// Where bf16 products are native (AMX, AVX-512-BF16) and MKL's bf16 GEMM is there, the products
// whose large operand is bf16 and whose result is fp32 (xa, gB, dB, dA) skip the conversion: the
// fp32 small operand is split into three bf16 parts whose sum is exact and the product is one
// whole bf16 GEMM with fp32 sums ("bf16x3", lora_rank_bf16x3.cpp), the same fp32 products up to
// summation order.
// The up-products that add into a bf16 output (y += s·xa·Bᵀ, dx += gB·A) do not take bf16x3:
// both their operands are fp32, so bf16x3 needs 6 cross terms (K = 6r, dropping only terms below
// 2^-25), and MKL's bf16 GEMM of that shape alone, by 128-row tiles into a reused fp32 buffer,
// took 1.30 ms against 1.33 ms for the whole tiled fp32 up_add_ with its add into y (N = 2048,
// k = 1536, r = 16, 1 thread; 2.27 ms as one whole GEMM; 0.48 against 0.53 ms at k = 576),
// before its own add into y: no gain.
//
// The register-blocked FMA kernels (lora_rank_fma.cpp) compute the same fp32 products in one pass
// over the large operand, converting it in registers: no fp32 tile, no skinny GEMM call per tile.
// Which kernel runs is chosen once per product below (`use_fma`), with the measured reason. The
// figures: N = 2048, r = 16, bf16 large operand, 1 thread, CPU ms, medians of 21 interleaved runs
// of benchmarks/ops/lora_rank.py --threads 1 --cpu-time --widths 1536 576 --rank 16 (or 64)
// with --baseline old (FMA off), --baseline fma (bf16x3 off) and, bf16 emulated
// (LORAFUSE_CPU_LOW_PRECISION=emulated), --baseline tiles, on a 2-core AMX Xeon.
// Where they were not faster (bf16x3 on AMX; r past 2 vectors for the one-pass products), the
// other path runs; the fp32 tiles also stay as the baseline set_rank_fma(false) restores.
#include "lora_rank.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

namespace lorafuse {

// The sum of a reduction's per-chunk partials (chunks, a, b) as (a, b), by in-place adds of
// a·b-element slices (below ATen's parallel grain at rank r), not a sum(0) that opens a parallel
// region (a thread handoff) for a few KiB.
at::Tensor sum_partials(const at::Tensor& part, int64_t a, int64_t b) {
  if (part.size(0) == 0) return at::zeros({a, b}, part.options());  // N = 0
  at::Tensor out = part.select(0, 0);
  for (int64_t c = 1; c < part.size(0); ++c) out.add_(part.select(0, c));
  return out;
}

float* rank_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

namespace {

// Rows per tile: the fp32 tile of the large operand takes about this many bytes, so it stays in
// L2 (2 MiB per core on the AMX Xeon these were measured on) next to the GEMM's other operands:
// 85 rows of g at k = 1536, 227 rows of x at d = 576. 256 KiB to 2 MiB timed alike (1 thread,
// N = 2048, bf16, SmolLM2-135M shapes, within noise); 4 MiB (past L2) ran
// dx_add_ in 2.9 ms against 0.75-1.1 ms in the same series.
constexpr int64_t kTileBytes = 512 * 1024;

int64_t tile_rows(int64_t width) {
  return std::clamp<int64_t>(kTileBytes / (4 * std::max<int64_t>(1, width)), 8, 1024);
}

bool has(const OptTensor& t) { return t.has_value() && t->defined(); }

std::atomic<bool> g_fma_allowed{true};  // set_rank_fma (benchmarks)

// Whether the FMA kernels run (every dtype, mask and r; lora_rank_fma.cpp), else the fp32 tiles.
bool use_fma() { return g_fma_allowed.load(); }

// The same for the one-pass products (xa, gB/dB, dA): r up to 2 vectors (pass_fma_fits, 32 on
// AVX-512). At r = 32 the FMA kernel and the tiles ran alike (dA 1.88 against 1.95 ms for the
// tiles, grads 3.64 both); past that the tiles were faster: dA 2.96 (tiles) against 3.55 ms,
// grads 4.95 against 6.01 at r = 48; 3.65 against 3.88, 8.7 against 9.1 at r = 64 (d = k = 1536,
// bf16 with bf16x3 off, 1 thread).
bool use_fma_pass(int64_t r) { return use_fma() && pass_fma_fits(r); }

// The row tiles of an (N, width) operand, split into `chunks` contiguous parallel chunks.
struct Tiles {
  int64_t n, rows, count, chunks;
  Tiles(int64_t n_, int64_t width) : n(n_), rows(tile_rows(width)) {
    count = (n + rows - 1) / rows;
    chunks = std::min<int64_t>(count, at::get_num_threads());
  }
  // f(chunk, first row, rows, first tile of its chunk) for every tile; chunks run in parallel.
  template <typename F>
  void run(const F& f) const {
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      // Worker threads start in grad mode whatever the caller's thread runs under, and an out=
      // GEMM refuses operands that require grad there (the adapters do): no autograd in here.
      c10::NoGradGuard no_grad;
      for (int64_t c = c0; c < c1; ++c) {
        for (int64_t t = c * count / chunks; t < (c + 1) * count / chunks; ++t) {
          const int64_t r0 = t * rows;
          f(c, r0, std::min(rows, n - r0), t == c * count / chunks);
        }
      }
    });
  }
};

// n elements of src as fp32 into dst; with a mask, mask ? src / keep : 0 (dropout(x)).
template <typename T>
void load_rows(const T* src, const bool* mask, float* dst, int64_t n, float inv_keep) {
  int64_t i = 0;
  if (mask == nullptr) {
    for (; i + kW <= n; i += kW) load_f<T>(src + i).store(dst + i);
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
    return;
  }
  for (; i < n; ++i) dst[i] = mask[i] ? static_cast<float>(src[i]) * inv_keep : 0.f;
}

// dst = round(dst + s·t) over n elements (only where mask, when given): one rounding each.
// bf16/fp16 go 2·kW elements at a time, so each store is one whole Vectorized<T>.
template <typename T>
void add_rows(T* dst, const float* t, const bool* mask, int64_t n, float s) {
  int64_t i = 0;
  if (mask == nullptr) {
    const fVec sv(s);
    if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {
      for (; i + 2 * kW <= n; i += 2 * kW) {
        fVec lo, hi;
        at::vec::load_to_float<T>(dst + i, lo, hi);
        lo = lo + fVec::loadu(t + i) * sv;
        hi = hi + fVec::loadu(t + i + kW) * sv;
        at::vec::convert_from_float<T>(lo, hi).store(dst + i);
      }
    } else {
      for (; i + kW <= n; i += kW) {
        store_f<T>(dst + i, load_f<T>(dst + i) + fVec::loadu(t + i) * sv);
      }
    }
    for (; i < n; ++i) dst[i] = static_cast<T>(static_cast<float>(dst[i]) + t[i] * s);
    return;
  }
  for (; i < n; ++i) {
    if (mask[i]) dst[i] = static_cast<T>(static_cast<float>(dst[i]) + t[i] * s);
  }
}

// s·(a·b), scaling the small operand b when it has fewer elements than the product (scale_b):
// s·gᵀ·xa at N = 16 tokens and k = 10240 scales xa (16 x r), not dB (10240 x r), one pass
// over 16 rows instead of a read-modify-write of 10240 (fp32 1x1 and narrow SD layers).
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, double s, bool scale_b) {
  return scale_b ? at::mm(a, b * s) : at::mm(a, b).mul_(s);
}

at::Tensor tile(float* p, int64_t rows, int64_t cols) {
  return at::from_blob(p, {rows, cols}, at::TensorOptions().dtype(at::kFloat));
}

void check_fp32(const at::Tensor& t, int64_t rows, int64_t cols, const char* op,
                const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, op, ": ", name,
              " must be (", rows, ", ", cols, "), got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
}

const bool* mask_of(const OptTensor& mask, const at::Tensor& x, double keep, const char* op) {
  if (!has(mask)) return nullptr;
  TORCH_CHECK(mask->scalar_type() == at::kBool && mask->sizes() == x.sizes() &&
                  mask->is_contiguous(),
              op, ": mask must be a contiguous bool tensor of shape ", x.sizes(), ", got ",
              mask->scalar_type(), " ", mask->sizes());
  TORCH_CHECK(keep > 0.0 && keep <= 1.0, op, ": keep must be in (0, 1], got ", keep);
  return mask->const_data_ptr<bool>();
}

void check_out(const at::Tensor& t, const char* op, const char* name) {
  check_2d(t, op, name);
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, ": ", name,
              " must be float32, bfloat16 or float16, got ", dt);
}

#define LORAFUSE_DISPATCH_OUT(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

}  // namespace

at::Tensor rank_down(const at::Tensor& x, const at::Tensor& A, const OptTensor& mask,
                     double keep) {
  LORAFUSE_PROFILE_RANGE("lora_rank_down");
  c10::NoGradGuard no_grad;  // plain products: no graph, whatever the caller's mode
  check_2d(x, "lora_rank_down", "x");
  const int64_t N = x.size(0), d = x.size(1), r = A.size(0);
  check_fp32(A, r, d, "lora_rank_down", "A");
  const bool* mp = mask_of(mask, x, keep, "lora_rank_down");
  if (x.scalar_type() == at::kFloat && mp == nullptr) return at::mm(x, A.t());
  // bf16x3 first: 1.45 against 1.75 ms for the FMA kernel (d = 1536; 0.46 against 0.50 at 576).
  if (use_bf16x3(x, mp)) return down_bf16x3(x, A);
  const float inv_keep = static_cast<float>(1.0 / keep);
  // FMA: 0.93 against 1.42 ms for the tiles (d = 1536; 0.38 against 0.58 at 576).
  if (use_fma_pass(r)) {
    return std::get<0>(pass_fma(x, mp, inv_keep, A.t(), 1.f, at::Tensor(), 1.f));
  }
  at::Tensor xa = at::empty({N, r}, x.options().dtype(at::kFloat));  // (N, r)
  const at::Tensor At = A.t();                                        // (d, r) view
  const Tiles tiles(N, d);
  LORAFUSE_DISPATCH(x.scalar_type(), "lora_rank_down", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    tiles.run([&](int64_t, int64_t r0, int64_t rows, bool) {
      float* buf = rank_scratch(rows * d);  // (rows, d) fp32 tile of dropout(x)
      load_rows<scalar_t>(xp + r0 * d, mp ? mp + r0 * d : nullptr, buf, rows * d, inv_keep);
      at::Tensor out = xa.narrow(0, r0, rows);
      at::mm_out(out, tile(buf, rows, d), At);
    });
  });
  return xa;
}

void rank_up_add_(at::Tensor& y, const at::Tensor& xa, const at::Tensor& B, double s) {
  LORAFUSE_PROFILE_RANGE("lora_rank_up_add_");
  c10::NoGradGuard no_grad;  // plain products: no graph, whatever the caller's mode
  check_out(y, "lora_rank_up_add_", "y");
  const int64_t N = y.size(0), k = y.size(1), r = B.size(1);
  check_fp32(xa, N, r, "lora_rank_up_add_", "xa");
  check_fp32(B, k, r, "lora_rank_up_add_", "B");
  const at::Tensor Bt = B.t();  // (r, k) view
  if (y.scalar_type() == at::kFloat) {
    y.addmm_(xa, Bt, /*beta=*/1, /*alpha=*/s);
    return;
  }
  // FMA, every r: 1.51 against 1.87 ms for the tiles (k = 1536; 0.41 against 0.45 at 576; r = 64:
  // 3.06 against 3.41, 1.11 against 1.21).
  if (use_fma()) return add_product_fma(y, xa, Bt, nullptr, static_cast<float>(s));
  const Tiles tiles(N, k);
  LORAFUSE_DISPATCH_OUT(y.scalar_type(), "lora_rank_up_add_", [&] {
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    tiles.run([&](int64_t, int64_t r0, int64_t rows, bool) {
      float* buf = rank_scratch(rows * k);  // (rows, k) fp32 tile of xa·Bᵀ
      at::Tensor t = tile(buf, rows, k);
      at::mm_out(t, xa.narrow(0, r0, rows), Bt);
      add_rows<scalar_t>(yp + r0 * k, buf, nullptr, rows * k, static_cast<float>(s));
    });
  });
}

std::tuple<at::Tensor, at::Tensor> rank_grads(const at::Tensor& g, const at::Tensor& B,
                                              const at::Tensor& xa, double s, bool need_gB,
                                              bool need_dB) {
  LORAFUSE_PROFILE_RANGE("lora_rank_grads");
  c10::NoGradGuard no_grad;  // plain products: no graph, whatever the caller's mode
  check_2d(g, "lora_rank_grads", "g");
  const int64_t N = g.size(0), k = g.size(1), r = B.size(1);
  check_fp32(B, k, r, "lora_rank_grads", "B");
  if (need_dB) check_fp32(xa, N, r, "lora_rank_grads", "xa");
  at::Tensor gB, dB;
  if (!need_gB && !need_dB) return {gB, dB};
  if (g.scalar_type() == at::kFloat) {
    if (need_gB) gB = scaled_mm(g, B, s, k < N);         // (N, r)
    if (need_dB) dB = scaled_mm(g.t(), xa, s, N < k);    // (k, r)
    return {gB, dB};
  }
  // bf16x3 first: 2.51 against 2.60 ms for the FMA kernel (k = 1536; 0.96 against 0.99 at 576).
  if (use_bf16x3(g, nullptr)) {
    return grads_bf16x3(g, B, xa, static_cast<float>(s), need_gB, need_dB);
  }
  // FMA, one pass over g for both: 2.02 against 2.83 ms for the tiles (k = 1536; 0.69 against
  // 0.95 at 576).
  if (use_fma_pass(r)) {
    const float sf = static_cast<float>(s);
    return pass_fma(g, nullptr, 1.f, need_gB ? B : at::Tensor(), sf,
                    need_dB ? xa : at::Tensor(), sf);
  }
  const Tiles tiles(N, k);
  if (need_gB) gB = at::empty({N, r}, g.options().dtype(at::kFloat));  // (N, r)
  at::Tensor part;                                                      // (chunks, k, r)
  if (need_dB) part = at::empty({tiles.chunks, k, r}, g.options().dtype(at::kFloat));
  LORAFUSE_DISPATCH(g.scalar_type(), "lora_rank_grads", [&] {
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    tiles.run([&](int64_t c, int64_t r0, int64_t rows, bool first) {
      float* buf = rank_scratch(rows * k);  // (rows, k) fp32 tile of g
      load_rows<scalar_t>(gp + r0 * k, nullptr, buf, rows * k, 1.f);
      const at::Tensor G = tile(buf, rows, k);
      if (need_gB) {
        at::Tensor out = gB.narrow(0, r0, rows);
        at::mm_out(out, G, B);
      }
      if (need_dB) {  // the chunk's partial: written by its first tile, accumulated after
        at::Tensor pc = part.select(0, c);
        pc.addmm_(G.t(), xa.narrow(0, r0, rows), /*beta=*/first ? 0 : 1);
      }
    });
  });
  if (need_gB) gB.mul_(s);
  if (need_dB) dB = sum_partials(part, k, r).mul_(s);
  return {gB, dB};
}

at::Tensor rank_dA(const at::Tensor& gB, const at::Tensor& x, const OptTensor& mask,
                   double keep) {
  LORAFUSE_PROFILE_RANGE("lora_rank_dA");
  c10::NoGradGuard no_grad;  // plain products: no graph, whatever the caller's mode
  check_2d(x, "lora_rank_dA", "x");
  const int64_t N = x.size(0), d = x.size(1), r = gB.size(1);
  check_fp32(gB, N, r, "lora_rank_dA", "gB");
  const bool* mp = mask_of(mask, x, keep, "lora_rank_dA");
  if (x.scalar_type() == at::kFloat && mp == nullptr) return at::mm(gB.t(), x);
  // bf16x3 first: 1.28 against 1.48 ms for the FMA kernel (d = 1536; 0.51 against 0.58 at 576).
  if (use_bf16x3(x, mp)) return dA_bf16x3(gB, x);
  const float inv_keep = static_cast<float>(1.0 / keep);
  // FMA, computed as dAᵀ = dropout(x)ᵀ·gB (d, r): 1.15 against 1.29 ms for the tiles (d = 1536;
  // 0.44 against 0.50 at 576).
  if (use_fma_pass(r)) {
    return std::get<1>(pass_fma(x, mp, inv_keep, at::Tensor(), 1.f, gB, 1.f)).t().contiguous();
  }
  const Tiles tiles(N, d);
  at::Tensor part = at::empty({tiles.chunks, r, d}, x.options().dtype(at::kFloat));
  LORAFUSE_DISPATCH(x.scalar_type(), "lora_rank_dA", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    tiles.run([&](int64_t c, int64_t r0, int64_t rows, bool first) {
      float* buf = rank_scratch(rows * d);  // (rows, d) fp32 tile of dropout(x)
      load_rows<scalar_t>(xp + r0 * d, mp ? mp + r0 * d : nullptr, buf, rows * d, inv_keep);
      at::Tensor pc = part.select(0, c);  // the chunk's partial (see rank_grads)
      pc.addmm_(gB.narrow(0, r0, rows).t(), tile(buf, rows, d), /*beta=*/first ? 0 : 1);
    });
  });
  return sum_partials(part, r, d);  // (r, d)
}

void rank_dx_add_(at::Tensor& dx, const at::Tensor& gB, const at::Tensor& A,
                  const OptTensor& mask, double keep) {
  LORAFUSE_PROFILE_RANGE("lora_rank_dx_add_");
  c10::NoGradGuard no_grad;  // plain products: no graph, whatever the caller's mode
  check_out(dx, "lora_rank_dx_add_", "dx");
  const int64_t N = dx.size(0), d = dx.size(1), r = A.size(0);
  check_fp32(gB, N, r, "lora_rank_dx_add_", "gB");
  check_fp32(A, r, d, "lora_rank_dx_add_", "A");
  const bool* mp = mask_of(mask, dx, keep, "lora_rank_dx_add_");
  if (dx.scalar_type() == at::kFloat && mp == nullptr) {
    dx.addmm_(gB, A);
    return;
  }
  const float inv_keep = mp ? static_cast<float>(1.0 / keep) : 1.f;
  // FMA, every r, dx + (gB·A)·(1 / keep): 1.07 against 1.21 ms for the tiles (d = 1536; 0.39
  // against 0.47 at 576; r = 64: 2.86 against 3.02, 1.05 against 1.16).
  if (use_fma()) return add_product_fma(dx, gB, A, mp, inv_keep);
  const Tiles tiles(N, d);
  LORAFUSE_DISPATCH_OUT(dx.scalar_type(), "lora_rank_dx_add_", [&] {
    scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
    tiles.run([&](int64_t, int64_t r0, int64_t rows, bool) {
      float* buf = rank_scratch(rows * d);  // (rows, d) fp32 tile of gB·A
      at::Tensor t = tile(buf, rows, d);
      at::mm_out(t, gB.narrow(0, r0, rows), A);
      add_rows<scalar_t>(dp + r0 * d, buf, mp ? mp + r0 * d : nullptr, rows * d, inv_keep);
    });
  });
}

void set_rank_fma(bool allowed) { g_fma_allowed.store(allowed); }

}  // namespace lorafuse
