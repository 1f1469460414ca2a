// Shared helpers for the lorafuse C++ CPU kernels: fp32 vector load/store for every
// floating dtype, the matmul dtype policy, and the op declarations bound in bindings.cpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/record_function.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <tuple>
#include <type_traits>

// Kernels vectorise in fp32 (the contracts say "math in fp32"), for fp32 / bf16 / fp16 storage,
// and for float64 storage too: the torch references upcast float64 to fp32 math as well
// (`x.to(torch.float32)`), so a float64 model under `auto` gets the same numbers, not an error.
#define LORAFUSE_DISPATCH(TYPE, NAME, ...)                        \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                  \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kDouble, __VA_ARGS__))

// A kernel's entry point as a named range for torch.profiler (``lorafuse bench --profile``), so its
// time shows apart from the autograd Function that calls it (whose self time otherwise lumps all
// of its kernels together). Without a profiler attached it costs one thread-local check.
#define LORAFUSE_PROFILE_RANGE(NAME) RECORD_FUNCTION("lorafuse::" NAME, std::vector<c10::IValue>())

namespace lorafuse {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kW = fVec::size();  // floats per vector register (8 on AVX2)

// ---- matmul dtype policy -------------------------------------------------------------------
// On CPUs without AVX-512-BF16/AMX, ATen's bf16/fp16 GEMM is ~100x slower than fp32, so fast
// paths upcast the operands to fp32 (accumulating in fp32 either way) and cast results back.
// Python tells us what is native right after loading (lorafuse._ext.load_cpp).
void set_native_low_precision(bool bf16, bool fp16);
std::tuple<bool, bool> native_low_precision();
at::ScalarType matmul_dtype(at::ScalarType t);

// Rows per parallel_for task so that one task touches ~32K elements.
inline int64_t row_grain(int64_t row_len) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_len));
}

// ---- load-balanced parallel loops ----------------------------------------------------------
// at::parallel_for gives every thread one equal share, so all wait for the slowest. Cores need not
// run at one speed: an efficiency core, or a cloud vCPU whose hyperthread sibling another tenant
// keeps busy (this project's 2-vCPU box: one bf16 GEMM took 3.0 ms pinned to one vCPU and 3.6 to
// 6.7 ms on the other, minutes apart; in a SmolLM2 training step the main thread spent ~22% of its
// samples waiting in OpenMP). These loops deal tasks from a shared counter instead: a slower
// thread takes fewer, and none waits for more than one task (benchmarks/probes/schedule.py: with a
// busy process on one core, attention 1.44x, a SmolLM2 step 1.15x; about even on equal cores).
// A task's result never depends on the thread that runs it, so both schedules give the same bits
// (tests/ops/test_schedule.py). GEMMs (oneDNN, MKL) keep their own equal shares.
void set_dynamic_schedule(bool on);  // false: at::parallel_for's equal shares (benchmarks)
bool dynamic_schedule();

// task(k) for every k in [0, n), once each, on ATen's threads; done() on each of those threads
// after its last task. Callers number tasks most costly first, so the last ones dealt are the
// cheapest. Static schedule: one task per thread per round, every other round in reverse thread
// order, which evens out costs falling along k (2 threads, costs 8..1: 18 + 18).
template <typename F, typename Done>
void parallel_tasks(int64_t n, const F& task, const Done& done) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 0) return;
  std::atomic<int64_t> next{0};
  const bool dynamic = dynamic_schedule();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    if (dynamic) {
      for (int64_t k = next++; k < n; k = next++) task(k);
    } else {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t r = 0; r * threads < n; ++r) {
          const int64_t k = r * threads + (r % 2 ? threads - 1 - t : t);
          if (k < n) task(k);
        }
      }
    }
    done();
  });
}

