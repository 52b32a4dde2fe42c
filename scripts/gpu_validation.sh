#!/usr/bin/env bash
# The GPU validation and measurement rounds, sized for the `device` tool's 2x H200 machine
# (nvidia-h200-x2) and its 600 s per call: each phase is one call, the two GPUs work in parallel.
#
#   phase kernels : GPU0  bf16 check of the softmax-family kernels, bench --only main, --only masks
#                   GPU1  the ablation (scripts/run_ablation.sh device)
#   phase train   : GPU0/GPU1  scripts/bench_train.py (gpt2_small, compiled), the cases split in two;
#                   then GPU0 compute-sanitizer memcheck (scripts/sanitize_kernels.py),
#                   GPU1 scripts/check_train_determinism.py
#   phase ddp     : both GPUs  scripts/bench_ddp.py (1 vs 2 GPUs), then the kernel cases left over
#   phase followup: GPU0 memcheck of the threshold kernels, GPU1 an FSDP smoke run; then compiled
#                   1 vs 2 GPU scaling (what the first three phases left undone)
#   phase profile : GPU0 scripts/profile_train_step.py (where the step's time goes, loss in/out of the
#                   graph, batch 16/32), then bench_train's threshold cases; GPU1 bench_train's
#                   softmax-family cases (GPT-2 small, loss inside the compiled graph)
#   phase confirm : after the RoPE tables and the sync-free training loop: compiled 1 vs 2 GPU
#                   scaling; then GPU0 bench_train's softmax-family cases, GPU1 the FSDP smoke run,
#                   bench_train's threshold cases and memcheck of the last 3 softmax-family cases
#   phase final   : compiled 1 vs 2 GPU scaling under Lightning's simple profiler (host time per
#                   hook); then GPU1 the FSDP smoke run, GPU0 bench_train's diff_threshold case
#   phase ddp2    : compiled 1 vs 2 GPU scaling after the guard's all-reduce left DDP (see
#                   docs/results/bench_ddp.md), whole-model vs per-block compile
#                   (train.compile_unit), bf16 gradient all-reduce; NCCL all-reduce bandwidth and topology
#   phase ddp3    : the same scaling after train/loss left Lightning's sync_dist (a host-blocking
#                   barrier every step), then FSDP on both GPUs
#   phase ddp4    : ddp3 again (its 2-GPU run had timed out), per-window metrics kept; FSDP on both GPUs
#                   after its callbacks' forwards went through the FSDP wrapper; scripts/bench_ddp_raw.py
#                   (DDP without Lightning: tokens/s, 1 and 2 GPUs)
#   phase ddp5    : FSDP on both GPUs after the final validation moved into fit; one GPU alone vs two
#                   independent one-GPU runs at once (bench_ddp_raw.py)
#   phase ddp6    : bench_ddp_raw.py's settings (side stream, no graph split, bucket views, eager, compiled
#                   autograd's python reducer) on 2 GPUs, default/eager on 1, each with its kernel time per
#                   step; NCCL on 4 channels; scripts/check_host_syncs.py (host syncs inside train.py's steps)
#   phase ddp7    : Lightning DDP scaling with the compiled model kept one graph (trainer=ddp's
#                   split_compiled_graph=false); bench_ddp_raw.py's one-graph variants (big buckets, static graph)
#   phase ddp8    : ddp7 with trainer=ddp's 512 MB buckets; bench_ddp_raw.py one-graph on 2 GPUs against 1 GPU;
#                   train.py on 2 GPUs with the graph split back on
#   phase ddp9    : train.py's DDP scaling over 200 steps, twice (1, 2, 1, 2 GPUs)
#   phase fsdp2   : FSDP on both GPUs (smoke run)
#
# Call (from the repo root, on the device tool):
#   run(kind="nvidia-h200-x2", carry=[".whl", ".device_cache"], timeout_s=600,
#       command="ATTNLAB_COMMIT=<sha> bash scripts/gpu_validation.sh kernels")
# Everything lands in $OUT as a few files (the tool returns at most 8); unpack here with tar.
set -uo pipefail
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

