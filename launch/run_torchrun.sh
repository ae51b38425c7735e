#!/usr/bin/env bash
# Data-parallel training started by torchrun: GPUS_PER_NODE processes on each node.
#
#   launch/run_torchrun.sh NNODES GPUS_PER_NODE CONFIG OUTPUT_DIR [section.field=value ...]
#
# One node: a standalone rendezvous on a free port. Several nodes: run the same command on
# every node with NODE_RANK=0..NNODES-1 and MASTER_ADDR=<node 0's address> [MASTER_PORT=29500].
# Elastic: NNODES=MIN:MAX (e.g. 1:2) uses a c10d rendezvous at MASTER_ADDR:MASTER_PORT (served
# by the node whose address that is; no NODE_RANK); RDZV_ID names the job (default bert) and
# RDZV_CONF is torchrun's --rdzv-conf (e.g. last_call_timeout=5).
# On CPU, GPUS_PER_NODE is the number of ranks (gloo).
# SOCKET_IFNAME=eth1 (the NIC the ranks talk over) sets GLOO_SOCKET_IFNAME and
# NCCL_SOCKET_IFNAME unless they are set already.
# SEED=N trains with seed N; unset, the config's train.seed, and without one there each run
# draws its own from the OS (rank 0, broadcast), as MLPerf's closed division wants.
# PYTHON and TRAIN_SCRIPT override the interpreter and the entry point (run_pretraining.py);
# MAX_RESTARTS (default 0) is torchrun's --max-restarts.
# FT_REPLICAS=R: per-step fault tolerance (dist.fault_tolerance=torchft, docs/reliability.md): R
# replicas on this node, each one process (GPUS_PER_NODE must be 1), replica ids NODE_RANK*R..;
# the node with NODE_RANK 0 (default) starts the Lighthouse on FT_LIGHTHOUSE_PORT (default 29510),
# which the others reach at MASTER_ADDR (TORCHFT_LIGHTHOUSE overrides it; nothing is started then).
# FT_MIN_REPLICAS (default 1) is the smallest quorum; FT_JOIN_TIMEOUT_MS (default 10000) how long
# a quorum waits for stragglers. The run succeeds when one replica finishes. Several nodes:
#   NODE_RANK=k MASTER_ADDR=node0 FT_REPLICAS=8 launch/run_torchrun.sh NNODES 1 CONFIG OUT ...
# (or FT_REPLICAS=8 with launch/run_mpirun.sh or launch/slurm.sub, which run this on every node).
set -euo pipefail

if (( $# < 4 )); then
    echo "usage: $0 NNODES GPUS_PER_NODE CONFIG OUTPUT_DIR [section.field=value ...]" >&2
    exit 2
fi
nnodes=$1 nproc=$2 config=$3 output_dir=$4
shift 4
[[ $nnodes =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ && $nproc =~ ^[1-9][0-9]*$ ]] ||
    { echo "$0: NNODES (or MIN:MAX) and GPUS_PER_NODE must be positive integers, got '$nnodes' and '$nproc'" >&2; exit 2; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -x $repo/.venv/bin/python ]]; then python=${PYTHON:-$repo/.venv/bin/python}; else python=${PYTHON:-python}; fi
train_script=${TRAIN_SCRIPT:-$repo/run_pretraining.py}

if [[ -n ${SOCKET_IFNAME:-} ]]; then
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$SOCKET_IFNAME} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$SOCKET_IFNAME}
fi