// f(begin, end) over [0, n) as at::parallel_for(0, n, grain, f) covers it, but dealt in chunks
// (whole multiples of grain, ~16 per thread) where there are enough grains to balance: fewer
// chunks than that would leave a thread a whole chunk behind.
template <typename F>
void parallel_rows(int64_t n, int64_t grain, const F& f) {
  grain = std::max<int64_t>(1, grain);
  const int64_t threads = at::get_num_threads(), grains = (n + grain - 1) / grain;
  if (!dynamic_schedule() || threads < 2 || grains < 8 * threads) {
    return at::parallel_for(0, n, grain, f);
  }
  const int64_t chunk = grain * ((grains + 16 * threads - 1) / (16 * threads));
  parallel_tasks((n + chunk - 1) / chunk, [&](int64_t c) {
    f(c * chunk, std::min(n, (c + 1) * chunk));
  }, [] {});
}

// ---- fp32 views of any floating element type -------------------------------------------------
template <typename T>
inline fVec load_f(const T* p) {  // kW elements of T as floats
  fVec out;
  at::vec::load_to_float<T>(p, out);
  return out;
}
template <>
inline fVec load_f<float>(const float* p) {
  return fVec::loadu(p);
}

template <>
inline fVec load_f<double>(const double* p) {
  alignas(64) float buf[kW];
  for (int64_t i = 0; i < kW; ++i) buf[i] = static_cast<float>(p[i]);
  return fVec::loadu(buf);
}

template <typename T>
inline void store_f(T* p, const fVec& v) {  // kW floats rounded to T
  at::vec::convert_from_float<T>(v, v).store(p, kW);
}
template <>
inline void store_f<float>(float* p, const fVec& v) {
  v.store(p);
}
template <>
inline void store_f<double>(double* p, const fVec& v) {
  alignas(64) float buf[kW];
  v.store(buf);
  for (int64_t i = 0; i < kW; ++i) p[i] = buf[i];
}

// Round to T and back (what `tensor.to(T)` does to a float value), vectorised.
template <typename T>
inline fVec round_to(const fVec& v) {
  auto r = at::vec::convert_from_float<T>(v, v);
  auto [lo, hi] = at::vec::convert_to_float<T>(r);
  (void)hi;
  return lo;
}
template <>
inline fVec round_to<float>(const fVec& v) {
  return v;
}
template <>
inline fVec round_to<double>(const fVec& v) {  // float -> double -> float is exact
  return v;
}
template <typename T>
inline float round_to_s(float v) {
  return static_cast<float>(static_cast<T>(v));
}

inline float hsum(const fVec& v) {
  alignas(64) float buf[kW];
  v.store(buf);
  float s = 0.f;
  for (int64_t i = 0; i < kW; ++i) s += buf[i];
  return s;
}
inline float hmax(const fVec& v) {
  alignas(64) float buf[kW];
  v.store(buf);
  float m = buf[0];
  for (int64_t i = 1; i < kW; ++i) m = std::max(m, buf[i]);
  return m;
}

// ---- exp and bf16 rounding for softmax-like passes ---------------------------------------------
// exp(x) in fp32 for every x: Cody-Waite reduction x = n·ln2 + r (|r| <= ln2/2, exact with the
// two-part ln2 and FMA), a degree-6 polynomial for exp(r) (1 + r + r²/2 + minimax terms, relative
// error 2.5e-9, exp(0) = 1 exactly), then times 2^n. Within 2 ulp of the true value where that is a
// normal float (tests/ops/test_attention.py), +inf past 88.72, 0 (through denormals) below -103.3,
// NaN for NaN. 13 vector operations on AVX-512; ATen's exp_u20 takes 19 for 20 ulp (and flushes
// results below 2^-126 to 0).
inline fVec exp_fast(const fVec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  // max/min return their second operand where one is NaN: a NaN x stays NaN.
  const __m512 t = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // x/ln2
  // ln2 = 0.693359375 - 2.12194440e-4, the first part of 9 bits: n times it is exact.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), t);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
#else
  const fVec t = at::vec::minimum(at::vec::maximum(x, fVec(-104.f)), fVec(89.f));  // keeps NaN
  const fVec n = (t * fVec(1.44269504f)).round();                                   // x / ln2
  fVec r = at::vec::fmadd(n, fVec(-0.693359375f), t);  // ln2's first 9 bits: n·hi is exact
  r = at::vec::fmadd(n, fVec(2.12194440e-4f), r);      // ln2 = 0.693359375 - 2.12194440e-4
#endif
  fVec p = at::vec::fmadd(fVec(1.394110848e-3f), fVec(r), fVec(8.375125937e-3f));
  p = at::vec::fmadd(p, fVec(r), fVec(4.166635126e-2f));
  p = at::vec::fmadd(p, fVec(r), fVec(1.666641533e-1f));
  p = at::vec::fmadd(p, fVec(r), fVec(0.5f));
  p = at::vec::fmadd(p, fVec(r), fVec(1.f));
  p = at::vec::fmadd(p, fVec(r), fVec(1.f));  // exp(0) = 1 exactly (each row's largest score)
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_scalef_ps(p, n);  // p·2^n, one rounding, denormal and infinite results included
#else
  // 2^n as two normal powers of two (n in [-150, 129]; each half in [-75, 65]): the bits of 2^k
  // are (k + 127)·2^23, exact in fp32 and converted to an int exactly.
  const fVec n1 = (n * fVec(0.5f)).floor(), n2 = n - n1;
  auto pow2 = [](const fVec& k) {
    const fVec bits = (k + fVec(127.f)) * fVec(8388608.f);
    return at::vec::cast<float>(at::vec::convert_to_int_of_same_size(bits));
  };
  return p * pow2(n1) * pow2(n2);
#endif
}

