// The matmul dtype policy shared by the kernels (see common.h) and small checks.
#include "common.h"

#include <atomic>

namespace lorafuse {

namespace {
// Defaults are the safe answer for a CPU without bf16/fp16 matrix units; load_cpp overrides.
std::atomic<bool> g_native_bf16{false};
std::atomic<bool> g_native_fp16{false};
}  // namespace

void set_native_low_precision(bool bf16, bool fp16) {
  g_native_bf16.store(bf16);
  g_native_fp16.store(fp16);
}

std::tuple<bool, bool> native_low_precision() {
  return {g_native_bf16.load(), g_native_fp16.load()};
}

at::ScalarType matmul_dtype(at::ScalarType t) {
  if (t == at::kBFloat16 && !g_native_bf16.load()) return at::kFloat;
  if (t == at::kHalf && !g_native_fp16.load()) return at::kFloat;
  return t;
}

void check_2d(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
}

}  // namespace lorafuse
