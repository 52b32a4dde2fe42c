#!/usr/bin/env bash
# The GPU checks and benchmarks of attnlab, for the `device` tool's 2x H200 machine (nvidia-h200-x2)
# and its 600 s per call: one phase per call, the two GPUs working in parallel, every step bounded
# so the phase's archive always comes back.
#
#   kernels  : GPU0 bf16 accuracy of the softmax-family kernels (check_softmax_family_gpu.py), then
#              of the threshold family (check_threshold_gpu.py --skip-bench);
#              GPU1 compute-sanitizer memcheck of both families (sanitize_kernels.py)
#   bench    : GPU0 bench_attention.py --only main, --only masks; GPU1 --only issue15 (the kernel
#              targets of issue 15) and --only threshold
#   train    : GPT-2 small training throughput per variant (bench_train.py, the cases split over the
#              two GPUs); then GPU0 where a step's time goes (profile_train_step.py), GPU1 the
#              determinism check (check_train_determinism.py: two runs, bitwise equal losses)
#   ddp      : NCCL all-reduce bandwidth and topology; train.py on 1 vs 2 GPUs (bench_ddp.py, compiled,
#              GPT-2 small); DDP without Lightning on 1 and 2 GPUs (bench_ddp_raw.py)
#   fsdp     : FSDP on both GPUs (20 steps, smoke run); host-device syncs inside train.py's steps
#              (check_host_syncs.py)
#   ablation : the ablation preset on both GPUs (scripts/run_ablation.sh device)
#
# One GPU: scripts/gpu_train_loop.sh (train.py against a plain loop, the captured step's checks).
# Call (from the repo root, on the device tool):
#   run(kind="nvidia-h200-x2", carry=[".whl", ".device_cache"], timeout_s=600,
#       command="ATTNLAB_COMMIT=<sha> bash scripts/gpu_validation.sh kernels")
# Everything lands in $OUT as a few files (the tool returns at most 8); unpack here with tar.
set -uo pipefail
PHASES="kernels bench train ddp fsdp ablation"
if [[ " $PHASES " != *" ${1:-none} "* ]]; then
  echo "usage: $0 ${PHASES// /|}" >&2
  exit 2
fi
T0=$(date +%s)  # the phase budget counts from here: the wheel install below is part of the call
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 ATTNLAB_CACHE_DIR=$ROOT/.device_cache WANDB_MODE=offline
export ATTNLAB_COMMIT=${ATTNLAB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if ! python3 -c "import hydra" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
stamp() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }

on_gpu() {  # on_gpu GPU SECONDS LOG CMD...: one step, bounded, logged, never fatal
  local gpu=$1 secs=$2 log=$3
  shift 3
  # never past the phase budget: a call cut at its 600 s limit would bring back no archive
  local left=$(( T0 + ${PHASE_BUDGET_S:-560} - $(date +%s) ))
  (( secs > left )) && secs=$(( left > 1 ? left : 1 ))
  stamp "GPU$gpu start (limit ${secs}s): $*" | tee -a "$WORK/steps.log"
  CUDA_VISIBLE_DEVICES=$gpu timeout -s TERM "$secs" "$@" >"$log" 2>&1
  local rc=$?
  stamp "GPU$gpu done (exit $rc): $*" | tee -a "$WORK/steps.log"
  tail -n 25 "$log"
}