// fp32 -> bf16 exactly as tensor.to(torch.bfloat16) (round to nearest even; a NaN stays a NaN,
// maybe of another payload), as a policy for loops that store bf16: Bf16Rounding is ATen's
// conversion (~10 integer operations per vector), Bf16RoundingNative AVX-512-BF16's
// VCVTNEPS2BF16 (one). That instruction treats denormal inputs as zero, so a vector holding one
// takes ATen's conversion: the same bits either way. The extension is built for AVX-512 without
// -mavx512bf16 (AVX-512 CPUs before Cooper Lake lack it), so only the native policy and the loops
// instantiated with it (LORAFUSE_NATIVE_BF16_TARGET: that target, everything inlined into the
// loop) carry the target, called only where native_bf16_rounding(). Both store every element
// type; only bf16 stores differ (other types: store_f), so a loop over any T takes a policy.
struct Bf16Rounding {
  template <typename T>
  static void store(T* p, const fVec& v) {
    store_f<T>(p, v);
  }
};

// (The compiler must know AVX-512-BF16: GCC 10+, clang 9+, which ship this header.)
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__) && defined(__has_include)
#if __has_include(<avx512bf16intrin.h>)
#define LORAFUSE_NATIVE_BF16_ROUNDING 1
#endif
#endif
#if defined(LORAFUSE_NATIVE_BF16_ROUNDING)
#define LORAFUSE_NATIVE_BF16_TARGET __attribute__((target("avx512bf16"), flatten))
struct Bf16RoundingNative {
  template <typename T>
  __attribute__((target("avx512bf16"))) static void store(T* p, const fVec& v) {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      constexpr int kDenormal = 0x20;  // VFPCLASSPS category
      if (_mm512_fpclass_ps_mask(v, kDenormal)) return store_f<at::BFloat16>(p, v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
    } else {
      store_f<T>(p, v);
    }
  }
};
#endif

