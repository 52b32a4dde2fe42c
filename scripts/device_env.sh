# Sourced by the one-call GPU scripts (run from the repo root on the device machine): $OUT, the
# token cache, hydra from the carried wheels, and `st` to print elapsed seconds after a step.
OUT=${OUT:-$PWD/gpu_out}
export ATTNLAB_COMMIT=${ATTNLAB_COMMIT:-unknown} PYTHONUNBUFFERED=1 WANDB_MODE=offline ATTNLAB_CACHE_DIR=$PWD/.device_cache/attnlab
T0=$(date +%s)
mkdir -p "$OUT"
if ! python3 -c "import hydra" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site
st() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
