#!/bin/bash
# Start the training on THIS node: one `accelerate launch` that spawns GPUS_PER_NODE training processes.
# Run from the repository root, directly (one node) or once per node through `srun` (several nodes).
#
#   bash launch/slurm/node_launch.sh [dotted config overrides ...]
#
# Environment (defaults in brackets):
#   CONFIG             experiment YAML                         [configs/1b_256.yaml]
#   ACCELERATE_CONFIG  accelerate config file                  [launch/accelerate/zero2.yaml]
#   GPUS_PER_NODE      training processes on this node         [$SLURM_GPUS_ON_NODE, else 8]
#   NUM_MACHINES       nodes in the job                        [$SLURM_NNODES, else 1]
#   MACHINE_RANK       index of this node                      [$SLURM_NODEID, else 0]
#   MAIN_PROCESS_IP    host name or address of node 0          [required when NUM_MACHINES > 1]
#   PORT               rendezvous port on node 0               [29500]
#   TRAIN_SCRIPT       the training entry point                [train.py]
#   RESUME             value of --resume                       [latest]
#   RESEND_EVERY       seconds between repeats of a SIGUSR1    [10]
#
# Pre-emption: on SIGUSR1 or SIGTERM this script forwards the signal to the training processes (the launcher's
# children), repeats a SIGUSR1 until they exit, and keeps waiting. The training loop then finishes its step,
# checkpoints on every rank and exits 75.
# `accelerate launch` reports any failing worker as status 1, so after a forwarded SIGUSR1 a non-zero status is
# reported as 75 ("pre-empted, requeue me"); without SIGUSR1 the launcher's status is passed through.
# The launcher itself runs with SIGUSR1 ignored: its default action would kill it, and torchrun does not forward
# SIGUSR1. The training processes install their own handler, which replaces the inherited "ignore".
set -euo pipefail

CONFIG=${CONFIG:-configs/1b_256.yaml}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-launch/accelerate/zero2.yaml}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
NUM_MACHINES=${NUM_MACHINES:-${SLURM_NNODES:-1}}
MACHINE_RANK=${MACHINE_RANK:-${SLURM_NODEID:-0}}
PORT=${PORT:-29500}
TRAIN_SCRIPT=${TRAIN_SCRIPT:-train.py}
RESUME=${RESUME:-latest}
RESEND_EVERY=${RESEND_EVERY:-10}
EX_TEMPFAIL=75

# Collective errors abort the process instead of hanging until the job's time limit.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# When one rank exits first, torchrun stops the others with SIGTERM and SIGKILLs them after this many seconds
# (default 30): leave room for a rank that is still writing its part of the checkpoint.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}
# A training process that stops for a requeue without a signal (its object store stopped answering) writes 75 into
# this file, since `accelerate launch` reports its exit as 1: the status is then restored below.
export IMBA_REQUEUE_FILE=$(mktemp --tmpdir imba-requeue.XXXXXX)

args=(launch --config_file "$ACCELERATE_CONFIG"
      --num_processes "$((NUM_MACHINES * GPUS_PER_NODE))"
      --num_machines "$NUM_MACHINES" --machine_rank "$MACHINE_RANK"
      --main_process_port "$PORT")
if (( NUM_MACHINES > 1 )); then
    if [[ -z ${MAIN_PROCESS_IP:-} ]]; then
        echo "error: MAIN_PROCESS_IP must name node 0 when NUM_MACHINES=$NUM_MACHINES > 1" >&2
        exit 2
    fi
    args+=(--main_process_ip "$MAIN_PROCESS_IP")
fi
args+=("$TRAIN_SCRIPT" --config "$CONFIG" --resume "$RESUME" "$@")

launcher=""
resender=""
preempted=0
interrupted=0
forward() {
    interrupted=1
    if [[ $1 == USR1 ]]; then preempted=1; fi
    echo "[node_launch] ${HOSTNAME:-?}: SIG$1 -> training processes" >&2
    if [[ -n $launcher ]]; then
        pkill "-$1" -P "$launcher" || true  # the launcher's children: the training processes
        # A training process still starting up ignores SIGUSR1 (its handler is not installed yet): say it again
        # every RESEND_EVERY seconds until the launcher exits, so a signal during start-up is not lost (the
        # handler only sets a flag; repeats change nothing).
        if [[ $1 == USR1 && -z $resender ]]; then
            ( while sleep "$RESEND_EVERY" && kill -0 "$launcher" 2>/dev/null; do
                  pkill -USR1 -P "$launcher" || true
              done ) &
            resender=$!
        fi
    fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

echo "[node_launch] ${HOSTNAME:-?} rank $MACHINE_RANK/$NUM_MACHINES: accelerate ${args[*]}" >&2
( trap '' USR1; exec accelerate "${args[@]}" ) &
launcher=$!

# `wait` returns early (status > 128) when a trapped signal arrives: wait again until the launcher has exited.
while :; do
    interrupted=0
    wait "$launcher" && status=0 || status=$?
    (( interrupted )) || break
done
if [[ -n $resender ]]; then kill "$resender" 2>/dev/null || true; fi

asked=0
if [[ -s $IMBA_REQUEUE_FILE ]]; then asked=1; fi
rm -f "$IMBA_REQUEUE_FILE"
if (( status != 0 && preempted )); then
    echo "[node_launch] ${HOSTNAME:-?}: launcher exited with $status after SIGUSR1: reporting $EX_TEMPFAIL" >&2
    status=$EX_TEMPFAIL
elif (( status != 0 && asked )); then
    echo "[node_launch] ${HOSTNAME:-?}: launcher exited with $status after the training asked for a requeue:" \
         "reporting $EX_TEMPFAIL" >&2
    status=$EX_TEMPFAIL
fi
exit "$status"
