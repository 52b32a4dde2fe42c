"""Train the same config twice, each in a fresh process, with deterministic=true, and compare the
logged train loss of every step and the final validation loss bit for bit.

--b-overrides gives the second run overrides of its own (e.g. train.cuda_graphs=true: the same
training with and without CUDA graphs), and --rtol a relative tolerance for its losses (0: bitwise).

Fresh processes matter: autotuning by timing could pick another tile per process, which is what
deterministic=true pins (attn.pin_kernel_configs). Prints one line per variant; exits 1 on a
difference. Extra arguments are Hydra overrides for both runs.

    python scripts/gpu_checks/check_train_determinism.py --variants softmax,threshold experiment=gpu_small train.max_steps=40
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eval.run_logs import train_losses  # noqa: E402


def train_once(variant: str, overrides: list[str], run_dir: Path) -> tuple[dict[int, float], float, float]:
    env = {k: v for k, v in os.environ.items() if k != "ATTNLAB_AUTOTUNE" and not k.startswith("ATTNLAB_RUN")}
    # log_every=1: every step's loss is logged, so every step is compared
    args = [sys.executable, str(ROOT / "train.py"), f"attn={variant}", "deterministic=true", "logger=csv",
            "trainer.enable_progress_bar=false", "train.log_every=1", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{variant}: train.py failed:\n{proc.stderr[-3000:]}")
    results = json.loads((run_dir / "results.json").read_text())
    return train_losses(run_dir), results["val_loss"], results["tokens_per_s"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="softmax,softcap_tanh,threshold,diff_threshold,sigmoid")
    ap.add_argument("--json", default=None, help="write the per-variant verdicts here")
    ap.add_argument("--b-overrides", nargs="*", default=[], help="overrides of the second run only")
    ap.add_argument("--rtol", type=float, default=0.0, help="relative tolerance of the second run's losses")
    args, overrides = ap.parse_known_args()
    verdicts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            a, val_a, tps_a = train_once(variant, overrides, Path(tmp) / f"{variant}_0")
            b, val_b, tps_b = train_once(variant, overrides + args.b_overrides, Path(tmp) / f"{variant}_1")
            same = a == b and val_a == val_b
            first = next((s for s in sorted(a) if a[s] != b.get(s)), None)
            rel = max([abs(a[s] - b[s]) / abs(a[s]) for s in a if s in b] + [abs(val_a - val_b) / abs(val_a)])
            ok = a.keys() == b.keys() and (same or rel <= args.rtol)
            verdicts[variant] = {"bitwise_equal": same, "max_relative_difference": rel, "within_rtol": ok,
                                 "steps": len(a), "val_loss": [val_a, val_b], "tokens_per_s": [tps_a, tps_b],
                                 "first_differing_step": first}
            print(f"{variant:16} {'bitwise equal' if same else 'DIFFERENT'}: {len(a)} logged train losses, "
                  f"val loss {val_a!r} / {val_b!r}, max relative difference {rel:.2e} (rtol {args.rtol})"
                  + ("" if first is None else f", first difference at step {first}"), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"overrides": overrides, "b_overrides": args.b_overrides,
                                               "rtol": args.rtol, "variants": verdicts}, indent=1))
    return 0 if all(v["within_rtol"] for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
