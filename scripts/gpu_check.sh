#!/usr/bin/env bash
# One GPU check for lorafuse's Triton kernels, run from the repo root on a CUDA machine:
#
#     bash scripts/gpu_check.sh            # writes into $OUT (default ./gpu_out)
#
# Stages, each under its own timeout, and all together under TOTAL_S (default 420 s = 7 min):
#   env         nvidia-smi, python / torch / triton / transformers / peft versions
#   deps        lorafuse importable from src/ (PYTHONPATH; pip only if that fails -- the device
#               machine has no package index, so nothing is downloaded)
#   test_triton pytest tests/triton on CUDA (real kernels, no interpreter; up to 10 failures shown)
#   bench_gpu   benchmarks/ops/gpu_all.py: torch vs triton per op, fwd and fwd+bwd, bf16 ->
#               gpu_results.json, and the verdict: which ops are faster, and the exact backends.TRITON_DEFAULT line
#               that turns them on (printed again at the end of the log)
#   test_ops    pytest tests/ops -x on CUDA (not the C++ or slow tests)
#   bench_train python -m lorafuse bench --device cuda --dtype bf16 -> bench_train.json
# Files in $OUT: gpu_log.txt (everything printed), gpu_results.json (bench + stage summary),
# bench_train.json, pytest_triton.xml, pytest_ops.xml.
# DRY_RUN=1 checks this script's logic on a CPU machine: tiny CPU/interpreter benchmark, a subset
# of the op tests, a one-step fp32 bench_train.
set -u
START=$(date +%s)
TOTAL_S=${TOTAL_S:-420}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_log.txt") 2>&1

export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/lorafuse_triton_cache}  # shared by all stages
unset TRITON_INTERPRET LORAFUSE_KERNELS
# This check is about CUDA. Without a C++ compiler lorafuse's CPU extension is reported
# unavailable at once, instead of being compiled (a minute or more) the first time anything calls
# backends.cpp_available() -- backends.describe() does, and `lorafuse bench` calls describe().
export CXX=${GPU_CHECK_CXX:-no-cxx-during-gpu-check}
PY=${PY:-python3}
STAGES=""

# stage NAME LIMIT_S CMD...: runs CMD under min(LIMIT_S, time left), records rc and seconds.
stage() {
    local name=$1 limit=$2
    shift 2
    local left=$((TOTAL_S - ($(date +%s) - START)))
    if ((left < 15)); then
        echo "=== [$name] SKIPPED: only ${left}s of the ${TOTAL_S}s budget left"
        STAGES="$STAGES $name:skipped:0"
        return
    fi
    ((limit > left)) && limit=$left
    echo "=== [$name] start $(date +%T), limit ${limit}s: $*"
    local t0=$(date +%s)
    timeout -k 5 "$limit" "$@"
    local rc=$?
    local dt=$(($(date +%s) - t0))
    ((rc == 124 || rc == 137)) && echo "=== [$name] TIMED OUT after ${dt}s"
    echo "=== [$name] rc=$rc in ${dt}s"
    STAGES="$STAGES $name:$rc:$dt"
}

stage nvidia-smi 20 nvidia-smi
stage versions 60 "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "triton", "transformers", "peft", "safetensors", "gguf", "pytest", "xdist",
             "pytest_timeout", "tqdm", "yaml"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:15} {getattr(mod, '__version__', 'present')}")
    except Exception as err:
        print(f"{name:15} MISSING ({type(err).__name__}: {err})")
import torch
print("cuda available:", torch.cuda.is_available(), "device:",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "cuda", torch.version.cuda)
EOF

# lorafuse from src/ (PYTHONPATH above); an editable install only if that import fails.
if ! "$PY" -c "import lorafuse.backends, lorafuse.triton.lora_linear" 2>/dev/null; then
    stage pip_install 90 "$PY" -m pip install -e . --no-deps --no-build-isolation -q
fi
stage import 60 "$PY" -c "
import lorafuse, lorafuse.backends as b, torch
print('lorafuse from', lorafuse.__file__); print(b.describe())
for op in sorted(b.KERNELS['triton']): print(op, '->', b.select(op, 'cuda'))
"

XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n 8"  # compiling kernels dominates: spread it over CPUs
PT_TIMEOUT=""
"$PY" -c "import pytest_timeout" 2>/dev/null && PT_TIMEOUT="--timeout 120"

# The ops timed torch vs triton (gpu_all.py's cases per op); moe_lora: Qwen3-30B-A3B's and
# gpt-oss-20b's expert layers.
GPU_OPS=lora_linear,rms_norm,swiglu,cross_entropy,rope,dora_linear,moe_lora
BENCH_ARGS="--device cuda --reps 20 --warmup 3 --ops $GPU_OPS"
OPS_SELECT=()
TRAIN_ARGS="--device cuda --dtype bf16 --repeats 1 --steps 5 --warmup 2"
if [ "${DRY_RUN:-0}" = 1 ]; then
    BENCH_ARGS="--device cpu --tiny --reps 2 --warmup 1 --ops $GPU_OPS"
    OPS_SELECT=(-k swiglu)
    TRAIN_ARGS="--device cpu --dtype fp32 --batch 1 --seq 32 --repeats 1 --steps 1 --warmup 0"
fi

stage test_triton 100 "$PY" -m pytest tests/triton -q --maxfail=10 -p no:cacheprovider $XDIST $PT_TIMEOUT \
    --junitxml="$OUT/pytest_triton.xml"
stage bench_gpu 110 "$PY" benchmarks/ops/gpu_all.py $BENCH_ARGS --json "$OUT/gpu_results.json"
stage test_ops 60 "$PY" -m pytest tests/ops -q -x -p no:cacheprovider -m "not cpp and not slow" \
    $XDIST $PT_TIMEOUT "${OPS_SELECT[@]}" --junitxml="$OUT/pytest_ops.xml"
if [ -f src/lorafuse/bench.py ]; then
    stage bench_train 150 "$PY" -m lorafuse bench $TRAIN_ARGS --json "$OUT/bench_train.json"
fi

# Stage summary into gpu_results.json (atomic rewrite), then a short table last in the log.
STAGES="$STAGES" OUT="$OUT" "$PY" - <<'EOF'
import json, os
path = os.path.join(os.environ["OUT"], "gpu_results.json")
data = {}
if os.path.exists(path):
    try:
        data = json.load(open(path))
    except ValueError as err:
        data = {"unreadable_bench_json": str(err)}
stages = [s.split(":") for s in os.environ["STAGES"].split()]
data["stages"] = {n: {"rc": rc, "seconds": int(dt)} for n, rc, dt in stages}
with open(path + ".tmp", "w") as f:
    json.dump(data, f, indent=2, default=str)
os.replace(path + ".tmp", path)
print("\nstage           rc     s")
for n, rc, dt in stages:
    print(f"{n:15} {rc:>7} {dt:>4}")
for row in data.get("cases", []):
    if "error" in row:
        print(f"{row['op']:14} {json.dumps(row['shape'])} ERROR {row['error'][:100]}")
    else:
        print(f"{row['op']:14} {json.dumps(row['shape']):50} torch/triton f+b "
              f"{row['speedup_fwdbwd']:.2f}x  fwd {row['speedup_fwd']:.2f}x  err {max(row['rel_err'] or [0]):.1e}")
# The measurement that decides backends.TRITON_DEFAULT (empty until this says an op is faster).
verdict = data.get("triton_default")
if verdict:
    print("\nTriton default per op (torch/triton fwd+bwd; on only if faster in every case):")
    for op, v in sorted(verdict["ops"].items()):
        print(f"  {op:14} {'FASTER' if v['faster'] else 'stays torch':12} min {v['min_ratio']} "
              f"max {v['max_ratio']} max rel err {v['max_rel_err']}")
    print("line for src/lorafuse/backends.py:\n  " + verdict["line"])
else:
    print("\nno bench_gpu verdict (stage failed or timed out): TRITON_DEFAULT stays empty")
EOF
echo "gpu_check done in $(($(date +%s) - START))s"
sleep 1  # let tee flush the log
