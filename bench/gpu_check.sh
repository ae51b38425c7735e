#!/usr/bin/env bash
# The GPU check for a cold machine: every GPU claim measured on one GPU in at most 8 minutes
# (the sum of the stage limits below: 480 s, budgeted for an empty Triton cache from the
# compile times in docs/kernels.md, "GPU check"), with the Python already on the machine, so
# a rerun fits in a 15-minute GPU window.
#
#   bash bench/gpu_check.sh [RESULTS_DIR]        (default results/gpu_check)
#
# Stages, in the order a first GPU run most needs them, each with its own time limit; a
# failing or timed-out stage does not stop the others, and each writes its results (JSON
# atomically, logs as they come) before the next starts:
#   env              versions, GPU name, driver                            -> env.json
#   bundle           the optional packages the machine lacks (mlperf_logging, torchao), from
#                    the wheelhouse `make gpu-bundle` builds, into .gpu-site/ (no network)
#   kernel_tests     pytest -m gpu: the attention, FlashMask and GEMM-epilogue kernels compiled
#                    on the GPU                                            -> kernel_tests.xml
#   peer_tests       the peer suite on the compiled kernels: its default subset and the matrix's
#                    head dim 64 (BERT-large's) at lengths 113 and 511      -> peer_tests.xml
#   train_step       bench/train_step.py, 20 steps: BERT-large seq/s and MFU, unpadded +
#                    triton_grouped + fused, padded, packed (FlashMask), others -> train_step.json
#   model_tests      pytest -m gpu: FP8, sharded LAMB, CUDA graph replay, the ModernBERT recipe
#                                                                          -> model_tests.xml
#   attention        bench/attention.py: fwd+bwd per backend at BERT-large shapes
#                    (triton, triton_grouped vs torch_varlen / flash_attn)  -> attention.json
#   attention_small  the same with KERNELS_ATTENTION_TILES=small (4-warp tiles) -> attention_small.json
#   tiles            which preset ran triton_grouped faster                -> tiles.json
#   window           bench/attention.py --window 128: tiles computed beside the band's ideal;
#                    windowed fwd+bwd <= 0.5 of full at length 512, <= 0.1 at 8,192; the plain
#                    varlen kernels no slower (<= 1.03x) than BASELINE_KERNELS' -> window.json
#   flashmask        bench/flashmask.py: FlashMask vs flex_attention and dense SDPA on packed
#                    rows                                                  -> flashmask.json
#   fused_ops        bench/fused_ops.py: bias+GELU, bias+dropout+residual+LayerNorm vs eager -> fused_ops.json
#   optimizer        bench/optimizer.py on one GPU: optim.shard at group size 1 against unsharded
#                    (LAMB step and whole BERT-large step), the per-tensor update time -> optimizer.json
#   fp8              bench/fp8.py (needs torchao): FFN-in bias+GELU eager / Triton / GEMM epilogue,
#                    the encoder's GEMMs bf16 vs FP8, BERT-large train steps bf16 vs FP8 -> fp8.json
#   step_sync        bench/step_sync.py: BERT-large at 96 sequences per GPU with CUDA graphs on
#                    and off, static shapes on and off, grouped vs single launch; seconds per
#                    evaluation of 10,000 samples kept on the device; syncs per steady-state
#                    step under torch.cuda.set_sync_debug_mode              -> step_sync.json
# and summary.json with every stage's exit status and seconds, rewritten after each stage.
# Needs no network; a missing optional package (flash_attn, h5py, pytest, torchao,
# mlperf_logging without a wheelhouse) is named and its part skipped.
# Environment: PYTHON (default python3), DATA_DIR (lengths for the benchmarks; default the
# built-in distribution), STAGE_SCALE (multiplies every time limit; a fraction such as 0.5
# is fine; no limit drops below 5 s), STAGES (comma-separated: run only these, name the rest
# skipped), WHEELHOUSE (default ./wheelhouse), BASELINE_KERNELS (the device code before a
# change, for the window stage's "no slower" check; default: kernels/jit_kernels.py of git's
# BASELINE_REV, default b8b2ebf, the last commit before the kernel family).
#
# Without a GPU the benchmarks run their CPU correctness mode (tiny shapes, Triton's
# interpreter); tests/test_optional_packages.py runs the script that way with mlperf_logging,
# torchao, flash_attn and apex blocked from import.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-results/gpu_check}"
PYTHON="${PYTHON:-python3}"
SCALE="${STAGE_SCALE:-1}"
if ! awk -v s="$SCALE" 'BEGIN { exit !(s ~ /^[0-9]*\.?[0-9]+$/ && s > 0) }'; then
    echo "gpu_check: STAGE_SCALE=$SCALE is not a positive number" >&2
    exit 2