ddp_scaling_kept() {  # ddp_scaling_kept SECONDS OUT: ddp_scaling, 60 steps, with the runs' logs kept (no checkpoints)
  local secs=$1 out=$2
  ddp_scaling "$secs" "$out" 60 --runs-dir "$(dirname "$out")/runs"
  rm -rf "$(dirname "$out")"/runs/*/checkpoints
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
  (
    export CUDA_VISIBLE_DEVICES=1
    ABLATION_CACHE=$ROOT/.device_cache ABLATION_TRAIN_BUDGET_S=${ABLATION_TRAIN_BUDGET_S:-330} \
      timeout -s TERM $(( T0 + ${PHASE_BUDGET_S:-560} - $(date +%s) )) \
      bash scripts/run_ablation.sh device >"$OUT/ablation.log" 2>&1
  ) &
  on_gpu 0 250 "$k/check_softmax_family.log" python3 scripts/check_softmax_family_gpu.py --json "$k/check_softmax_family.json"
  on_gpu 0 150 "$k/bench_main.log" python3 scripts/bench_attention.py --only main --out "$k/bench_main"
  on_gpu 0 140 "$k/bench_masks.log" python3 scripts/bench_attention.py --only masks --out "$k/bench_masks"
  wait
  pack kernels
}

phase_train() {
  local t=$WORK/train
  mkdir -p "$t"
  on_gpu 0 300 "$t/bench_train_a.log" python3 scripts/bench_train.py --model gpt2_small --batch 16 \
    --variants softmax,softcap_tanh,softcap_softsign --out "$t/bench_train_a" &
  on_gpu 1 300 "$t/bench_train_b.log" python3 scripts/bench_train.py --model gpt2_small --batch 16 \
    --variants alsc,threshold,diff_threshold --out "$t/bench_train_b"
  wait
  on_gpu 0 220 "$t/sanitize.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 scripts/sanitize_kernels.py &
  on_gpu 1 200 "$t/determinism.log" python3 scripts/check_train_determinism.py --json "$t/determinism.json" \
    --variants softmax,threshold experiment=gpu_small train.max_steps=30 train.val_every=15 train.val_tokens=65536 train.compile=false
  wait
  pack train
}

phase_ddp() {
  local d=$WORK/ddp
  mkdir -p "$d"
  ddp_scaling 290 "$d/bench_ddp" 80 train.val_tokens=65536 train.log_max_logit=true
  # what the kernels phase of 2026-11-30 left unfinished (cut off by its time limits)
  on_gpu 1 150 "$d/bench_main_alsc.log" python3 scripts/bench_attention.py --only main --names tanh,alsc \
    --out "$d/bench_main_alsc" &
  on_gpu 0 90 "$d/check_rest.log" python3 scripts/check_softmax_family_gpu.py --from-case 26 \
    --json "$d/check_softmax_family_rest.json"
  on_gpu 0 150 "$d/bench_masks_rest.log" python3 scripts/bench_attention.py --only masks --names ranker,full,gqa \
    --out "$d/bench_masks_rest"
  wait
  pack ddp
}

phase_followup() {  # what the 2026-11-30 rounds could not finish (see docs/results/gpu_checks/README.md)
  local f=$WORK/followup
  mkdir -p "$f"
  on_gpu 0 200 "$f/sanitize_threshold.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 scripts/sanitize_kernels.py --family threshold &
  fsdp_smoke 1 200 "$f"
  wait
  # compiled 1 vs 2 GPUs: the 2-GPU compile alone takes ~80 s, hence the longer limit
  ddp_scaling 380 "$f/bench_ddp_compiled" 100
  pack followup
}

phase_profile() {
  local p=$WORK/profile
  mkdir -p "$p"
  on_gpu 1 420 "$p/bench_train_a.log" python3 scripts/bench_train.py --model gpt2_small --batch 16 \
    --variants softmax,softcap_tanh,softcap_softsign,alsc --out "$p/bench_train_a" &
  on_gpu 0 330 "$p/profile.log" python3 scripts/profile_train_step.py \
    --cases sdpa:16:eager,sdpa:16,triton:16,sdpa:32,triton:32 --out "$p/profile_train_step"
  on_gpu 0 220 "$p/bench_train_b.log" python3 scripts/bench_train.py --model gpt2_small --batch 16 \
    --variants threshold,diff_threshold --out "$p/bench_train_b"
  wait
  pack profile
}

phase_confirm() {
  local c=$WORK/confirm
  mkdir -p "$c"
  ddp_scaling 260 "$c/bench_ddp_compiled" 100
  on_gpu 0 250 "$c/bench_train_a.log" python3 scripts/bench_train.py --model gpt2_small --batch 16 \
    --variants softmax,softcap_tanh,softcap_softsign,alsc --out "$c/bench_train_a" &
  fsdp_smoke 1 60 "$c"
  on_gpu 1 100 "$c/bench_train_b.log" python3 scripts/bench_train.py --model gpt2_small --batch 16 \
    --variants threshold,diff_threshold --out "$c/bench_train_b"
  # the 3 softmax-family cases the train phase's memcheck did not reach (cut by its limit)
  on_gpu 1 85 "$c/sanitize_softmax_rest.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 scripts/sanitize_kernels.py --family softmax --from-case 21
  wait
  pack confirm
}

phase_final() {
  local z=$WORK/final
  mkdir -p "$z"
  ddp_scaling 240 "$z/bench_ddp_compiled" 60 +trainer.profiler=simple
  on_gpu 0 150 "$z/bench_train_diff.log" python3 scripts/bench_train.py --model gpt2_small --batch 16 \
    --variants diff_threshold --out "$z/bench_train_diff" &
  fsdp_smoke 1 70 "$z"
  wait
  pack final
}

phase_ddp2() {
  local q=$WORK/ddp2
  mkdir -p "$q"
  nvidia-smi topo -m >"$q/topology.txt" 2>&1
  cat "$q/topology.txt"
  on_gpu 0,1 90 "$q/bench_allreduce.log" env NCCL_DEBUG=INFO python3 scripts/bench_allreduce.py --gpus 2 \
    --out "$q/bench_allreduce"
  grep -E "NCCL version|via|Channel 00" "$q/bench_allreduce.log" | head -n 8
  ddp_scaling 230 "$q/bench_ddp_compiled_model" 60
  ddp_scaling 130 "$q/bench_ddp_compiled_block" 60 --skip-single train.compile_unit=block
  ddp_scaling 130 "$q/bench_ddp_compiled_block_bf16" 60 --skip-single --ddp-trainer ddp_bf16_grads \
    train.compile_unit=block
  pack ddp2
}

phase_ddp3() {
  local q=$WORK/ddp3
  mkdir -p "$q"
  ddp_scaling 230 "$q/bench_ddp_compiled_model" 60
  ddp_scaling 130 "$q/bench_ddp_compiled_block" 60 --skip-single train.compile_unit=block
  fsdp_smoke 0,1 100 "$q"
  pack ddp3
}

phase_ddp4() {
  local q=$WORK/ddp4
  mkdir -p "$q"
  ddp_scaling_kept 280 "$q/bench_ddp_compiled_model"
  fsdp_smoke 0,1 90 "$q"
  raw_ddp 0,1 130 "$q/bench_ddp_raw_2" --settings default,side_stream  # (as run: the two settings it had)
  raw_ddp 0 80 "$q/bench_ddp_raw_1" --settings default
  pack ddp4
}

phase_ddp5() {
  local q=$WORK/ddp5
  mkdir -p "$q"
  fsdp_smoke 0,1 100 "$q"
  # one GPU alone, then two independent one-GPU runs at once (no communication): do the GPUs
  # slow each other down? 400 timed steps (~12 s), so the two timed windows overlap
  raw_ddp 0 90 "$q/raw_solo" --steps 400 --settings default
  raw_ddp 0 90 "$q/raw_pair0" --steps 400 --settings default &
  raw_ddp 1 90 "$q/raw_pair1" --steps 400 --settings default
  wait
  pack ddp5
}

phase_ddp6() {
  local q=$WORK/ddp6
  mkdir -p "$q"
  raw_ddp 0,1 300 "$q/bench_ddp_raw_2" --profile-steps 5 \
    --settings default,no_split,side_stream,bucket_view,eager,default,python_reducer
  raw_ddp 0 110 "$q/bench_ddp_raw_1" --profile-steps 5 &
  on_gpu 1 110 "$q/check_host_syncs.log" python3 scripts/check_host_syncs.py --json "$q/host_syncs.json" \
    experiment=gpu_small model=gpt2_small train.batch_size=16 train.max_steps=14 train.val_every=14 \
    train.val_tokens=16384 train.log_max_logit=false
  wait
  # fewer NCCL channels leave more SMs to the backward's kernels
  NCCL_MAX_NCHANNELS=4 raw_ddp 0,1 90 "$q/bench_ddp_raw_2_nccl4ch" --settings default --profile-steps 5
  pack ddp6
}

phase_ddp7() {
  local q=$WORK/ddp7
  mkdir -p "$q"
  ddp_scaling_kept 280 "$q/bench_ddp_compiled_model"
  raw_ddp 0,1 220 "$q/bench_ddp_raw_2" --profile-steps 5 \
    --settings no_split,no_split_big_buckets,no_split_static_graph,default
  pack ddp7
}

phase_ddp8() {
  local q=$WORK/ddp8
  mkdir -p "$q"
  ddp_scaling_kept 280 "$q/bench_ddp_compiled_model"
  raw_ddp 0,1 80 "$q/bench_ddp_raw_2" --settings no_split_big_buckets
  raw_ddp 0 60 "$q/bench_ddp_raw_1" --settings default
  # the same 2-GPU train.py run with dynamo's graph split back on; with trainer=ddp's 512 MB buckets
  # that is a 2-graph split, not the 25 MB one measured slower (add trainer.strategy.bucket_cap_mb=25)
  ddp_scaling 120 "$q/bench_ddp_split_graph" 60 --skip-single trainer.strategy.split_compiled_graph=true
  pack ddp8
}

phase_ddp9() {
  local q=$WORK/ddp9
  mkdir -p "$q"
  # 200 steps (about 6 s of steady state per run, against 2 s at 60 steps), twice: 1, 2, 1, 2 GPUs
  ddp_scaling 245 "$q/bench_ddp_200_steps_a" 200
  ddp_scaling 245 "$q/bench_ddp_200_steps_b" 200
  pack ddp9
}

phase_fsdp2() {
  local q=$WORK/fsdp2
  mkdir -p "$q"
  fsdp_smoke 0,1 100 "$q"
  pack fsdp2
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ) commit: $ATTNLAB_COMMIT"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$WORK/environment.txt"
case "${1:-}" in
  kernels) phase_kernels ;;
  train) phase_train ;;
  ddp) phase_ddp ;;
  followup) phase_followup ;;
  profile) phase_profile ;;
  confirm) phase_confirm ;;
  final) phase_final ;;
  ddp2) phase_ddp2 ;;
  ddp3) phase_ddp3 ;;
  ddp4) phase_ddp4 ;;
  ddp5) phase_ddp5 ;;
  ddp6) phase_ddp6 ;;
  ddp7) phase_ddp7 ;;
  ddp8) phase_ddp8 ;;
  ddp9) phase_ddp9 ;;
  fsdp2) phase_fsdp2 ;;
  *) sed -n '2,44p' "$0"; exit 2 ;;
esac
stamp "phase ${1} finished"
ls -la "$OUT"
