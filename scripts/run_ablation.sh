#!/usr/bin/env bash
# The attention ablation end to end: train variants x seeds (configs/experiment/ablation.yaml, or the
# experiment ABLATION_EXPERIMENT names, e.g. tda_parity), each run evaluated in its training process
# (the experiment's `evaluate`: perplexity at 1x/2x/4x context on the test split, attention statistics
# on validation tokens), then the report.
#
#   scripts/run_ablation.sh prepare                 # here, with network: wheels + token cache to carry
#   scripts/run_ablation.sh device [OVERRIDES...]   # on the GPU machine: everything, packed into $OUT
#   scripts/run_ablation.sh report FETCHED_DIR [OUT_DIR [REPORT_ARGS...]]   # here: report from what came back
#                      (REPORT_ARGS go to scripts/analysis/ablation_report.py, e.g. --margin 0.02 --preface reading.md)
#
# Device call (the `run` tool; the machine has torch/lightning/matplotlib but no hydra, no network):
#   run(command="bash scripts/run_ablation.sh device", carry=[".whl", ".device_cache/attnlab"], timeout_s=600)
# Extra Hydra overrides go after `device`, e.g. `train.max_steps=300 +evaluate.perplexity.max_tokens=100000`.
# Layout: one train.py process per variant, its seeds one after the other (imports, CUDA context and
# kernel compiles paid once per variant), every variant's process at once on the GPU; each run's
# forward, loss and backward replay as one captured CUDA graph (train.cuda_graphs=step) with pinned
# kernel configs (ATTNLAB_AUTOTUNE=0: no timing of candidates while the processes share the GPU).
# Environment knobs:
#   ABLATION_EXPERIMENT  the experiment config (default ablation; its ablation.variants / seeds are the defaults)
#   ABLATION_VARIANTS  comma list (default: the experiment's)   ABLATION_SEEDS  comma list (default: the experiment's)
#   ABLATION_PARALLEL  variant processes at once (default: all; 1 gives clean throughput numbers)
#   ABLATION_TRAIN_BUDGET_S  wall seconds of training (default 420), so the report and the packing still
#                      fit in one 600 s call: every run still going then stops (train.stop_at_time: it
#                      reports, with the tokens it reached); a process still going 60 s later is killed
#   ABLATION_SWEEP     sweep folder (default multirun/ablation/device: a second call on the same warm
#                      machine, e.g. ABLATION_SEEDS=2, adds runs to it and the report covers all)
#   ABLATION_OVERRIDES_<variant>  Hydra overrides for one variant only (e.g. ABLATION_OVERRIDES_alsc="attn.params.cap=10";
#                      a swept one, "attn.lambda_mode=scalar_clamp,reparam", gives one report row per setting)
#   ABLATION_COMMIT    the commit to record (else ATTNLAB_COMMIT; the device's copy of .git can be stale)
#   ATTNLAB_AUTOTUNE   1 times every kernel's candidate configs (default here 0: pinned)
#   PYTHON             interpreter (default python3)
# A run stopped by the budget gets no results.json and is left out of the report (it lists the runs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
WHEELS=${ABLATION_WHEELS:-.whl}
CACHE=${ABLATION_CACHE:-$ROOT/.device_cache/attnlab}
# the sweep's defaults, read from the experiment config (one source of truth)
EXPERIMENT=${ABLATION_EXPERIMENT:-ablation}
[ -f "configs/experiment/$EXPERIMENT.yaml" ] || { echo "ABLATION_EXPERIMENT: no configs/experiment/$EXPERIMENT.yaml"; exit 2; }
ALL_VARIANTS=$(awk '$1 == "variants:" {print $2; exit}' "configs/experiment/$EXPERIMENT.yaml")
ALL_SEEDS=$(awk '$1 == "seeds:" {print $2; exit}' "configs/experiment/$EXPERIMENT.yaml")

