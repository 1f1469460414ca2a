#!/usr/bin/env bash
# The wheel as a user without a compiler gets it, against the source install's JIT build:
# 1. builds the wheel with prebuilt kernels (LORAFUSE_BUILD_WHEEL_KERNELS=1) and checks its tag,
#    its torch pin and its modules;
# 2. installs it (and only lorafuse from it) into a fresh venv that sees this machine's torch and
#    transformers (--system-site-packages), with c++/g++/gcc/cc/ninja hidden by failing shims;
# 3. runs, there, with a fresh LORAFUSE_CACHE: the venv's `lorafuse train` for a few steps on the
#    demo data with the built-in model (scripts/train_first_step.py times it to its first step),
#    then scripts/first_step.py (patch_peft_model, fp32 and bf16); the prebuilt C++ kernels must
#    run (the patch report names the variant "(prebuilt)"), no compiler be called, no build
#    directory be written, no compile message be printed;
# 4. runs both again from the source tree with another fresh cache (the train run JIT-compiles)
#    and compares: the train run's loss and grad norm at every step and its final adapter, and
#    first_step.py's loss and gradients, all bit for bit (same compiler, flags and sources, same
#    threads: the same instructions in the same order, so no tolerance is needed); then prints
#    both times to the first training step of `lorafuse train`.
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

# A few steps of the built-in SmolLM2-135M-Instruct on the shipped demo rows; --logging-steps 1
# makes step 1 visible in logging.jsonl, which train_first_step.py waits for.
train=(train --data "$repo/src/lorafuse/data/demo/train.jsonl" --dtype float32 --max-steps 3
       --batch-size 1 --max-seq-length 64 --logging-steps 1 --save-steps 0 --no-progress)
timed="$repo/scripts/train_first_step.py"

echo "wheel_check: lorafuse train and a patch_peft_model step from the wheel (no compiler, fresh cache)"
(cd "$work" && export PATH=$shims:$work/venv/bin:$PATH CXX=$shims/c++ \
    LORAFUSE_CACHE=$work/cache-wheel PYTHONPATH= &&
    "$work/venv/bin/python" "$timed" "$work/wheel-train" -- \
        "$work/venv/bin/lorafuse" "${train[@]}" --output-dir "$work/wheel-train" \
        > "$work/wheel-train.log" 2>&1 || { cat "$work/wheel-train.log"; exit 1; }
    "$work/venv/bin/python" "$repo/scripts/first_step.py" "$work/wheel" \
        > "$work/wheel.log" 2>&1 || { cat "$work/wheel.log"; exit 1; })
if [ -e "$work/compiler_calls" ]; then
    echo "FAIL: the wheel called a compiler:"; cat "$work/compiler_calls"; exit 1
fi
if [ -e "$work/cache-wheel/ext" ]; then
    echo "FAIL: the wheel wrote a build directory: $(ls "$work/cache-wheel/ext")"; exit 1
fi

echo "wheel_check: the same from the source tree (lorafuse train JIT-compiles, fresh cache)"
(export PYTHONPATH=$repo/src LORAFUSE_CACHE=$work/cache-source &&
    "$py" "$timed" "$work/source-train" -- "$py" -m lorafuse "${train[@]}" \
        --output-dir "$work/source-train" > "$work/source-train.log" 2>&1 \
        || { cat "$work/source-train.log"; exit 1; }
    "$py" "$repo/scripts/first_step.py" "$work/source" > "$work/source.log" 2>&1 \
        || { cat "$work/source.log"; exit 1; })

"$py" - "$work" "$work/venv" <<'EOF'
import json, re, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
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
print(f"wheel_check: OK: patch_peft_model: {wheel['describe']['cpp_variant']} vs "
      f"{source['describe']['cpp_variant']}: same loss and {sum(len(t) for t in a.values()) - 2} "
      "gradients, bit for bit")

# lorafuse train: what the user sees says which kernels ran and whether anything compiled
variant = wheel["describe"]["cpp_variant"].split()[0]
logs = {r: (work / f"{r}-train.log").read_text() for r in ("wheel", "source")}
compiling = "lorafuse: compiling the C++ CPU kernels"
assert f"C++ kernels: {variant} (prebuilt)" in logs["wheel"], "no prebuilt variant in the report"
assert compiling not in logs["wheel"], "the wheel's train run compiled"
assert re.search(rf"C\+\+ kernels: {variant} \(cache ", logs["source"]), "source: no cached build"
assert compiling in logs["source"], "the source run did not JIT-compile (not a fresh cache?)"
steps = {r: [json.loads(l) for l in (work / f"{r}-train/logging.jsonl").read_text().splitlines()]
         for r in ("wheel", "source")}
assert len(steps["wheel"]) == len(steps["source"]) == 3, steps
for w, s in zip(steps["wheel"], steps["source"]):
    assert (w["loss"], w["grad_norm"]) == (s["loss"], s["grad_norm"]), (w, s)
adapters = [load_file(work / f"{r}-train/final/adapter_model.safetensors") for r in ("wheel", "source")]
assert adapters[0].keys() == adapters[1].keys() and adapters[0]
for name, t in adapters[0].items():
    assert torch.equal(t, adapters[1][name]), f"adapter {name} differs"
losses = ", ".join(f"{x['loss']:.6f}" for x in steps["wheel"])
print(f"wheel_check: OK: lorafuse train: {variant} prebuilt vs JIT: same loss and grad norm at "
      f"{len(steps['wheel'])} steps ({losses}), same {len(adapters[0])} adapter tensors, bit for bit")
timing = {r: json.loads((work / f"{r}-train/first_step.json").read_text()) for r in ("wheel", "source")}
print("lorafuse train, time to the first training step (wall / CPU s; whole run, wall s), "
      f"{wheel['describe']['cpu_capability']}:")
for label, r in (("wheel (prebuilt)", "wheel"), ("source (JIT compile)", "source")):
    t = timing[r]
    print(f"  {label:22s} {t['seconds_to_first_step']:8.1f} / {t['cpu_seconds_to_first_step']:.1f};"
          f" {t['seconds_total']:.1f}")
EOF
