#!/usr/bin/env bash
# The C++ kernels on aarch64, from an x86-64 Debian machine: cross-compiles csrc/ as the
# `default` variant (lorafuse._ext's flags) against the aarch64 CPU build of torch 2.10, then runs
# scripts/cpp_parity.py (every C++ op against its torch reference, fp32 and bf16) under
# qemu-aarch64 with an arm64 Python from Debian's packages, unpacked into its own folder (never
# installed), loading the module as an installed wheel does (lorafuse/_prebuilt).
#
# Needs: the project's Python (PYTHON=, default `python`; it must import torch: it reads the build
# flags from lorafuse._ext and downloads with its pip), qemu-user and g++-aarch64-linux-gnu (apt:
# installed here when missing, as root or through sudo; otherwise the script names the command),
# apt + dpkg, and the registries for the first run. ARM_BUILD_ONLY=1 stops after the build
# (scripts/build_wheels.sh puts the module into the aarch64 wheel).
# Usage: bash scripts/arm_check.sh  (downloads and builds are kept in $ARM_CACHE, default
#        /tmp/lorafuse_arm; QEMU_CPU=cortex-a76 (the default: ARMv8.2 + fp16 + dotprod, no bf16 or
#        SVE: a Raspberry Pi 5, like a Jetson Orin's A78AE) or e.g. neoverse-n1, max; torch 2.10 itself
#        dies of an illegal instruction on cortex-a72, ARMv8.0, a Raspberry Pi 4)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
cache=${ARM_CACHE:-/tmp/lorafuse_arm}
cpu=${QEMU_CPU:-cortex-a76}
py=${PYTHON:-python}
# The newest aarch64 torch on PyPI that is a CPU build (2.11-2.13 there are CUDA builds).
torch_version=2.10.0
pure=(filelock typing-extensions sympy mpmath networkx jinja2 markupsafe fsspec)  # torch's deps
debs=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev libc6
      libstdc++6 libgcc-s1 zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5 libuuid1 libcrypt1)
started=$SECONDS
phase() { echo "arm_check: $1 ($((SECONDS - started)) s)"; }
mkdir -p "$cache"

# 0. what it runs with: the project's interpreter and the cross tools
if ! "$py" -c "import torch" 2>/dev/null; then
    echo "arm_check: $py cannot import torch; run with PYTHON=<the project's interpreter>" >&2
    exit 1
fi
sudo=$([ "$(id -u)" = 0 ] || echo sudo)  # apt and dpkg need root
missing=()
command -v qemu-aarch64 >/dev/null || missing+=(qemu-user)
command -v aarch64-linux-gnu-g++ >/dev/null || missing+=(g++-aarch64-linux-gnu)
if [ ${#missing[@]} -gt 0 ]; then
    if [ -n "$sudo" ] && ! command -v sudo >/dev/null; then
        echo "arm_check: needs ${missing[*]}: apt-get install -y ${missing[*]} (as root)" >&2
        exit 1
    fi
    phase "installing ${missing[*]} (apt)"
    $sudo apt-get update -qq && $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 1. torch and its pure-Python dependencies for aarch64, unpacked (not installed) into site/
if [ ! -f "$cache/site/.done" ]; then
    phase "downloading torch $torch_version (aarch64) and ${pure[*]}"
    "$py" -m pip download -q --platform manylinux_2_28_aarch64 --only-binary=:all: \
        --python-version 3.11 --no-deps -d "$cache/wheels" "torch==$torch_version" "${pure[@]}"
    rm -rf "$cache/site" && mkdir -p "$cache/site"
    for whl in "$cache"/wheels/*.whl; do "$py" -m zipfile -e "$whl" "$cache/site"; done
    touch "$cache/site/.done"
fi

# 2. an arm64 Python: Debian's packages unpacked into armroot/ (dpkg-deb -x, never installed)
if [ ! -f "$cache/armroot/.done" ]; then
    phase "downloading Debian's arm64 python3.11"
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
        $sudo dpkg --add-architecture arm64
        $sudo apt-get update -qq
    fi
    rm -rf "$cache/debs" "$cache/armroot" && mkdir -p "$cache/debs" "$cache/armroot"
    (cd "$cache/debs" && apt-get download -qq "${debs[@]/%/:arm64}")
    for deb in "$cache"/debs/*.deb; do dpkg-deb -x "$deb" "$cache/armroot"; done
    touch "$cache/armroot/.done"
fi

# 3. cross-compile: the flags lorafuse._ext gives the default variant, plus the ones torch 2.10's
#    cpp_extension.load adds (extension name, extension.h, -fPIC -std=c++17, torch's includes)
phase "cross-compiling csrc/ for aarch64"
read -r -a flags < <(PYTHONPATH=$repo/src "$py" -c \
    "from lorafuse import _ext; print(' '.join(_ext.compile_flags('default')))")
name=lorafuse_cpp_default
torch_dir=$cache/site/torch
build=$cache/build
out=$cache/prebuilt
mkdir -p "$build" "$out"
cxxflags=(-DTORCH_EXTENSION_NAME=$name -DTORCH_API_INCLUDE_EXTENSION_H -I"$repo/src/lorafuse/csrc"
          -isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include"
          -isystem "$cache/armroot/usr/include/python3.11" -isystem "$cache/armroot/usr/include"
          -fPIC -std=c++17 "${flags[@]}")
export build cxxflags_joined="${cxxflags[*]}"
if [ "$(cat "$build/FLAGS" 2>/dev/null)" != "$cxxflags_joined" ]; then  # new flags: all sources
    rm -f "$build"/*.o
    echo "$cxxflags_joined" > "$build/FLAGS"
fi
compile_one() {  # one source -> one object, skipped when the object is newer than every input
    src=$1 obj=$build/$(basename "${1%.cpp}").o
    if [ -f "$obj" ] && [ -z "$(find "$src" "$(dirname "$src")"/*.h -newer "$obj")" ]; then
        return 0
    fi
    # shellcheck disable=SC2086  # the joined flags are split on purpose (no spaces inside)
    aarch64-linux-gnu-g++ $cxxflags_joined -c "$src" -o "$obj"
}
export -f compile_one
ls "$repo"/src/lorafuse/csrc/*.cpp | xargs -P "$(nproc)" -I{} bash -c 'compile_one {}'
suffix=.cpython-311-aarch64-linux-gnu.so
aarch64-linux-gnu-g++ -shared -fopenmp "$build"/*.o -L"$torch_dir/lib" -lc10 -ltorch_cpu -ltorch \
    -ltorch_python -o "$out/$name$suffix"
echo "$torch_version" > "$out/TORCH_VERSION"  # the stamp lorafuse._ext.prebuilt() checks
phase "built $out/$name$suffix ($(du -k "$out/$name$suffix" | cut -f1) KiB)"
if [ "${ARM_BUILD_ONLY:-0}" = 1 ]; then
    exit 0
fi

# 4. the parity check on the emulated CPU, loading the module as a wheel's prebuilt one
phase "running scripts/cpp_parity.py under qemu-aarch64 -cpu $cpu"
PYTHONPATH=$cache/site:$repo/src PYTHONDONTWRITEBYTECODE=1 \
    qemu-aarch64 -cpu "$cpu" -L "$cache/armroot" "$cache/armroot/usr/bin/python3.11" \
    "$repo/scripts/cpp_parity.py" --prebuilt "$out"
phase "done"
