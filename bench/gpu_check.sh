#!/usr/bin/env bash
# The GPU check: every GPU path of a training run, once, on one GPU without network, in at most 8 minutes.
#
#   bash bench/fetch_wheels.sh 3.11          # beforehand, with network: the wheels the GPU image lacks, into wheels/
#   bash bench/gpu_check.sh                  # on the GPU machine, from the repository root
#   bash bench/gpu_check.sh --cpu            # the same sequence at a tiny size on the CPU (or GPU_CHECK_CPU=1);
#                                            # its compiled parts run uncompiled unless GPU_CHECK_CPU_COMPILE=1
#
# Parts, in this order, each under a hard `timeout` of its budget (× GPU_CHECK_SCALE, default 1), or of what is left
# of GPU_CHECK_BUDGET seconds (default 480) when that is less; a part with under 5 s left is skipped:
#   install        pip install --no-index --find-links wheels: the modules that do not import (none: skipped)
#   imports        versions of what a run imports, the device, `import train`          (bench/gpu_check.py imports)
#   sdpa           which SDPA kernel the masked cross-attention and the self-attention get  (gpu_check.py sdpa)
#   eager          the training step, plain / efficient IMBA / literal IMBA                 (bench/gpu_benchmark.py)
#   compiled       the same with speed.compile=true
#   eager_ckpt     eager with gradient checkpointing
#   px512          512 px once (efficient IMBA, gradient checkpointing)
#   grid           train.py for 3 steps with a sample grid at step 2, its memory measured  (gpu_check.py grid)
#   compiled_ckpt  compiled with gradient checkpointing
# Results: $GPU_CHECK_OUT, else $OUT, else bench/gpu_results/: gpu_check.md (the summary), parts.tsv, each part's
# log and JSON, benchmarks.md (the benchmark tables). Scratch (feature shards, one set per resolution, and the
# grid run): $GPU_CHECK_WORK, default bench/gpu_work/ (ignored by git; the grid run's checkpoint of the 1b preset is
# deleted after the part).
set -u
cd "$(dirname "$0")/.."

CPU=${GPU_CHECK_CPU:-0}
for arg in "$@"; do
    case $arg in
        --cpu) CPU=1 ;;
        *) echo "usage: bash bench/gpu_check.sh [--cpu]" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-$(command -v python || command -v python3)}
RESULTS=${GPU_CHECK_OUT:-${OUT:-bench/gpu_results}}
WORK=${GPU_CHECK_WORK:-bench/gpu_work}
BUDGET=${GPU_CHECK_BUDGET:-480}
SCALE=${GPU_CHECK_SCALE:-1}  # × every part's budget: a slower or busier machine
WHEELS=${GPU_CHECK_WHEELS:-wheels}
mkdir -p "$RESULTS" "$WORK"
RESULTS=$(cd "$RESULTS" && pwd)
WORK=$(cd "$WORK" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "$CPU" = 1 ]; then  # the same sequence, sized to take seconds a part
    export ACCELERATE_USE_CPU=true OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_VISIBLE_DEVICES=
    # inductor's C++ compile of even the tiny DiT takes minutes on a few cores: the compiled parts run their steps
    # eagerly (torch.compile a no-op) unless GPU_CHECK_CPU_COMPILE=1
    [ "${GPU_CHECK_CPU_COMPILE:-0}" = 1 ] || export TORCH_COMPILE_DISABLE=1
    DEVICE=cpu PRESET=tiny RES=64 RES2=128 TEXT=12 CHANNELS=64 BATCH=4 BATCH2=2 SAMPLES=16 STEPS=1 WARMUP=1
    GRID_PRESET=tiny GRID_BATCH=4 CPU_FLAG=--cpu
else
    DEVICE=cuda PRESET=1b RES=256 RES2=512 TEXT=120 CHANNELS=4096 BATCH=32 BATCH2=16 SAMPLES=256 STEPS=5 WARMUP=2
    GRID_PRESET=1b GRID_BATCH=8 CPU_FLAG=
fi

START=$(date +%s)
printf 'part\tstatus\tseconds\tbudget\n' > "$RESULTS/parts.tsv"
: > "$RESULTS/benchmarks.md"

export PY WHEELS RESULTS WORK DEVICE PRESET TEXT CHANNELS SAMPLES STEPS WARMUP GRID_PRESET GRID_BATCH CPU_FLAG