// Whether the native policy runs here: an AVX-512 build on a CPU with AVX-512-BF16.
inline bool native_bf16_rounding() {
#if defined(LORAFUSE_NATIVE_BF16_ROUNDING)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

template <typename Rounding>
void round_row_with(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t j = 0;
  for (; j + kW <= n; j += kW) Rounding::store(dst + j, fVec::loadu(src + j));
  for (; j < n; ++j) dst[j] = static_cast<at::BFloat16>(src[j]);
}
#if defined(LORAFUSE_NATIVE_BF16_ROUNDING)
LORAFUSE_NATIVE_BF16_TARGET inline void round_row_native(const float* src, at::BFloat16* dst,
                                                         int64_t n) {
  round_row_with<Bf16RoundingNative>(src, dst, n);
}
#endif

// n fp32 values -> bf16 (tensor.to(torch.bfloat16)), natively where the CPU can.
// native=false: ATen's conversion (for tests).
inline void round_row_bf16(const float* src, at::BFloat16* dst, int64_t n, bool native = true) {
#if defined(LORAFUSE_NATIVE_BF16_ROUNDING)
  if (native && native_bf16_rounding()) return round_row_native(src, dst, n);
#endif
  round_row_with<Bf16Rounding>(src, dst, n);
}

void check_2d(const at::Tensor& t, const char* op, const char* name);

// ---- BLAS sgemm / dgemm ------------------------------------------------------------------------
// The Fortran sgemm_ / dgemm_ of the BLAS torch links, looked up at run time in libtorch_cpu and its
// dependencies (torch_cpu_symbol), never in whatever else the process loaded, so a torch build
// without them still loads every other kernel. ATen's own cpublas::gemm for float and double is
// not exported. blas_gemm_available(): both found and passed a self-test (the calling convention
// and both transposes), once. blas_gemm: row-major C (m x n) = alpha·op(A)·op(B) + beta·C (leading
// dims in elements; op = transpose where ta / tb); inside a parallel region it runs on the calling
// thread alone.
bool blas_gemm_available();
void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
               int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

// ---- MKL's bf16 GEMM -------------------------------------------------------------------------
// A symbol of the libtorch_cpu this extension runs in (and its dependencies), never of whatever
// else the process loaded, so a torch build without it still loads every other kernel; or null.
void* torch_cpu_symbol(const char* name);

// Whether torch's oneDNN packs bf16 operands for its brgemm micro-kernel: it does where the CPU has
// AMX (and mkldnn is enabled), where bf16 products run ~10x faster than fp32 FMA
// (lora_rank_bf16x3.cpp).
bool onednn_packs_bf16();

// Whether MKL's cblas_gemm_bf16bf16f32 was found in libtorch_cpu and passed a self-test (the
// calling convention, every transpose, beta, and an fp32-exact product of two bf16 values), once.
bool bf16_gemm_available();

// Row-major C (m x n) = alpha·op(A)·op(B) + beta·C with bf16 A, B and an fp32 C (leading dims in
// elements; op = transpose where ta / tb) by MKL's cblas_gemm_bf16bf16f32: each bf16·bf16 product
// is exact in fp32 and the sums are fp32, so this is an fp32 GEMM of the same values up to
// summation order (the bf16 units treat denormal inputs and products as zero). Needs
// bf16_gemm_available(); runs on MKL's threads (one inside a parallel region). Not a profiler range
// of its own: its callers name it (lora_rank_mkl_bf16_gemm, attention_mkl_bf16_gemm).
void bf16_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
               const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t ldb,
               float beta, float* c, int64_t ldc);

// ---- ops (each contract: the _torch_forward / _torch_backward of src/lorafuse/ops/<op>.py) --
using OptTensor = c10::optional<at::Tensor>;

std::tuple<at::Tensor, at::Tensor> lora_linear_forward(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
    const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling,
    const OptTensor& mask, double keep);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_linear_backward(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& lora_A, const at::Tensor& lora_B, const at::Tensor& xa, double scaling,
    const OptTensor& mask, double keep, std::tuple<bool, bool, bool, bool> needs);

std::tuple<at::Tensor, at::Tensor> lora_conv2d_forward(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
    const at::Tensor& lora_down, const at::Tensor& lora_up, double scaling,
    std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
    int64_t groups);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_conv2d_backward(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& lora_down, const at::Tensor& lora_up, const at::Tensor& t, double scaling,
    std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
    int64_t groups, std::tuple<bool, bool, bool, bool> needs);

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(
    const at::Tensor& x, const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd,
    std::tuple<bool, bool> needs);

std::tuple<at::Tensor, at::Tensor> rms_norm_once_forward(
    const at::Tensor& x, const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> rms_norm_once_backward(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd,
    std::tuple<bool, bool> needs);

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up);
std::tuple<at::Tensor, at::Tensor> swiglu_backward(
    const at::Tensor& g, const at::Tensor& gate, const at::Tensor& up, bool dgate_into_g);

std::tuple<at::Tensor, at::Tensor> rope_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
std::tuple<at::Tensor, at::Tensor> rope_backward(
    const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& cos, const at::Tensor& sin);