fsdp_smoke() {  # fsdp_smoke GPUS SECONDS DIR: 20 FSDP steps of the small model on GPUS (1 or 0,1)
  local gpus=$1 secs=$2 dir=$3 commas=${1//[^,]/}
  on_gpu "$gpus" "$secs" "$dir/fsdp_smoke.log" python3 train.py experiment=gpu_small trainer=fsdp \
    "trainer.devices=$(( ${#commas} + 1 ))" train.compile=false train.max_steps=20 train.val_every=10 logger=csv \
    trainer.enable_progress_bar=false "hydra.run.dir=$dir/fsdp_run"
  rm -rf "$dir/fsdp_run/checkpoints"  # results.json and the metrics are what come back
}

ddp_scaling() {  # ddp_scaling SECONDS OUT STEPS [OVERRIDES...]: bench_ddp.py, GPT-2 small, batch 16, 1 vs 2 GPUs
  local secs=$1 out=$2 steps=$3
  shift 3
  on_gpu 0,1 "$secs" "$out.log" python3 scripts/bench_ddp.py --gpus 2 --out "$out" experiment=gpu_small \
    model=gpt2_small train.batch_size=16 "train.max_steps=$steps" "train.val_every=$steps" \
    train.val_tokens=16384 train.warmup_steps=10 train.log_max_logit=false "$@"
}

raw_ddp() {  # raw_ddp GPUS SECONDS OUT [ARGS...]: scripts/bench_ddp_raw.py, one process per GPU of GPUS
  local gpus=$1 secs=$2 out=$3 commas=${1//[^,]/}
  shift 3
  on_gpu "$gpus" "$secs" "$out.log" python3 -m torch.distributed.run --standalone \
    --nproc-per-node $(( ${#commas} + 1 )) scripts/bench_ddp_raw.py --out "$out" "$@"
}

pack() {  # pack NAME: the phase's outputs as one archive in $OUT
  cp "$WORK/steps.log" "$OUT/$1_steps.log" 2>/dev/null
  tar czf "$OUT/$1.tar.gz" -C "$WORK" .
}

phase_kernels() {
  local k=$WORK/kernels
  mkdir -p "$k"
  on_gpu 1 540 "$k/sanitize.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 scripts/sanitize_kernels.py &
  on_gpu 0 300 "$k/check_softmax_family.log" python3 scripts/check_softmax_family_gpu.py --json "$k/check_softmax_family.json"
  on_gpu 0 240 "$k/check_threshold.log" python3 scripts/check_threshold_gpu.py --skip-bench --out "$k"
  wait
  pack kernels
}

phase_bench() {
  local b=$WORK/bench
  mkdir -p "$b"
  on_gpu 1 330 "$b/bench_issue15.log" python3 scripts/bench_attention.py --only issue15 --prewarm 6 --out "$b/bench_issue15" &
  on_gpu 0 200 "$b/bench_main.log" python3 scripts/bench_attention.py --only main --out "$b/bench_main"
  on_gpu 0 180 "$b/bench_masks.log" python3 scripts/bench_attention.py --only masks --out "$b/bench_masks"
  wait
  on_gpu 1 200 "$b/bench_threshold.log" python3 scripts/bench_attention.py --only threshold --out "$b/bench_threshold"
  pack bench
}

phase_train() {
  local t=$WORK/train
  mkdir -p "$t"
  on_gpu 0 300 "$t/bench_train_a.log" python3 scripts/bench_train.py --model gpt2_small --batch 16 \
    --variants softmax,softcap_tanh,softcap_softsign --out "$t/bench_train_a" &
  on_gpu 1 300 "$t/bench_train_b.log" python3 scripts/bench_train.py --model gpt2_small --batch 16 \
    --variants alsc,threshold,diff_threshold --out "$t/bench_train_b"
  wait
  on_gpu 0 220 "$t/profile.log" python3 scripts/profile_train_step.py \
    --cases sdpa:16,triton:16,sdpa:32,triton:32 --out "$t/profile_train_step" &
  on_gpu 1 220 "$t/determinism.log" python3 scripts/check_train_determinism.py --json "$t/determinism.json" \
    --variants softmax,threshold experiment=gpu_small train.max_steps=30 train.val_every=15 train.val_tokens=65536
  wait
  pack train
}

phase_ddp() {
  local d=$WORK/ddp
  mkdir -p "$d"
  nvidia-smi topo -m >"$d/topology.txt" 2>&1
  on_gpu 0,1 90 "$d/bench_allreduce.log" env NCCL_DEBUG=INFO python3 scripts/bench_allreduce.py --gpus 2 \
    --out "$d/bench_allreduce"
  grep -E "NCCL version|via|Channel 00" "$d/bench_allreduce.log" | head -n 8
  ddp_scaling 250 "$d/bench_ddp_compiled" 100
  raw_ddp 0,1 100 "$d/bench_ddp_raw_2" --settings default
  raw_ddp 0 70 "$d/bench_ddp_raw_1" --settings default
  pack ddp
}

phase_fsdp() {
  local f=$WORK/fsdp
  mkdir -p "$f"
  fsdp_smoke 0,1 150 "$f"
  on_gpu 0 120 "$f/check_host_syncs.log" python3 scripts/check_host_syncs.py --json "$f/host_syncs.json" \
    experiment=gpu_small model=gpt2_small train.batch_size=16 train.max_steps=14 train.val_every=14 \
    train.val_tokens=16384 train.log_max_logit=false
  pack fsdp
}

phase_ablation() {
  ABLATION_CACHE=$ROOT/.device_cache ABLATION_TRAIN_BUDGET_S=${ABLATION_TRAIN_BUDGET_S:-500} \
    timeout -s TERM $(( T0 + ${PHASE_BUDGET_S:-560} - $(date +%s) )) \
    bash scripts/run_ablation.sh device >"$OUT/ablation.log" 2>&1
  stamp "ablation done (exit $?)"
  tail -n 25 "$OUT/ablation.log"
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ) commit: $ATTNLAB_COMMIT"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$WORK/environment.txt"
case "${1:-}" in
  kernels) phase_kernels ;;
  bench) phase_bench ;;
  train) phase_train ;;
  ddp) phase_ddp ;;
  fsdp) phase_fsdp ;;
  ablation) phase_ablation ;;
esac
