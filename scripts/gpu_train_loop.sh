#!/usr/bin/env bash
# train.py against a plain PyTorch loop of the same model, and where the loop's host time goes; one
# device call (one H200, about 10 minutes for all phases), results in $OUT:
#   1. the captured step (train.cuda_graphs=step) on the GPU: replays equal eager steps, dropout
#      masks fresh per replay (check_captured_step_gpu.py)
#   2. the captured step against the eager step, deterministic=true, 100 steps: bitwise equal losses
#   3. host time per Lightning hook, and cProfile's Python functions over 10 steady steps
#      (profile_train_loop.py)
#   4. model `small` (6x384, ctx 512, BPE 2048, batch 32) and the 10.6M char-level size (ctx 256,
#      batch 64, char vocab 85): SDPA and tanh, the plain loop against train.py with the captured
#      step (bench_train.py --train-py --cuda-graphs)
# Call (from the repo root, on the device tool; `bash scripts/run_ablation.sh prepare` makes .whl and
# the BPE cache, one char-level train.py run with ATTNLAB_CACHE_DIR=.device_cache/attnlab the char cache):
#   run(command="ATTNLAB_COMMIT=<sha> bash scripts/gpu_train_loop.sh [PHASE...]",
#       carry=[".whl", ".device_cache/attnlab/tokens", ".device_cache/attnlab/tokenizers"])
# PHASE is any of captured_step determinism profile small char (default: all, in that order).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device_env.sh
mkdir -p "$OUT/logs"
phases=" ${*:-captured_step determinism profile small char} "
want() { [[ $phases == *" $1 "* ]]; }
# correctness checks run the first tile config of each kernel (no timing of candidates)
if want captured_step; then
  ATTNLAB_AUTOTUNE=0 timeout 240 python3 scripts/check_captured_step_gpu.py > $OUT/logs/captured_step_check.log 2>&1; st captured_step
fi
if want determinism; then
  timeout 200 python3 scripts/check_train_determinism.py --variants softcap_tanh --json $OUT/determinism_step_vs_false.json \
    experiment=gpu_small train.max_steps=100 train.val_every=100 --b-overrides train.cuda_graphs=false \
    > $OUT/logs/determinism.log 2>&1; st determinism
fi
if want profile; then
  timeout 110 python3 scripts/profile_train_loop.py --python-steps 60:70 --no-sync-census experiment=gpu_small attn=softcap_tanh \
    train.max_steps=100 train.val_every=100 train.log_max_logit=false logger=csv trainer.enable_progress_bar=false \
    hydra.run.dir=/tmp/profile_run > $OUT/logs/profile_train_loop.log 2>&1; st profile
fi
if want small; then
  timeout 200 python3 scripts/bench_train.py --model small --vocab 2048 --batch 32 --steps 30 --variants softcap_tanh --cuda-graphs \
    --no-default --train-py --train-py-steps 100 --out $OUT/bench_train_small > $OUT/logs/bench_train_small.log 2>&1; st small
fi
left=$(( 560 - ($(date +%s) - T0) ))
if want char; then
  timeout $left python3 scripts/bench_train.py --model small --vocab 85 --context 256 --batch 64 --steps 30 --variants softcap_tanh \
    --cuda-graphs --no-default --train-py --train-py-steps 100 --train-py-overrides data/tokenizer=char \
    --out $OUT/bench_train_char > $OUT/logs/bench_train_char.log 2>&1; st char
fi
grep -hE "^(ok|FAIL)" $OUT/logs/captured_step_check.log 2>/dev/null; tail -1 $OUT/logs/determinism.log 2>/dev/null
grep -A16 "host time per action" $OUT/logs/profile_train_loop.log
cat $OUT/bench_train_small.md $OUT/bench_train_char.md 2>/dev/null | grep -E "^\| (softmax|softcap)"
(cd $OUT && tar czf logs.tgz logs && rm -rf logs)