# part NAME BUDGET COMMAND...: run it (a program or a function below) under a timeout, in a process group of its own
# that the timeout ends whole (loader workers included); its output in NAME.log, its outcome in parts.tsv
part() {
    local name=$1 budget=$2 left limit began rc status
    shift 2
    budget=$((budget * SCALE))
    left=$((BUDGET - ($(date +%s) - START)))
    limit=$((budget < left ? budget : left))
    if [ "$limit" -lt 5 ]; then
        printf '%s\tskipped: the %s s budget is spent\t0\t%s\n' "$name" "$BUDGET" "$budget" >> "$RESULTS/parts.tsv"
        echo "== $name: skipped (the $BUDGET s budget is spent)"
        return
    fi
    echo "== $name (at most $limit s)"
    began=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" > "$RESULTS/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status="timed out after $limit s" ;;
        *) status="failed (exit $rc)" ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - began))" "$budget" >> "$RESULTS/parts.tsv"
    echo "   $status in $(($(date +%s) - began)) s; last lines of $RESULTS/$name.log:"
    tail -n 4 "$RESULTS/$name.log" | sed 's/^/   | /'
}

install_missing() {
    local missing=()
    for module in diffusers deepspeed webdataset braceexpand; do
        "$PY" -c "import $module" 2>/dev/null || missing+=("$module")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        echo "nothing to install: diffusers, deepspeed, webdataset and braceexpand import"
        return 0
    fi
    if [ ! -d "$WHEELS" ]; then
        echo "missing ${missing[*]} and no $WHEELS/ folder: run bash bench/fetch_wheels.sh (with network) first"
        return 1
    fi
    echo "installing ${missing[*]} from $WHEELS/"
    # an image's system Python may be marked externally managed (PEP 668): this machine is disposable
    PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install --no-index --find-links "$WHEELS" "${missing[@]}"
}

benchmark() {  # benchmark NAME RESOLUTION [gpu_benchmark.py arguments]: the benchmark at this check's size
    local name=$1 resolution=$2
    shift 2
    "$PY" bench/gpu_benchmark.py --device "$DEVICE" --preset "$PRESET" --text-tokens "$TEXT" \
        --caption-channels "$CHANNELS" --samples "$SAMPLES" --steps "$STEPS" --warmup "$WARMUP" --no-flop-check \
        --resolution "$resolution" --features "$WORK/features-$resolution" --json "$RESULTS/$name.json" \
        --out "$RESULTS/benchmarks.md" "$@"
}

grid_run() {
    local run=$WORK/grid_run rc
    rm -rf "$run"
    "$PY" bench/gpu_check.py grid --out "$RESULTS" $CPU_FLAG -- --config configs/tiny.yaml \
        "model.preset=$GRID_PRESET" data.synthetic_samples=64 "data.batch_size=$GRID_BATCH" train.max_steps=3 \
        train.sample_every=2 train.val_every=0 train.save_every=0 train.mixed_precision=bf16 sample.steps=4 \
        "train.output_dir=$run"
    rc=$?
    rm -rf "$run"  # a 1b checkpoint and export: gigabytes
    return $rc
}
export -f install_missing benchmark grid_run

part install 60 install_missing
part imports 45 "$PY" bench/gpu_check.py imports --out "$RESULTS"
part sdpa 30 "$PY" bench/gpu_check.py sdpa --out "$RESULTS" $CPU_FLAG --preset "$PRESET" --resolution "$RES" \
    --text-tokens "$TEXT" --caption-channels "$CHANNELS"
part eager 60 benchmark eager "$RES" --batch-size "$BATCH" --modes plain,efficient,literal
part compiled 150 benchmark compiled "$RES" --batch-size "$BATCH" --modes plain,efficient,literal --compile
part eager_ckpt 60 benchmark eager_ckpt "$RES" --batch-size "$BATCH" --modes plain,efficient,literal \
    --gradient-checkpointing
part px512 45 benchmark px512 "$RES2" --batch-size "$BATCH2" --modes efficient --gradient-checkpointing
part grid 90 grid_run
part compiled_ckpt 120 benchmark compiled_ckpt "$RES" --batch-size "$BATCH" \
    --modes plain,efficient,literal --compile --gradient-checkpointing

"$PY" bench/gpu_check.py summary --out "$RESULTS" > /dev/null
echo "== done in $(($(date +%s) - START)) s: $RESULTS/gpu_check.md"
