// Python bindings of the lorafuse C++ CPU kernels (one extension module for all of csrc/).
#include <torch/extension.h>

#include "common.h"
#include "lora_rank.h"

namespace lorafuse {  // csrc/lora_autograd.cpp: the ops' common call as one C++ autograd Function
OptTensor lora_linear_fast(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                           const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling);
OptTensor lora_conv2d_fast(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                           const at::Tensor& lora_down, const at::Tensor& lora_up,
                           double scaling, std::vector<int64_t> stride,
                           std::vector<int64_t> padding, std::vector<int64_t> dilation,
                           int64_t groups);
}  // namespace lorafuse

namespace lorafuse {  // csrc/cross_entropy.cpp: the chunk kernel on bf16/fp16 logits
at::Tensor cross_entropy_chunk_forward_backward_lowp(at::Tensor& logits, const at::Tensor& targets,
                                                     int64_t ignore_index, double grad_scale);
}  // namespace lorafuse

namespace lorafuse {  // csrc/gated_delta.cpp, gated_delta_backward.cpp, causal_conv1d.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_delta_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const OptTensor& initial_state, const OptTensor& cu_seqlens,
    bool l2norm, bool save_states);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
gated_delta_backward(const at::Tensor& dout, const OptTensor& dfinal, const at::Tensor& q,
                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                     const at::Tensor& beta, const OptTensor& initial_state,
                     const at::Tensor& states, const OptTensor& cu_seqlens, bool l2norm,
                     std::tuple<bool, bool, bool, bool, bool, bool> needs);
std::tuple<at::Tensor, at::Tensor> causal_conv1d_forward(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
    const c10::optional<std::string>& activation, const OptTensor& initial_state,
    const OptTensor& cu_seqlens, int64_t n);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> causal_conv1d_backward(
    const at::Tensor& dy, const OptTensor& dfinal, const at::Tensor& x, const at::Tensor& weight,
    const OptTensor& bias, const c10::optional<std::string>& activation,
    const OptTensor& initial_state, const OptTensor& cu_seqlens, int64_t n,
    std::tuple<bool, bool, bool, bool> needs);
}  // namespace lorafuse

namespace lorafuse {  // csrc/large_buffers.cpp: torch's CPU allocator for large buffers
void large_buffers_install(int64_t min_bytes, bool huge_pages);
py::dict large_buffers_stats();
int64_t large_buffers_trim();
void large_buffers_reset_peak();
}  // namespace lorafuse

namespace lorafuse {  // csrc/decode_engine_bind.cpp: the decode engine's class and functions
void bind_decode_engine(py::module& m);
}  // namespace lorafuse

namespace lorafuse {  // csrc/int8_linear.cpp: int8 products of a frozen base weight
bool int8_linear_available();
std::vector<at::Tensor> int8_quantize_weight(const at::Tensor& weight);
at::Tensor int8_linear_forward(const at::Tensor& x, const at::Tensor& sw,
                               const at::Tensor& packed, const at::Tensor& comp,
                               const c10::optional<at::Tensor>& bias);
at::Tensor int8_linear_input_grad(const at::Tensor& g, const at::Tensor& sw,
                                  const at::Tensor& packed, const at::Tensor& comp, int64_t in,
                                  const c10::optional<at::Tensor>& into);
}  // namespace lorafuse

