#!/usr/bin/env bash
# The GPU check: on one GPU, in about 5 minutes, with the Python already on the machine.
#
#   bash bench/gpu_check.sh [RESULTS_DIR]        (default results/gpu_check)
#
# Stages, each with its own time limit; a failing stage does not stop the others:
#   env         versions, GPU name, driver                     -> env.json
#   gpu_tests   pytest -m gpu tests/kernels/test_kernels_gpu.py        -> gpu_tests.xml, gpu_tests.log
#   attention   bench/attention.py (fwd+bwd per backend)       -> attention.json, attention.log
#   train_step  bench/train_step.py (BERT-large seq/s)         -> train_step.json, train_step.log
# and summary.json with every stage's exit status and seconds. Installs nothing and needs no
# network; a missing optional package (flash_attn, h5py, pytest) is reported and skipped.
# Environment: PYTHON (default python3), DATA_DIR (lengths for the benchmarks; default the
# built-in distribution), STAGE_SCALE (multiplies every time limit, default 1).
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-results/gpu_check}"
PYTHON="${PYTHON:-python3}"
SCALE="${STAGE_SCALE:-1}"
mkdir -p "$OUT" || { echo "gpu_check: cannot create $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0           # compiled kernels: Triton reads this when first imported
export PYTHONUNBUFFERED=1
DATA_ARGS=()
if [ -n "${DATA_DIR:-}" ]; then DATA_ARGS=(--data-dir "$DATA_DIR"); fi

STATUS_LINES=()
have_timeout=1
command -v timeout >/dev/null 2>&1 || have_timeout=0

# run_stage NAME LIMIT_SECONDS COMMAND...: runs with a time limit, logs to $OUT/NAME.log.
run_stage() {
    local name="$1" limit="$2"
    shift 2
    limit=$(( limit * SCALE ))
    echo "== $name (limit ${limit}s): $*"
    local start end rc
    start=$(date +%s)
    if [ "$have_timeout" = 1 ]; then
        timeout --kill-after=15 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
        rc=$?
    else
        "$@" > >(tee "$OUT/$name.log") 2>&1
        rc=$?
    fi
    end=$(date +%s)
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo "== $name: stopped at its ${limit}s limit"; fi
    echo "== $name: exit $rc after $(( end - start ))s"
    STATUS_LINES+=("\"$name\": {\"exit\": $rc, \"seconds\": $(( end - start ))}")
}

skip_stage() {
    echo "== $1: skipped ($2)"
    STATUS_LINES+=("\"$1\": {\"skipped\": \"$2\"}")
}

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "gpu_check: no '$PYTHON' on PATH; set PYTHON=/path/to/python" >&2
    exit 2
fi

# --- env -------------------------------------------------------------------------------
run_stage env 30 "$PYTHON" - "$OUT/env.json" <<'EOF'
import importlib, json, os, platform, subprocess, sys
info = {"python": sys.version.split()[0], "host": platform.node()}
for name in ("torch", "triton", "numpy", "h5py", "pytest", "flash_attn"):
    try:
        info[name] = getattr(importlib.import_module(name), "__version__", "installed")
    except Exception as e:
        info[name] = None
        print(f"optional package {name}: not available ({type(e).__name__})")
import torch
info["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name()
    info["capability"] = list(torch.cuda.get_device_capability())
    info["torch_cuda"] = torch.version.cuda
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                         "--format=csv,noheader"], capture_output=True, text=True,
                                        timeout=20).stdout.strip()
except Exception as e:
    info["nvidia_smi"] = f"unavailable ({type(e).__name__})"
print(json.dumps(info, indent=1))
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as f:
    json.dump(info, f, indent=1)
os.replace(tmp, sys.argv[1])
sys.exit(0 if info["cuda_available"] else 3)
EOF

# --- GPU-only tests ------------------------------------------------------------------------
if "$PYTHON" -c "import pytest" >/dev/null 2>&1; then
    PARALLEL=()  # Triton compiles each kernel variant on one core: spread the tests over 4 workers
    if "$PYTHON" -c "import xdist" >/dev/null 2>&1; then PARALLEL=(-n 4); else echo "pytest-xdist not installed: tests run serially"; fi
    run_stage gpu_tests 100 "$PYTHON" -m pytest tests/kernels/test_kernels_gpu.py -m gpu -q -rs -p no:cacheprovider \
        ${PARALLEL[@]+"${PARALLEL[@]}"} --junitxml="$OUT/gpu_tests.xml" -o timeout=90
else
    skip_stage gpu_tests "pytest is not installed"
fi

# --- attention benchmark -------------------------------------------------------------------
run_stage attention 60 "$PYTHON" bench/attention.py --json "$OUT/attention.json" ${DATA_ARGS[@]+"${DATA_ARGS[@]}"}

# --- BERT-large training step --------------------------------------------------------------
run_stage train_step 100 "$PYTHON" bench/train_step.py --json "$OUT/train_step.json" ${DATA_ARGS[@]+"${DATA_ARGS[@]}"}

# --- summary ---------------------------------------------------------------------------------
{
    echo "{"
    echo "  \"date\": \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\","
    n=${#STATUS_LINES[@]}
    for i in "${!STATUS_LINES[@]}"; do
        sep=","
        [ "$i" = $(( n - 1 )) ] && sep=""
        echo "  ${STATUS_LINES[$i]}$sep"
    done
    echo "}"
} > "$OUT/summary.json.tmp" && mv "$OUT/summary.json.tmp" "$OUT/summary.json"
echo "== results in $OUT"
cat "$OUT/summary.json"
