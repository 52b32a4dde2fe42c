"""Train the same config twice, each in a fresh process, with deterministic=true, and compare the
logged train loss of every step and the final validation loss bit for bit.

Fresh processes matter: autotuning by timing could pick another tile per process, which is what
deterministic=true pins (attn.pin_kernel_configs). Prints one line per variant; exits 1 on a
difference. Extra arguments are Hydra overrides for both runs.

    python scripts/check_train_determinism.py --variants softmax,threshold experiment=gpu_small train.max_steps=40
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.run_logs import train_losses  # noqa: E402


def train_once(variant: str, overrides: list[str], run_dir: Path) -> tuple[dict[int, float], float]:
    env = {k: v for k, v in os.environ.items() if k != "ATTNLAB_AUTOTUNE" and not k.startswith("ATTNLAB_RUN")}
    # log_every=1: every step's loss is logged, so every step is compared
    args = [sys.executable, str(ROOT / "train.py"), f"attn={variant}", "deterministic=true", "logger=csv",
            "trainer.enable_progress_bar=false", "train.log_every=1", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{variant}: train.py failed:\n{proc.stderr[-3000:]}")
    return train_losses(run_dir), json.loads((run_dir / "results.json").read_text())["val_loss"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="softmax,softcap_tanh,threshold,diff_threshold")
    ap.add_argument("--json", default=None, help="write the per-variant verdicts here")
    args, overrides = ap.parse_known_args()
    verdicts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            (a, val_a), (b, val_b) = (train_once(variant, overrides, Path(tmp) / f"{variant}_{i}") for i in (0, 1))
            same = a == b and val_a == val_b
            first = next((s for s in sorted(a) if a[s] != b.get(s)), None)
            verdicts[variant] = {"bitwise_equal": same, "steps": len(a), "val_loss": [val_a, val_b],
                                 "first_differing_step": first}
            print(f"{variant:16} {'bitwise equal' if same else 'DIFFERENT'}: {len(a)} logged train losses, "
                  f"val loss {val_a!r} / {val_b!r}" + ("" if first is None else f", first difference at step {first}"),
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"overrides": overrides, "variants": verdicts}, indent=1))
    return 0 if all(v["bitwise_equal"] for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