namespace lorafuse {  // csrc/moe_lora.cpp: the routed experts' LoRA, grouped by expert
std::tuple<at::Tensor, OptTensor, OptTensor> moe_lora_forward(
    const at::Tensor& x, const at::Tensor& tok, const at::Tensor& ws, const at::Tensor& counts,
    const OptTensor& w_gu, std::vector<at::Tensor> nf4_gu, std::vector<int64_t> shape_gu,
    const OptTensor& b_gu, const OptTensor& a_gu, const OptTensor& bb_gu, double s_gu, bool t_gu,
    const OptTensor& w_d, std::vector<at::Tensor> nf4_d, std::vector<int64_t> shape_d,
    const OptTensor& b_d, const OptTensor& a_d, const OptTensor& bb_d, double s_d, bool t_d,
    int64_t kind, bool interleaved, double alpha, double limit, bool save);
std::tuple<OptTensor, OptTensor, OptTensor, OptTensor, OptTensor, OptTensor> moe_lora_backward(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& tok, const at::Tensor& ws,
    const at::Tensor& counts, const OptTensor& w_gu, std::vector<at::Tensor> nf4_gu,
    std::vector<int64_t> shape_gu, const OptTensor& b_gu, const OptTensor& a_gu,
    const OptTensor& bb_gu, double s_gu, bool t_gu, const OptTensor& w_d,
    std::vector<at::Tensor> nf4_d, std::vector<int64_t> shape_d, const OptTensor& b_d,
    const OptTensor& a_d, const OptTensor& bb_d, double s_d, bool t_d, int64_t kind,
    bool interleaved, double alpha, double limit, bool need_x, bool need_ws, bool need_lora,
    const OptTensor& z_saved, const OptTensor& xa_saved);
}  // namespace lorafuse

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lorafuse C++ CPU kernels (ATen + at::vec + at::parallel_for)";
  m.def("set_native_low_precision", &lorafuse::set_native_low_precision,
        "Tell the kernels whether bf16 / fp16 matmuls are native (else computed in fp32)",
        py::arg("bf16"), py::arg("fp16"));
  m.def("native_low_precision", &lorafuse::native_low_precision,
        "(bf16, fp16): whether the kernels run those matmuls natively");
  m.def("large_buffers_install", &lorafuse::large_buffers_install,
        "Serve torch CPU allocations of at least min_bytes from lorafuse's mapped blocks, freed "
        "ones kept by size for reuse (0: stop taking new ones)", py::arg("min_bytes"),
        py::arg("huge_pages") = false);
  m.def("large_buffers_stats", &lorafuse::large_buffers_stats,
        "installed, min_bytes, and bytes live / cached, peak_live, hits, misses, unmapped");
  m.def("large_buffers_trim", &lorafuse::large_buffers_trim,
        "Unmap every cached free block; returns the bytes given back");
  m.def("large_buffers_reset_peak", &lorafuse::large_buffers_reset_peak,
        "Restart peak_live from the bytes live now");
  m.def("lora_linear_forward", &lorafuse::lora_linear_forward);
  m.def("lora_linear_backward", &lorafuse::lora_linear_backward);
  m.def("lora_rank_down", &lorafuse::rank_down,
        "xa = dropout(x)·Aᵀ (N, r) fp32; x (N, d) any float dtype: bf16x3 (one bf16 GEMM exact to "
        "fp32) for bf16 x where lora_rank_bf16x3_active, else one FMA pass over x (fp32 tiles past "
        "r = 2 vectors)",
        py::arg("x"), py::arg("A"), py::arg("mask"), py::arg("keep"));
  m.def("lora_rank_up_add_", &lorafuse::rank_up_add_,
        "y = round(y + s·xa·Bᵀ) in place, by FMA blocks (no (N, k) fp32 term)", py::arg("y"),
        py::arg("xa"), py::arg("B"), py::arg("s"));
  m.def("lora_rank_grads", &lorafuse::rank_grads,
        "(gB = s·g·B (N, r), dB = s·gᵀ·xa (k, r)) fp32: bf16x3 GEMMs (bf16 g, "
        "lora_rank_bf16x3_active), else one FMA pass over g for both (fp32 tiles past r = 2 "
        "vectors)",
        py::arg("g"), py::arg("B"), py::arg("xa"), py::arg("s"), py::arg("need_gB"),
        py::arg("need_dB"));
  m.def("lora_rank_dA", &lorafuse::rank_dA,
        "dA = gBᵀ·dropout(x) (r, d) fp32: bf16x3 (bf16 x, lora_rank_bf16x3_active), else one "
        "FMA pass over x (fp32 tiles past r = 2 vectors)",
        py::arg("gB"), py::arg("x"), py::arg("mask"), py::arg("keep"));
  m.def("lora_rank_dx_add_", &lorafuse::rank_dx_add_,
        "dx = round(dx + dropout'(gB·A)) in place, by FMA blocks (no (N, d) fp32 term)",
        py::arg("dx"), py::arg("gB"), py::arg("A"), py::arg("mask"), py::arg("keep"));
  m.def("bf16_gemm_available", &lorafuse::bf16_gemm_available,
        "Whether MKL's cblas_gemm_bf16bf16f32 was found in libtorch_cpu and passed its self-test "
        "(the rank-r products' bf16x3, exact to fp32, where lora_rank_bf16x3_active)");
  m.def("set_dynamic_schedule", &lorafuse::set_dynamic_schedule,
        "Deal the kernels' parallel work from a shared counter (default: a thread on a slower "
        "core takes less) or, False, in at::parallel_for's equal shares: for benchmarks timing "
        "both", py::arg("on"));
  m.def("lora_rank_set_fma", &lorafuse::set_rank_fma,
        "Let the rank-r products take the register-blocked FMA kernels where they are chosen "
        "(default) or, False, the fp32 tiles they replaced: for benchmarks timing both",
        py::arg("allowed"));
  m.def("lora_rank_set_bf16x3", &lorafuse::set_rank_bf16x3,
        "Where bf16 large operands take the bf16x3 GEMMs: 'auto' (default: where torch's oneDNN "
        "packs bf16, AMX), 'on' (wherever bf16 is native and MKL's bf16 GEMM is there), 'off' "
        "(the FMA kernels or fp32 tiles): for tests and benchmarks timing both", py::arg("mode"));
  m.def("lora_rank_bf16x3_active", &lorafuse::rank_bf16x3_active,
        "Whether a bf16 large operand without a dropout mask takes bf16x3 now");
  m.def("lora_conv2d_forward", &lorafuse::lora_conv2d_forward);
  m.def("lora_conv2d_backward", &lorafuse::lora_conv2d_backward);
  m.def("lora_linear_fast", &lorafuse::lora_linear_fast,
        "lora_linear's common call (dense frozen W, no dropout) as one autograd Function; None "
        "when the call is not that one");
  m.def("lora_conv2d_fast", &lorafuse::lora_conv2d_fast,
        "lora_conv2d's common call (batched x) as one autograd Function; None when it is not");
  m.def("rms_norm_forward", &lorafuse::rms_norm_forward);
  m.def("rms_norm_backward", &lorafuse::rms_norm_backward);
  m.def("rms_norm_once_forward", &lorafuse::rms_norm_once_forward,
        "RMSNorm rounded once after an fp32 weight multiply: to_dtype(norm(x) * w)");
  m.def("rms_norm_once_backward", &lorafuse::rms_norm_once_backward);
  m.def("swiglu_forward", &lorafuse::swiglu_forward);
  m.def("swiglu_backward", &lorafuse::swiglu_backward,
        "(dgate, dup); dgate_into_g: dgate written into g's buffer (g is not read afterwards)",
        py::arg("g"), py::arg("gate"), py::arg("up"), py::arg("dgate_into_g") = false);
  m.def("rope_forward", &lorafuse::rope_forward);
  m.def("rope_backward", &lorafuse::rope_backward);
  m.def("rope_stepwise", &lorafuse::rope_stepwise);
  m.def("attention_available", &lorafuse::attention_available,
        "Whether the BLAS sgemm the attention kernel calls was found in torch's libraries");
  m.def("attention_bf16_available", &lorafuse::attention_bf16_available,
        "Whether MKL's cblas_gemm_bf16bf16f32 was found too (bf16 inputs multiply in bf16)");
  m.def("attention_bf16_products", &lorafuse::attention_bf16_products,
        "Which products bf16 attention of this head dim runs: 'brgemm' (oneDNN, K/V packed once) "
        "or 'mkl' (cblas_gemm_bf16bf16f32)", py::arg("head_dim"));
  m.def("attention_forward", &lorafuse::attention_forward);
  m.def("attention_backward", &lorafuse::attention_backward);
  m.def("attention_exp", &lorafuse::attention_exp,
        "The attention softmax's exp, elementwise over contiguous fp32 (for tests)", py::arg("x"));
  m.def("attention_round_bf16", &lorafuse::attention_round_bf16,
        "fp32 -> bf16 as the attention kernel rounds P, dS and its outputs; native=False: ATen's "
        "conversion (for tests)", py::arg("x"), py::arg("native") = true);
  m.def("attention_bf16_rounding", &lorafuse::attention_bf16_rounding,
        "Which fp32 -> bf16 rounding the attention kernel runs here: 'native' (AVX-512-BF16) or "
        "'aten'");
  m.def("nf4_dequantize_forward", &lorafuse::nf4_dequantize_forward,
        "NF4 buffers -> out (dense, in out's dtype), bit-identical to the torch dequantiser",
        py::arg("codes"), py::arg("absmax_q"), py::arg("absmax_scale"), py::arg("absmax_offset"),
        py::arg("out"), py::arg("simd") = true);
  m.def("nf4_dequantize_columns", &lorafuse::nf4_dequantize_columns,
        "Columns [start, stop) of the NF4 weight with `cols` columns -> out (rows, stop - start), "
        "bit-identical to those columns of nf4_dequantize_forward (multiples of 64)",
        py::arg("codes"), py::arg("absmax_q"), py::arg("absmax_scale"), py::arg("absmax_offset"),
        py::arg("cols"), py::arg("start"), py::arg("stop"), py::arg("out"),
        py::arg("simd") = true);
  m.def("nf4_decode_linear", &lorafuse::nf4_decode_linear,
        "x (..., K), <= 8 rows, bf16/fp16 times NF4 Wᵀ (+ bias) without a dense W (decoding); "
        "simd=False: the tile body even where AVX-512 exists (for tests)",
        py::arg("x"), py::arg("codes"), py::arg("absmax_q"), py::arg("absmax_scale"),
        py::arg("absmax_offset"), py::arg("n_out"), py::arg("bias") = py::none(),
        py::arg("simd") = true);
  m.def("decode_linear_forward", &lorafuse::decode_linear_forward,
        "x (..., K), <= 8 rows, bf16/fp16 times a dense Wᵀ (+ bias) of x's dtype, fp32 sums "
        "(decoding)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("gated_delta_available", &lorafuse::blas_gemm_available,
        "Whether the BLAS sgemm the gated delta kernels call was found in torch's libraries");
  m.def("gated_delta_forward", &lorafuse::gated_delta_forward,
        "(o, final_state, chunk start states): the chunked gated delta rule per (example, value "
        "head), fp32 math (ops/gated_delta_chunks.forward's contract)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"),
        py::arg("initial_state"), py::arg("cu_seqlens"), py::arg("l2norm"), py::arg("save_states"));
  m.def("gated_delta_backward", &lorafuse::gated_delta_backward,
        "(dq, dk, dv, dg, dbeta, dinitial_state), each None unless asked for in needs",
        py::arg("dout"), py::arg("dfinal"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"),
        py::arg("beta"), py::arg("initial_state"), py::arg("states"), py::arg("cu_seqlens"),
        py::arg("l2norm"), py::arg("needs"));
  m.def("causal_conv1d_forward", &lorafuse::causal_conv1d_forward,
        "(y (B, D, T) channels adjacent in memory, final_state (N, D, K-1)); fp32 math",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("activation"),
        py::arg("initial_state"), py::arg("cu_seqlens"), py::arg("n"));
  m.def("causal_conv1d_backward", &lorafuse::causal_conv1d_backward,
        "(dx, dweight, dbias, dinitial_state), each None unless asked for in needs",
        py::arg("dy"), py::arg("dfinal"), py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("activation"), py::arg("initial_state"), py::arg("cu_seqlens"), py::arg("n"),
        py::arg("needs"));
  m.def("mamba2_scan_available", &lorafuse::blas_gemm_available,
        "Whether the BLAS sgemm_/dgemm_ the scan's products call were found in torch's libraries");
  m.def("mamba2_scan_forward", &lorafuse::mamba2_scan_forward,
        "(y, final, saved interior chunk states) of Mamba2's chunked scan, compute dtype (fp64 for "
        "fp64 x, else fp32); sub: tokens per BLAS product",
        py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("D"),
        py::arg("dt_bias"), py::arg("initial_state"), py::arg("cu_seqlens"), py::arg("softplus"),
        py::arg("lo"), py::arg("hi"), py::arg("chunk"), py::arg("sub") = 64);
  m.def("mamba2_scan_backward", &lorafuse::mamba2_scan_backward,
        "The 8 gradients (x, dt, A, B, C, D, dt_bias, initial_state), None where not needed",
        py::arg("gy"), py::arg("gfinal"), py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"),
        py::arg("C"), py::arg("D"), py::arg("dt_bias"), py::arg("initial_state"),
        py::arg("cu_seqlens"), py::arg("saved"), py::arg("softplus"), py::arg("lo"),
        py::arg("hi"), py::arg("chunk"), py::arg("needs"), py::arg("sub") = 64);
  m.def("mamba2_scan_step", &lorafuse::mamba2_scan_step,
        "One decoding token per row: (y (b, H, P), new state (b, H, P, N)), compute dtype",
        py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("D"),
        py::arg("dt_bias"), py::arg("state"), py::arg("softplus"), py::arg("lo"), py::arg("hi"));
  m.def("moe_lora_forward", &lorafuse::moe_lora_forward,
        "(out (T, H), gate/up products (S, 2I), their x·Aᵀ (S, r)) -- the last two with save: per "
        "non-empty expert group, gate/up + LoRA, activation, down + LoRA, weighted scatter "
        "(contract: ops/moe_lora_groups.forward)");
  m.def("moe_lora_backward", &lorafuse::moe_lora_backward,
        "(dx, dws, dA_gu, dB_gu, dA_d, dB_d), None where not asked for (contract: "
        "ops/moe_lora_groups.backward)");
  m.def("cross_entropy_chunk_forward_backward",
        &lorafuse::cross_entropy_chunk_forward_backward);
  m.def("cross_entropy_chunk_forward_backward_lowp",
        &lorafuse::cross_entropy_chunk_forward_backward_lowp,
        "bf16/fp16 logits (n, V) -> rounded grad_scale*(softmax - onehot) in place; (n,) fp32 loss");
  lorafuse::bind_decode_engine(m);
  m.def("int8_linear_available", &lorafuse::int8_linear_available,
        "whether oneDNN's int8 micro-kernel runs here (AMX-INT8, AVX-512-VNNI): a self-test");
  m.def("int8_linear_quantize_weight", &lorafuse::int8_quantize_weight,
        "W (out, in) -> (sw, packed_fwd, comp_fwd, packed_bwd, comp_bwd)");
  m.def("int8_linear_forward", &lorafuse::int8_linear_forward);
  m.def("int8_linear_input_grad", &lorafuse::int8_linear_input_grad);
}
