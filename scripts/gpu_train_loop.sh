#!/usr/bin/env bash
# train.py against a plain PyTorch loop of the same model, with and without CUDA graphs, and where
# the loop's host time goes; one device call (one H200, about 9 minutes), results in $OUT:
#   1. non-finite inputs propagate through the kernels as through the reference (check_nonfinite_gpu.py)
#   2. host time per Lightning hook and every host-device sync of a train.py run (profile_train_loop.py)
#   3. model `small` (6x384, ctx 512, BPE 2048, batch 32): SDPA and tanh, plain loop and train.py,
#      with and without train.cuda_graphs (bench_train.py --train-py --cuda-graphs)
#   4. the 10.6M char-level size (ctx 256, batch 64, char vocab 85): the same without CUDA graphs
# Call (from the repo root, on the device tool; `bash scripts/run_ablation.sh prepare` makes .whl and
# the BPE cache, one char-level train.py run with ATTNLAB_CACHE_DIR=.device_cache/attnlab the char cache):
#   run(command="ATTNLAB_COMMIT=<sha> bash scripts/gpu_train_loop.sh", carry=[".whl", ".device_cache"])
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device_env.sh
mkdir -p "$OUT/logs"
# a correctness check: the first tile config of each kernel (no timing of candidates)
ATTNLAB_AUTOTUNE=0 timeout 120 python3 scripts/check_nonfinite_gpu.py > $OUT/logs/nonfinite_check.log 2>&1; st nonfinite
timeout 90 python3 scripts/profile_train_loop.py experiment=gpu_small attn=softcap_tanh train.max_steps=100 train.val_every=100 \
  train.log_max_logit=false logger=csv trainer.enable_progress_bar=false hydra.run.dir=/tmp/profile_run > $OUT/logs/profile_train_loop.log 2>&1; st profile
timeout 270 python3 scripts/bench_train.py --model small --vocab 2048 --batch 32 --steps 30 --variants softcap_tanh --cuda-graphs \
  --train-py --train-py-steps 100 --out $OUT/bench_train_small > $OUT/logs/bench_train_small.log 2>&1; st small
left=$(( 560 - ($(date +%s) - T0) ))
timeout $left python3 scripts/bench_train.py --model small --vocab 85 --context 256 --batch 64 --steps 30 --variants softcap_tanh \
  --train-py --train-py-steps 100 --train-py-overrides data/tokenizer=char \
  --out $OUT/bench_train_char > $OUT/logs/bench_train_char.log 2>&1; st char
grep -E "FAIL|all pass|failed" $OUT/logs/nonfinite_check.log
grep -A14 "host time per action" $OUT/logs/profile_train_loop.log; grep -A12 "host-device syncs" $OUT/logs/profile_train_loop.log
cat $OUT/bench_train_small.md $OUT/bench_train_char.md 2>/dev/null
(cd $OUT && tar czf logs.tgz logs && rm -rf logs)
