#!/usr/bin/env bash
# The wheel as a user without a compiler gets it, against the source install's JIT build:
# 1. builds the wheel with prebuilt kernels (LORAFUSE_BUILD_WHEEL_KERNELS=1) and checks its tag,
#    its torch pin and its modules;
# 2. installs it (and only lorafuse from it) into a fresh venv that sees this machine's torch and
#    transformers (--system-site-packages), with c++/g++/gcc/cc/ninja hidden by failing shims;
# 3. runs scripts/first_step.py there with a fresh LORAFUSE_CACHE: the prebuilt C++ kernels must
#    run, no compiler be called, no build directory be written;
# 4. runs it again from the source tree with another fresh cache (JIT compile) and compares the
#    step's loss and gradients, bit for bit, then prints both times to the first training step.
# Usage: bash scripts/wheel_check.sh   (work dir: $WHEEL_CHECK_DIR, default /tmp/lorafuse_wheel_check;
#        wheel objects are kept in build/ between runs)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=${WHEEL_CHECK_DIR:-/tmp/lorafuse_wheel_check}
py=${PYTHON:-python}
rm -rf "$work" && mkdir -p "$work/dist"

echo "wheel_check: building the wheel (every variant of this platform; minutes the first time)"
start=$SECONDS
LORAFUSE_BUILD_WHEEL_KERNELS=1 "$py" -m pip wheel . --no-build-isolation --no-deps -q \
    -w "$work/dist"
wheel=$(ls "$work"/dist/lorafuse-*.whl)
echo "wheel_check: built $(basename "$wheel") in $((SECONDS - start)) s"
"$py" - "$wheel" <<'EOF'
import sys, zipfile
import torch
whl = sys.argv[1]
assert not whl.endswith("-py3-none-any.whl"), f"{whl}: a pure wheel"
names = zipfile.ZipFile(whl).namelist()
meta = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith(".dist-info/METADATA")))
pins = [l for l in meta.decode().splitlines() if l.startswith("Requires-Dist: torch")]
major, minor = torch.__version__.split(".")[:2]
assert pins == [f"Requires-Dist: torch<{major}.{int(minor) + 1},>={major}.{minor}"], pins
mods = sorted(n for n in names if n.startswith("lorafuse/_prebuilt/"))
print("wheel_check:", pins[0], "|", ", ".join(n.split("/")[-1] for n in mods))
assert "lorafuse/_prebuilt/TORCH_VERSION" in mods and len(mods) >= 2, mods
EOF

"$py" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-deps --no-index --force-reinstall "$wheel"
shims=$work/shims
mkdir -p "$shims"
for tool in c++ g++ gcc cc clang clang++ ninja; do
    printf '#!/bin/sh\necho "$0 $*" >> %s/compiler_calls\nexit 127\n' "$work" > "$shims/$tool"
    chmod +x "$shims/$tool"
done

echo "wheel_check: the first training step from the wheel (no compiler, fresh cache)"
(cd "$work" && PATH=$shims:$work/venv/bin:$PATH CXX=$shims/c++ LORAFUSE_CACHE=$work/cache-wheel \
    PYTHONPATH= "$work/venv/bin/python" "$repo/scripts/first_step.py" "$work/wheel" \
    > "$work/wheel.log" 2>&1) || { cat "$work/wheel.log"; exit 1; }
if [ -e "$work/compiler_calls" ]; then
    echo "FAIL: the wheel called a compiler:"; cat "$work/compiler_calls"; exit 1
fi
if [ -e "$work/cache-wheel/ext" ]; then
    echo "FAIL: the wheel wrote a build directory: $(ls "$work/cache-wheel/ext")"; exit 1
fi

echo "wheel_check: the first training step from the source tree (JIT compile, fresh cache)"
PYTHONPATH=$repo/src LORAFUSE_CACHE=$work/cache-source \
    "$py" "$repo/scripts/first_step.py" "$work/source" > "$work/source.log" 2>&1 \
    || { cat "$work/source.log"; exit 1; }

"$py" - "$work" "$work/venv" <<'EOF'
import json, sys
from pathlib import Path
import torch
work, venv = Path(sys.argv[1]), Path(sys.argv[2])
wheel, source = (json.loads((work / r / "status.json").read_text()) for r in ("wheel", "source"))
assert wheel["describe"]["cpp_variant"].endswith("(prebuilt)"), wheel["describe"]["cpp_variant"]
assert Path(wheel["lorafuse"]).is_relative_to(venv), wheel["lorafuse"]  # lorafuse from the wheel
assert "(cache " in source["describe"]["cpp_variant"], source["describe"]["cpp_variant"]
assert wheel["describe"]["choices"] == source["describe"]["choices"]
a, b = (torch.load(work / r / "tensors.pt") for r in ("wheel", "source"))
for dtype in a:
    assert a[dtype].keys() == b[dtype].keys()
    for name in a[dtype]:
        assert torch.equal(a[dtype][name], b[dtype][name]), f"{dtype} {name} differs"
print(f"wheel_check: OK: {wheel['describe']['cpp_variant']} vs {source['describe']['cpp_variant']}:"
      f" same loss and {sum(len(t) for t in a.values()) - 2} gradients, bit for bit")
print(f"time to the first training step (wall / CPU s, {wheel['describe']['cpu_capability']}):")
for label, run in (("wheel (prebuilt)", wheel), ("source (JIT compile)", source)):
    print(f"  {label:22s} {run['seconds_to_first_step']:8.1f} / {run['cpu_seconds_to_first_step']:.1f}")
EOF