prepare() {
  # 1) wheels the GPU image lacks (hydra and its two dependencies), the versions this venv uses
  mkdir -p "$WHEELS"
  for pkg in hydra-core omegaconf antlr4-python3-runtime; do
    version=$($PYTHON -m pip show "$pkg" 2>/dev/null | awk '/^Version:/{print $2}')
    [ -n "$version" ] || { echo "install $pkg here first (pip install -e .)"; exit 1; }
    stem=$(echo "$pkg" | tr - _)
    if ls "$WHEELS"/${stem}-${version}-*.whl >/dev/null 2>&1; then continue; fi
    # antlr4-python3-runtime is published as an sdist only: build its (pure Python) wheel here
    $PYTHON -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$pkg==$version"
  done
  # 2) the ablation corpus tokenized once (tokenizer + token shards; the device cannot download it)
  EXPERIMENT=$EXPERIMENT ATTNLAB_CACHE_DIR=$CACHE $PYTHON - <<'EOF'
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
import os

with initialize_config_dir(config_dir=os.path.abspath("configs"), version_base="1.3"):
    cfg = compose("train", overrides=[f"experiment={os.environ['EXPERIMENT']}", "paths.output_dir=/tmp/unused"])
dm = instantiate(cfg.data)
dm.prepare_data()
dm.setup("fit")
print("token cache:", dm.cache_path, {s: dm.split_stats(s) for s in ("train", "val", "test")})
EOF
  # only the tokenizer and the token shards need to travel (the source texts are not read once
  # tokenized); trimmed only in the script's own cache folder, never in one passed by ABLATION_CACHE
  if [ -z "${ABLATION_CACHE:-}" ]; then rm -rf "$CACHE/sources" "$CACHE/hf_datasets"; fi
  du -sh "$WHEELS" "$CACHE"
  echo "carry: $WHEELS and ${CACHE#"$ROOT"/} (keep both ignored: .git/info/exclude or .gitignore)"
}

pack() {
  # one archive of everything but checkpoints (at most 8 files come back from $OUT)
  local out=$1 sweep=$2
  (
    command -v flock >/dev/null && flock 9
    # exit status 1 only says a file changed while read (another chain still writing): keep the archive
    tar czf "$out/.ablation.tar.gz.tmp" --exclude='*.ckpt' -C "$(dirname "$sweep")" "$(basename "$sweep")" \
      || [ $? -eq 1 ]
    mv "$out/.ablation.tar.gz.tmp" "$out/ablation.tar.gz"
  ) 9>"$out/.pack.lock"
}