fi
mkdir -p "$OUT" || { echo "gpu_check: cannot create $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
DATA_ARGS=()
if [ -n "${DATA_DIR:-}" ]; then DATA_ARGS=(--data-dir "$DATA_DIR"); fi

STATUS_LINES=()
have_timeout=1
command -v timeout >/dev/null 2>&1 || have_timeout=0

write_summary() {
    {
        echo "{"
        echo "  \"date\": \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\"${STATUS_LINES[0]+,}"
        local n=${#STATUS_LINES[@]} i sep
        for i in "${!STATUS_LINES[@]}"; do
            sep=","
            [ "$i" = $(( n - 1 )) ] && sep=""
            echo "  ${STATUS_LINES[$i]}$sep"
        done
        echo "}"
    } > "$OUT/summary.json.tmp" && mv "$OUT/summary.json.tmp" "$OUT/summary.json"
}

skip_stage() {
    echo "== $1: skipped ($2)"
    STATUS_LINES+=("\"$1\": {\"skipped\": \"$2\"}")
    write_summary
}

# run_stage NAME LIMIT_SECONDS COMMAND...: runs with a time limit, logs to $OUT/NAME.log.
run_stage() {
    local name="$1" limit="$2"
    shift 2
    if [ -n "${STAGES:-}" ] && [[ ",$STAGES," != *",$name,"* ]]; then skip_stage "$name" "not in STAGES"; return; fi
    limit=$(awk -v l="$limit" -v s="$SCALE" 'BEGIN { v = int(l * s + 0.5); print (v < 5 ? 5 : v) }')
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
    write_summary
}

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "gpu_check: no '$PYTHON' on PATH; set PYTHON=/path/to/python" >&2
    exit 2
fi

# Compiled kernels on a GPU; without one, Triton's interpreter (the CPU correctness modes).
# Triton reads this when it is first imported, in each stage's process.
if [ -z "${TRITON_INTERPRET:-}" ]; then
    TRITON_INTERPRET=$("$PYTHON" -c "import torch; print(0 if torch.cuda.is_available() else 1)" 2>/dev/null || echo 0)
fi
export TRITON_INTERPRET

# --- env -------------------------------------------------------------------------------
run_stage env 20 "$PYTHON" - "$OUT/env.json" <<'EOF'
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

# --- optional packages the machine lacks, from the wheelhouse (make gpu-bundle) -------------
WHEELHOUSE="${WHEELHOUSE:-$ROOT/wheelhouse}"
SITE="$ROOT/.gpu-site"
if [ -d "$SITE" ]; then export PYTHONPATH="$PYTHONPATH:$SITE"; fi
MISSING=()
for pair in mlperf_logging:mlperf-logging torchao:torchao; do
    "$PYTHON" -c "import ${pair%%:*}" >/dev/null 2>&1 || MISSING+=("${pair#*:}")
done
if [ ${#MISSING[@]} = 0 ]; then
    skip_stage bundle "mlperf_logging and torchao are installed"
elif [ -d "$WHEELHOUSE" ]; then
    echo "bundle: ${MISSING[*]} missing: installing from $WHEELHOUSE into $SITE (no network)"
    run_stage bundle 20 "$PYTHON" -m pip install -q --no-index --find-links "$WHEELHOUSE" --no-deps --upgrade \
        --target "$SITE" "${MISSING[@]}"
    export PYTHONPATH="$PYTHONPATH:$SITE"
else
    skip_stage bundle "${MISSING[*]} missing and no wheelhouse at $WHEELHOUSE (make gpu-bundle): their parts skip"
fi
have() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }

# --- the kernels on the device first, then BERT-large's seq/s, then the rest ------------------
PYTEST=(-q -rs -p no:cacheprovider)
if have pytest; then
    # Triton compiles each kernel variant on one core (1.4 s each, docs/kernels.md): spread the
    # tests over half the cores, at most 8 workers.
    workers=$(( $(nproc 2>/dev/null || echo 8) / 2 )); workers=$(( workers > 8 ? 8 : (workers < 1 ? 1 : workers) ))
    if have xdist; then PYTEST+=(-n "$workers"); else echo "pytest-xdist not installed: tests run serially"; fi
    run_stage kernel_tests 60 "$PYTHON" -m pytest tests/kernels/test_kernels_gpu.py tests/kernels/test_flashmask_gpu.py \
        tests/kernels/ops/test_gemm_epilogue.py -m gpu "${PYTEST[@]}" --junitxml="$OUT/kernel_tests.xml" -o timeout=55
    # The peer suite (flash-attention's error rule) on the compiled kernels: the default subset
    # (every kernel, dtype and head dim) and the whole matrix at BERT-large's head dim 64 at its
    # two longest block-crossing lengths (the full matrix: `make test-full` on a GPU).
    run_stage peer_tests 40 "$PYTHON" -m pytest tests/kernels/test_attention_peer.py -m "full_matrix or not full_matrix" \
        -k "not full_matrix or (D64 and (S113 or S511))" "${PYTEST[@]}" --junitxml="$OUT/peer_tests.xml" -o timeout=35
else
    skip_stage kernel_tests "pytest is not installed"
    skip_stage peer_tests "pytest is not installed"
fi

run_stage train_step 95 "$PYTHON" bench/train_step.py --steps 20 --json "$OUT/train_step.json" \
    ${DATA_ARGS[@]+"${DATA_ARGS[@]}"}

if have pytest; then
    run_stage model_tests 45 "$PYTHON" -m pytest tests/bert/model/test_fp8.py tests/bert/optim/test_shard_gpu.py \
        tests/bert/train/test_cuda_graphs.py tests/bert/optim/test_modernbert_recipe.py -m gpu "${PYTEST[@]}" \
        --junitxml="$OUT/model_tests.xml" -o timeout=40
else
    skip_stage model_tests "pytest is not installed"
fi

# --- attention benchmark, and the tile presets at BERT-large's shape -----------------------
# Named backends must run (a stage fails when Triton cannot); the library ones are optional.
run_stage attention 35 "$PYTHON" bench/attention.py --backends reference,padded,triton,triton_grouped \
    --optional torch_varlen,flash_attn --json "$OUT/attention.json" ${DATA_ARGS[@]+"${DATA_ARGS[@]}"}
export KERNELS_ATTENTION_TILES=small
run_stage attention_small 20 "$PYTHON" bench/attention.py --backends reference,triton,triton_grouped \
    --json "$OUT/attention_small.json" ${DATA_ARGS[@]+"${DATA_ARGS[@]}"}
unset KERNELS_ATTENTION_TILES
run_stage tiles 5 "$PYTHON" bench/pick_tiles.py "$OUT/attention.json" "$OUT/attention_small.json" \
    --json "$OUT/tiles.json"

# --- sliding window: tile work, windowed vs full, the plain kernels vs the baseline -------------
BASELINE_ARGS=()
if [ -z "${BASELINE_KERNELS:-}" ] && git -C "$ROOT" cat-file -e "${BASELINE_REV:-b8b2ebf}:kernels/jit_kernels.py" 2>/dev/null; then
    BASELINE_KERNELS="$OUT/baseline_jit_kernels.py"
    git -C "$ROOT" show "${BASELINE_REV:-b8b2ebf}:kernels/jit_kernels.py" > "$BASELINE_KERNELS"
fi
if [ -n "${BASELINE_KERNELS:-}" ]; then
    BASELINE_ARGS=(--baseline-kernels "$BASELINE_KERNELS" --max-baseline-ratio 1.03)
else
    echo "window: no BASELINE_KERNELS and no git history: the plain kernels are not timed against the baseline"
fi
WINDOW_ARGS=(--iters 10)  # without a GPU: the tile counts (the interpreter runs every program)
if [ "$TRITON_INTERPRET" = 1 ]; then WINDOW_ARGS=(--window-lengths 512 2048); fi
run_stage window 25 "$PYTHON" bench/attention.py --window 128 --window-only --backends triton \
    --max-window-ratio 0.5 0.1 --json "$OUT/window.json" "${WINDOW_ARGS[@]}" ${BASELINE_ARGS[@]+"${BASELINE_ARGS[@]}"}

# --- FlashMask on packed rows ----------------------------------------------------------------
FLASHMASK_ARGS=()  # without a GPU: one small batch of tile counts (the interpreter runs every program)
if [ "$TRITON_INTERPRET" = 1 ]; then FLASHMASK_ARGS=(--batches 1 --seqs 12 --seq-len 256); fi
run_stage flashmask 30 "$PYTHON" bench/flashmask.py --json "$OUT/flashmask.json" \
    ${FLASHMASK_ARGS[@]+"${FLASHMASK_ARGS[@]}"} ${DATA_ARGS[@]+"${DATA_ARGS[@]}"}

# --- fused elementwise ops vs eager ----------------------------------------------------------
run_stage fused_ops 15 "$PYTHON" bench/fused_ops.py --json "$OUT/fused_ops.json"

# --- sharded LAMB at group size 1 against unsharded (one GPU) ------------------------------
OPTIMIZER_ARGS=(--device cuda --ranks 1 --step-ranks 1 --preset large --precision bf16 --seq 512 --batch 16)
if [ "$TRITON_INTERPRET" = 1 ]; then OPTIMIZER_ARGS=(--ranks 1 --step-ranks 1 --preset tiny --vocab 96 --seq 32); fi
run_stage optimizer 20 "$PYTHON" bench/optimizer.py "${OPTIMIZER_ARGS[@]}" --parts optimizer,step --steps 3 \
    --json "$OUT/optimizer.json"

# --- FP8 and the FFN-in's bias+GELU in the GEMM epilogue -------------------------------------
# After train_step, so that the Triton kernels BERT-large's steps use are in Triton's cache.
if have torchao; then
    run_stage fp8 30 "$PYTHON" bench/fp8.py --json "$OUT/fp8.json" ${DATA_ARGS[@]+"${DATA_ARGS[@]}"}
else
    skip_stage fp8 "torchao is not installed (make gpu-bundle, then rerun)"
fi

# --- a step the device never waits on: graphs, static shapes, eval on the device, syncs ------
run_stage step_sync 20 "$PYTHON" -m bench.step_sync --json "$OUT/step_sync.json" ${DATA_ARGS[@]+"${DATA_ARGS[@]}"}

# --- summary (also rewritten after every stage) ------------------------------------------------
write_summary
echo "== results in $OUT"
cat "$OUT/summary.json"