std::tuple<at::Tensor, at::Tensor> rope_stepwise(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);

at::Tensor cross_entropy_chunk_forward_backward(
    at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index, double grad_scale);

bool attention_available();  // whether torch's BLAS sgemm was found (the kernel needs it)
bool attention_bf16_available();  // and MKL's bf16 GEMM (bf16 storage multiplies in bf16)
std::string attention_bf16_products(int64_t head_dim);  // "brgemm" or "mkl"
std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, double scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale);
// The softmax's vector math, elementwise, for tests: exp_fast over contiguous fp32 (a multiple of
// the vector width), and the fp32 -> bf16 rounding of P, dS and the outputs (native=false: ATen's
// conversion); attention_bf16_rounding says which one native=true runs here ("native" or "aten").
at::Tensor attention_exp(const at::Tensor& x);
at::Tensor attention_round_bf16(const at::Tensor& x, bool native);
std::string attention_bf16_rounding();

// NF4 codes + double-quantised absmax -> `out` (its dtype and numel; contract:
// models/nf4.py's dequantize_nf4, bit for bit). simd=false: the portable loop (for tests).
void nf4_dequantize_forward(const at::Tensor& codes, const at::Tensor& absmax_q,
                            const at::Tensor& absmax_scale, const at::Tensor& absmax_offset,
                            at::Tensor& out, bool simd);
// Columns [start, stop) of the NF4 weight with `cols` columns into out (rows, stop - start),
// bit-identical to those columns of nf4_dequantize_forward's output (cols, start and stop
// multiples of 64, so each row holds whole blocks): the fused ops' column tiles.
void nf4_dequantize_columns(const at::Tensor& codes, const at::Tensor& absmax_q,
                            const at::Tensor& absmax_scale, const at::Tensor& absmax_offset,
                            int64_t cols, int64_t start, int64_t stop, at::Tensor& out,
                            bool simd);
// y = x·Wᵀ + b for 1-8 rows of bf16/fp16 x (..., K), W (n_out, K) NF4 with K a multiple of 64,
// dequantised in registers on AVX-512 CPUs, else (and with simd=false, for tests) a tile of rows
// at a time in cache (decode_linear.cpp): decoding without a dense W.
at::Tensor nf4_decode_linear(const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& absmax_q, const at::Tensor& absmax_scale,
                             const at::Tensor& absmax_offset, int64_t n_out, const OptTensor& bias,
                             bool simd);
// y = x·Wᵀ + b for 1-8 rows of bf16/fp16 x (..., K) and a dense W (N, K) of x's dtype: FMA chains
// over W as stored, fp32 sums, one rounding (decode_linear.cpp): decoding at full read speed.
at::Tensor decode_linear_forward(const at::Tensor& x, const at::Tensor& weight,
                                 const OptTensor& bias);

// Mamba2's chunked SSD scan (mamba2_scan.cpp; contract: ops/mamba2_scan_chunks.py's torch_forward /
// torch_backward, `sub` tokens per BLAS product), and one decoding token per row.
std::tuple<at::Tensor, at::Tensor, at::Tensor> mamba2_scan_forward(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
    const at::Tensor& C, const OptTensor& D, const OptTensor& dt_bias,
    const OptTensor& initial_state, const OptTensor& cu_seqlens, bool softplus, double lo,
    double hi, int64_t chunk, int64_t sub);
std::vector<at::Tensor> mamba2_scan_backward(
    const at::Tensor& gy, const OptTensor& gfinal, const at::Tensor& x, const at::Tensor& dt,
    const at::Tensor& A, const at::Tensor& B, const at::Tensor& C, const OptTensor& D,
    const OptTensor& dt_bias, const OptTensor& initial_state, const OptTensor& cu_seqlens,
    const at::Tensor& saved, bool softplus, double lo, double hi, int64_t chunk,
    std::vector<bool> needs, int64_t sub);
std::tuple<at::Tensor, at::Tensor> mamba2_scan_step(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
    const at::Tensor& C, const OptTensor& D, const OptTensor& dt_bias, const OptTensor& state,
    bool softplus, double lo, double hi);

}  // namespace lorafuse