device() {
  local out=${OUT:-$ROOT/ablation_out}
  mkdir -p "$out"
  local sweep=${ABLATION_SWEEP:-$ROOT/multirun/$EXPERIMENT/device}
  mkdir -p "$sweep/logs"
  local log=$sweep/logs
  export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} ATTNLAB_CACHE_DIR=$CACHE WANDB_MODE=offline
  export ATTNLAB_AUTOTUNE=${ATTNLAB_AUTOTUNE:-0}
  if ! $PYTHON -c "import hydra" 2>/dev/null; then
    $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    # the device copy of the tree may have no .git: ABLATION_COMMIT=<hash> names the commit then
    echo "commit: ${ABLATION_COMMIT:-${ATTNLAB_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}}"
    echo "command: ABLATION_EXPERIMENT=$EXPERIMENT scripts/run_ablation.sh device $*"
    echo "variants: ${ABLATION_VARIANTS:-$ALL_VARIANTS} seeds: ${ABLATION_SEEDS:-$ALL_SEEDS} parallel: ${ABLATION_PARALLEL:-all} ATTNLAB_AUTOTUNE=$ATTNLAB_AUTOTUNE"
    env | grep '^ABLATION_OVERRIDES_' | sort || true
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    $PYTHON -c "import sys, torch, triton, lightning, hydra; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'lightning', lightning.__version__, 'hydra', hydra.__version__)"
  } | tee "$sweep/environment.txt"

  local budget=${ABLATION_TRAIN_BUDGET_S:-420}
  local seeds=${ABLATION_SEEDS:-$ALL_SEEDS}
  local deadline=$(( $(date +%s) + budget ))
  elapsed() { echo $(( $(date +%s) - deadline + budget )); }  # seconds since the sweep started
  chain() {
    # one process: the variant's seeds in turn, each trained, checkpointed and evaluated
    local v=$1 left=$(( deadline - $(date +%s) ))
    [ "$left" -gt 10 ] || { echo "[$v] no time left"; return; }
    # train.stop_at_time ends a run still going at the deadline like a finished one (results.json
    # with the tokens it reached; a run starting after it is not started); SIGTERM 60 s later stops
    # a process still going (no results.json for its run)
    # per-variant overrides from the environment, e.g. ABLATION_OVERRIDES_alsc="attn.params.cap=10"
    local own="ABLATION_OVERRIDES_$v"
    echo "[$v] started at +$(elapsed)s"
    timeout -s TERM "$(( left + 60 ))" $PYTHON train.py "experiment=$EXPERIMENT" "attn=$v" "seed=$seeds" logger=csv \
      "hydra.sweep.dir=$sweep" trainer.enable_progress_bar=false train.cuda_graphs=step \
      "train.stop_at_time=$deadline" \
      "${extra[@]}" ${!own:-} >"$log/train_$v.log" 2>&1 \
      || echo "[$v] ended early (exit $?), see logs/train_$v.log"
    pack "$out" "$sweep"
    echo "[$v] trained and evaluated at +$(elapsed)s"
  }
  local extra=("$@")
  local parallel=${ABLATION_PARALLEL:-0}
  IFS=, read -r -a variants <<<"${ABLATION_VARIANTS:-$ALL_VARIANTS}"
  for v in "${variants[@]}"; do
    while [ "$parallel" -gt 0 ] && [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n || true; done
    chain "$v" &
  done
  wait || true
  echo "every run trained and evaluated at +$(elapsed)s"
  $PYTHON scripts/analysis/ablation_report.py "$sweep" --out "$sweep/report" >"$log/report.log" 2>&1 \
    || echo "report failed, see logs/report.log"
  echo "ablation wall time (runs, evaluations, report): $(elapsed)s" | tee -a "$sweep/environment.txt"
  pack "$out" "$sweep"
  cp "$sweep/environment.txt" "$out/"
  [ -f "$sweep/report/report.md" ] && cp "$sweep/report/report.md" "$out/"
  rm -f "$out/.pack.lock"
  ls -la "$out"
  tail -n 40 "$sweep/report/report.md" 2>/dev/null || true
}

report() {
  local fetched=${1:?usage: scripts/run_ablation.sh report FETCHED_DIR [OUT_DIR [REPORT_ARGS...]]}
  local dest=${2:-docs/results/ablation}
  shift $(( $# < 2 ? $# : 2 ))
  local unpack=$ROOT/multirun/ablation-fetched
  rm -rf "$unpack" && mkdir -p "$unpack"
  tar xzf "$fetched/ablation.tar.gz" -C "$unpack"
  local sweep
  sweep=$(find "$unpack" -mindepth 1 -maxdepth 1 -type d | head -n 1)
  # heatmaps are re-drawn here from the JSONs (the device may have had no matplotlib)
  $PYTHON - "$sweep" <<'EOF'
import json, sys
from pathlib import Path
from eval.attention_stats import plot_heatmaps
# eval/, or checkpoints/ in runs evaluated by an attnlab that wrote eval results there
for path in sorted([*Path(sys.argv[1]).glob("*/eval/*.attention-*.json"),
                    *Path(sys.argv[1]).glob("*/checkpoints/*.attention-*.json")]):
    result = json.loads(path.read_text())
    label = f"{result['model']['variant']} s{result['model']['seed']}"
    plot_heatmaps(result["metrics"], label, path.with_suffix(""))
EOF
  mkdir -p "$dest"
  $PYTHON scripts/analysis/ablation_report.py "$sweep" --out "$dest" "$@"
  cp "$sweep/environment.txt" "$dest/" 2>/dev/null || true
  echo "report made here at commit $(git rev-parse HEAD 2>/dev/null || echo unknown), $(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$dest/environment.txt"
  echo "report: $dest/report.md (runs unpacked in $sweep)"
}

cmd=${1:-}
shift || true
case "$cmd" in
  prepare) prepare ;;
  device) device "$@" ;;
  report) report "$@" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
