"""Data-parallel scaling of train.py: the same config on 1 GPU (trainer=gpu) and on N GPUs
(trainer=ddp, or --ddp-trainer), same per-GPU batch, steady-state tokens/s from each run's
results.json. --skip-single runs the N-GPU side only; --runs-dir keeps both runs' directories.

Extra arguments are Hydra overrides for both runs. Writes OUT.md / OUT.json.

    python scripts/bench/bench_ddp.py --gpus 2 --out gpu_out/bench_ddp experiment=gpu_small model=gpt2_small \
        train.batch_size=16 train.max_steps=100 train.val_every=100 train.val_tokens=65536
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def train(overrides: list[str], run_dir: Path, log_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLAB_RUN") and k != "ATTNLAB_JOB_OVERRIDES"}
    args = [sys.executable, str(ROOT / "train.py"), "logger=csv", "trainer.enable_progress_bar=false",
            *overrides, f"hydra.run.dir={run_dir}"]
    t0 = time.time()
    with open(log_path, "w") as log:
        # its own process group: a time limit that stops this script must also stop the ranks
        # Lightning starts, or they keep the GPUs busy under the next measurement
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode:
        raise RuntimeError(f"train.py failed ({' '.join(overrides)}), see {log_path}")
    results = json.loads((run_dir / "results.json").read_text())
    results["wall_s"] = time.time() - t0
    return results


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally above on `timeout`
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--out", default="gpu_out/bench_ddp", help="writes OUT.md, OUT.json (docs/results/ is curated by hand)")
    ap.add_argument("--skip-single", action="store_true",
                    help="only the N-GPU run (compare with a 1-GPU row from another invocation)")
    ap.add_argument("--ddp-trainer", default="ddp", help="trainer config of the N-GPU run (e.g. ddp_bf16_grads)")
    ap.add_argument("--runs-dir", default=None, help="keep both runs' directories here (default: a temp dir)")
    args, overrides = ap.parse_known_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with contextlib.nullcontext(args.runs_dir) if args.runs_dir else tempfile.TemporaryDirectory() as tmp:
        for gpus in (args.gpus,) if args.skip_single else (1, args.gpus):
            trainer = ["trainer=gpu"] if gpus == 1 else [f"trainer={args.ddp_trainer}", f"trainer.devices={gpus}"]
            r = train(trainer + overrides, Path(tmp) / f"gpus{gpus}", out.parent / f"{out.name}_gpus{gpus}.log")
            rows.append({"gpus": gpus, **{k: r.get(k) for k in ("tokens_per_s", "mfu", "peak_memory_gb", "steps",
                                                               "tokens", "val_loss", "wall_s")}})
            print(rows[-1], flush=True)
    import torch
    from timing import git_commit

    speedup = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"] if len(rows) == 2 else None
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": git_commit(), "overrides": overrides,
            "ddp_trainer": args.ddp_trainer}
    title = f"{args.gpus} GPUs" if args.skip_single else f"1 vs {args.gpus} GPUs"
    lines = [f"# Data-parallel scaling of train.py: {title}, same per-GPU batch", "",
             f"{meta['date']} | {meta['gpu']} | torch {meta['torch']} | commit {meta['commit']}", "",
             f"overrides: `{' '.join(overrides)}`; N-GPU run: `trainer={args.ddp_trainer}`", "",
             "| GPUs | tokens/s (all GPUs) | MFU (per GPU) | peak mem GiB | steps | final val loss |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        lines.append(f"| {r['gpus']} | {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_memory_gb']:.1f} | {r['steps']} | "
                     f"{r['val_loss']:.4f} |")
    if speedup:
        lines += ["", f"speed-up {args.gpus} GPUs / 1 GPU: **{speedup:.2f}x** (target >= {0.9 * args.gpus:.1f}x)"]
    table = "\n".join(lines)
    print(table)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "speedup": speedup}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
