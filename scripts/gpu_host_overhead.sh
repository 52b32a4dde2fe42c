#!/usr/bin/env bash
# The host-overhead measurements and the kernels' non-finite check in one device call (one H200, about 9
# minutes), results in $OUT:
#   1. direct launches bitwise equal to Triton's JIT (scripts/check_direct_launch_gpu.py, two mask kinds)
#   2. 100 train.py steps with and without train.cuda_graphs, losses compared (check_train_determinism.py)
#   3. model `small`: plain PyTorch loop vs train.py, SDPA and our softmax kernel (bench_train.py --train-py)
#   4. one attention call at (16,12,1024,64): eager, compiled, kernel and host time (bench_attention_call.py)
#   5. non-finite inputs propagate through the kernels as through the reference (check_nonfinite_gpu.py)
# Call (from the repo root, on the device tool; `bash scripts/run_ablation.sh prepare` makes .whl and the cache):
#   run(command="ATTNLAB_COMMIT=<sha> bash scripts/gpu_host_overhead.sh", carry=[".whl", ".device_cache"])
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device_env.sh
ATTNLAB_AUTOTUNE=0 timeout 120 python3 scripts/check_nonfinite_gpu.py > $OUT/nonfinite_check.log 2>&1; st nonfinite
timeout 70 python3 scripts/check_direct_launch_gpu.py --masks causal,ranker --json $OUT/direct_launch.json > $OUT/direct_launch.log 2>&1; st direct
timeout 150 python3 scripts/check_train_determinism.py --variants softmax --b-overrides train.cuda_graphs=true --rtol 0.01 --json $OUT/cuda_graphs_check.json experiment=gpu_small train.max_steps=100 train.val_every=100 train.compile=true train.log_max_logit=false > $OUT/cuda_graphs_check.log 2>&1; st graphs
timeout 200 python3 scripts/bench_train.py --model small --vocab 2048 --batch 32 --steps 30 --variants softmax --train-py --train-py-steps 80 --out $OUT/bench_train_small_trainpy > $OUT/bench_train_small_trainpy.log 2>&1; st train
left=$(( 545 - ($(date +%s) - T0) ))
timeout $left python3 scripts/bench_attention_call.py --out $OUT/attention_call > $OUT/attention_call.log 2>&1; st call
grep -E "FAIL|all pass|failed" $OUT/nonfinite_check.log; grep -E "^(ok|FAIL)|passed" $OUT/direct_launch.log | tail -n 14; grep -v Warn $OUT/cuda_graphs_check.log | tail -n 5; cat $OUT/bench_train_small_trainpy.md; tail -n 10 $OUT/attention_call.md
