#!/usr/bin/env bash
# Runs the narrow C++ variants under qemu-x86_64 -cpu Haswell (AVX2, no AVX-512: a leaked EVEX
# instruction dies with SIGILL) and checks a few ops against their torch references.
# Usage: LORAFUSE_CACHE=... bash scripts/qemu_variant_smoke.sh [avx2|default]  (builds it if needed)
set -euo pipefail
variant=${1:-avx2}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src LORAFUSE_CPU_CAPABILITY=$variant
python -m lorafuse build-ext >/dev/null  # natively: compiling under qemu would take hours
exec qemu-x86_64 -cpu Haswell "$(python -c "import sys; print(sys.executable)")" -c "
import torch
from lorafuse import _ext, backends
from lorafuse.ops.rms_norm import rms_norm, rms_norm_reference
from lorafuse.ops.swiglu import swiglu, swiglu_reference
print('torch capability under qemu:', torch.backends.cpu.get_cpu_capability())
_ext.load_cpp()
print('loaded', backends.cpp_variant())
torch.manual_seed(0)
x, w = torch.randn(37, 129), torch.randn(129)
torch.testing.assert_close(rms_norm(x, w, 1e-6, backend='cpp'), rms_norm_reference(x, w, 1e-6))
g, u = torch.randn(37, 129), torch.randn(37, 129)
torch.testing.assert_close(swiglu(g, u, backend='cpp'), swiglu_reference(g, u))
print('qemu Haswell: $variant variant OK')
"
