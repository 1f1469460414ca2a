#!/usr/bin/env bash
# Runs a narrow C++ variant under qemu-x86_64 -cpu Haswell (AVX2, no AVX-512: a leaked EVEX
# instruction dies with SIGILL) through scripts/cpp_parity.py: every C++ op against its torch
# reference, fp32 and bf16.
# Usage: LORAFUSE_CACHE=... bash scripts/qemu_variant_smoke.sh [avx2|default]  (builds it if needed)
set -euo pipefail
variant=${1:-avx2}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src LORAFUSE_CPU_CAPABILITY=$variant
python -m lorafuse build-ext >/dev/null  # natively: compiling under qemu would take hours
qemu-x86_64 -cpu Haswell "$(python -c "import sys; print(sys.executable)")" scripts/cpp_parity.py
echo "qemu Haswell: $variant variant OK"
