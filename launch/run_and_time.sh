#!/usr/bin/env bash
# One timed MLPerf run: clear the page cache, train, keep the MLPerf log as result_N.txt and
# print the line MLPerf reference scripts print:
#     RESULT,bert,<seed>,<seconds>,<user>,<start date>
# It runs once per rank (srun and mpirun start it on every rank) or once for one process.
#
# Environment:
#   CONFIG        system config, e.g. launch/configs/dgxh100_1x8.yaml (required)
#   OUTPUT_DIR    directory of this set of runs (default results/<config name>); run N trains
#                 into OUTPUT_DIR/run_N and its log becomes OUTPUT_DIR/result_N.txt
#   RUN_INDEX     N (required with more than one rank; default: the first unused N)
#   SEED          passed as train.seed (default: the config's seed)
#   CLEAR_CACHES  1 (default): local rank 0 drops the page cache when the kernel lets it
#   NPROC_PER_NODE  start this many ranks on this node with torchrun (for a single node or a
#                 container run); unset: this script is one rank, started by srun or mpirun
#   PYTHON, TRAIN_SCRIPT  interpreter (default .venv/bin/python, else python) and entry point
# Arguments are passed on to run_pretraining.py as section.field=value overrides.
#
# Summarize a set of runs with: python -m launch.summarize OUTPUT_DIR
set -euo pipefail

: "${CONFIG:?set CONFIG to a system config, e.g. launch/configs/dgxh100_1x8.yaml}"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -x $repo/.venv/bin/python ]]; then python=${PYTHON:-$repo/.venv/bin/python}; else python=${PYTHON:-python}; fi
train_script=${TRAIN_SCRIPT:-$repo/run_pretraining.py}
output_dir=${OUTPUT_DIR:-results/$(basename "$CONFIG" .yaml)}

if [[ -n ${NPROC_PER_NODE:-} ]]; then
    # This script is the only process of the run that is not a rank: it starts them.
    launcher=("$python" -m torch.distributed.run --standalone --nproc-per-node "$NPROC_PER_NODE")
    rank=0 world_size=1 local_rank=0
else
    launcher=("$python")
    # Same precedence as launch/distributed.py: torchrun, OpenMPI, MPICH, Slurm.
    rank=${RANK:-${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-0}}}}
    world_size=${WORLD_SIZE:-${OMPI_COMM_WORLD_SIZE:-${PMI_SIZE:-${SLURM_NTASKS:-1}}}}
    local_rank=${LOCAL_RANK:-${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${SLURM_LOCALID:-0}}}}
fi

if [[ -z ${RUN_INDEX:-} ]]; then
    # Ranks that start at different times could pick different N: only one rank may guess.
    if (( world_size > 1 )); then echo "run_and_time.sh: set RUN_INDEX when running $world_size ranks" >&2; exit 2; fi
    RUN_INDEX=0
    while [[ -e $output_dir/result_$RUN_INDEX.txt || -e $output_dir/run_$RUN_INDEX ]]; do RUN_INDEX=$((RUN_INDEX + 1)); done
fi
[[ $RUN_INDEX =~ ^[0-9]+$ ]] || { echo "run_and_time.sh: RUN_INDEX must be a number, got '$RUN_INDEX'" >&2; exit 2; }
run_dir=$output_dir/run_$RUN_INDEX
mkdir -p "$output_dir"

if [[ ${CLEAR_CACHES:-1} != 0 && $local_rank == 0 ]]; then
    if [[ -w /proc/sys/vm/drop_caches ]] && sync && { echo 3 > /proc/sys/vm/drop_caches; } 2>/dev/null; then
        echo "run_and_time.sh: page cache cleared"
    else
        echo "run_and_time.sh: page cache not cleared (/proc/sys/vm/drop_caches not writable here)"
    fi
fi

start=$(date +%s)
start_fmt=$(date +'%Y-%m-%d %r')
echo "STARTING TIMING RUN $RUN_INDEX AT $start_fmt"

status=0
"${launcher[@]}" "$train_script" --config "$CONFIG" --output-dir "$run_dir" ${SEED:+"train.seed=$SEED"} "$@" || status=$?

end=$(date +%s)
if (( rank == 0 )); then
    log=$run_dir/mlperf.log
    if [[ -f $log ]]; then
        cp "$log" "$output_dir/result_$RUN_INDEX.txt.tmp" && mv "$output_dir/result_$RUN_INDEX.txt.tmp" "$output_dir/result_$RUN_INDEX.txt"
        seed=${SEED:-$(sed -n 's/.*"key": "seed", "value": \([0-9]*\).*/\1/p' "$log" | head -n 1)}
    else
        echo "run_and_time.sh: no MLPerf log at $log" >&2
        seed=${SEED:-unknown}
    fi
    echo "ENDING TIMING RUN $RUN_INDEX AT $(date +'%Y-%m-%d %r') (exit status $status)"
    echo "RESULT,bert,$seed,$((end - start)),${USER:-$(id -un)},$start_fmt"
fi
exit "$status"