if [[ -n ${FT_REPLICAS:-} ]]; then
    [[ $FT_REPLICAS =~ ^[1-9][0-9]*$ && $nproc == 1 && $nnodes =~ ^[1-9][0-9]*$ ]] ||
        { echo "$0: FT_REPLICAS needs a positive count, GPUS_PER_NODE 1 (a replica is one rank) and a plain NNODES" >&2; exit 2; }
    export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    # Started once per node by mpirun or srun (launch/run_mpirun.sh, launch/slurm.sub with FT_REPLICAS),
    # the node is that process's rank, and the replicas are no ranks of the launcher's world.
    node=${NODE_RANK:-${OMPI_COMM_WORLD_RANK:-${SLURM_PROCID:-0}}} port=${FT_LIGHTHOUSE_PORT:-29510} pids=()
    unset RANK WORLD_SIZE LOCAL_RANK OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_LOCAL_RANK \
        PMI_RANK PMI_SIZE MPI_LOCALRANKID SLURM_PROCID SLURM_NTASKS SLURM_LOCALID
    if [[ -z ${TORCHFT_LIGHTHOUSE:-} ]]; then
        if (( node == 0 )); then
            lighthouse=$(dirname "$python")/torchft_lighthouse
            [[ -x $lighthouse ]] || lighthouse=$(command -v torchft_lighthouse) ||
                { echo "$0: FT_REPLICAS: no torchft_lighthouse (pip install -e '.[ft]')" >&2; exit 2; }
            "$lighthouse" --min_replicas "${FT_MIN_REPLICAS:-1}" --bind "[::]:$port" \
                --join_timeout_ms "${FT_JOIN_TIMEOUT_MS:-10000}" >"${FT_LIGHTHOUSE_LOG:-/dev/null}" 2>&1 &
            lighthouse_pid=$!
            trap 'kill "$lighthouse_pid" 2>/dev/null || true' EXIT
        fi
        export TORCHFT_LIGHTHOUSE=http://${MASTER_ADDR:-$(hostname)}:$port
    fi
    for ((i = 0; i < FT_REPLICAS; i++)); do
        gpu=()  # one GPU per replica on a GPU node
        if command -v nvidia-smi >/dev/null && [[ -z ${CUDA_VISIBLE_DEVICES:-} ]]; then gpu=(CUDA_VISIBLE_DEVICES=$i); fi
        env "${gpu[@]}" REPLICA_GROUP_ID=$((node * FT_REPLICAS + i)) "$python" "$train_script" --config "$config" \
            --output-dir "$output_dir" dist.fault_tolerance=torchft ${SEED:+"train.seed=$SEED"} "$@" &
        pids+=($!)
    done
    status=1  # a lost replica is what this mode survives: the run worked if one replica finished
    for pid in "${pids[@]}"; do wait "$pid" && status=0; done
    exit "$status"
fi

if [[ $nnodes == *:* ]]; then
    rendezvous=(--nnodes "$nnodes" --rdzv-backend c10d --rdzv-id "${RDZV_ID:-bert}"
                --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR to the address of the rendezvous node}:${MASTER_PORT:-29500}"
                ${RDZV_CONF:+--rdzv-conf "$RDZV_CONF"})
elif (( nnodes == 1 )); then
    rendezvous=(--standalone)
else
    rendezvous=(--nnodes "$nnodes" --node-rank "${NODE_RANK:?set NODE_RANK (0..$((nnodes - 1))) on each node}"
                --master-addr "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}" --master-port "${MASTER_PORT:-29500}")
fi

# A failed run shows each rank's one-line error: no c10d warnings with C++ stack frames, no
# torchrun log lines or traceback (launch/torchrun.py; LOGLEVEL=INFO TORCH_CPP_LOG_LEVEL=INFO show them).
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR} TORCH_SHOW_CPP_STACKTRACES=${TORCH_SHOW_CPP_STACKTRACES:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # what torchrun sets for several ranks, without its banner

# MAX_RESTARTS=N restarts all ranks (from the last checkpoint) when one dies. Restarted ranks
# must not reuse the dead generation's store address (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
exec "$python" "$repo/launch/torchrun.py" "${rendezvous[@]}" --nproc-per-node "$nproc" --max-restarts "${MAX_RESTARTS:-0}" \
    "$train_script" --config "$config" --output-dir "$output_dir" ${SEED:+"train.seed=$SEED"} "$@"
