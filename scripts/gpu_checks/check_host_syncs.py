"""Find every host-device synchronization inside train.py's training steps on one GPU.

A sync makes the host wait for the GPU, so it can no longer queue the next kernels ahead of it;
the steady-state step should have none. This runs train.py's own `run` in this process with
PyTorch's CUDA sync debug mode ("warn") switched on from LitGPT's on_train_batch_start to the end
of Lightning's own batch-end bookkeeping (which reads the progress-bar values back): the forward,
backward, optimizer step and every batch-end hook, not the batch's transfer to the GPU. It watches every step from (0-based) step `--after-step` on whose
logs Lightning does not write (log writes read values back on purpose), except the last. Each
warning is reported with the innermost frame of this repository (outside installed packages) or of
Lightning that caused it. Exits 1 if any sync was found, 2 if no step was watched.

    python scripts/gpu_checks/check_host_syncs.py experiment=gpu_small train.max_steps=12 train.compile=true
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from training import train  # noqa: E402
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector  # noqa: E402

from models.lit import LitGPT, writes_logs  # noqa: E402

SYNC_WARNING = "synchronizing"  # PyTorch's text: "called a synchronizing CUDA operation"


def culprit() -> str:
    """The innermost frame of this repo or Lightning (outside this script) on the current stack."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename
        if path == __file__:
            continue
        if (path.startswith(str(ROOT)) and "site-packages" not in path) or "/lightning/" in path:
            return f"{Path(path).name}:{frame.lineno} {frame.line}"
    return "unknown"


def set_sync_debug(on: bool) -> None:
    if torch.cuda.is_available():  # without a GPU the check has nothing to watch (a dry run)
        torch.cuda.set_sync_debug_mode("warn" if on else "default")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--after-step", type=int, default=3, help="skip the first steps (compile, autotune)")
    ap.add_argument("--json", default=None, help="write the findings here")
    args, overrides = ap.parse_known_args()
    found: collections.Counter[str] = collections.Counter()
    watched: list[int] = []
    real_start, real_batch_end = LitGPT.on_train_batch_start, _LoggerConnector.on_batch_end

    def on_train_batch_start(self, batch, batch_idx):
        real_start(self, batch, batch_idx)
        last = self.global_step + 1 >= self.trainer.max_steps  # its end writes logs and validates
        if self.global_step >= args.after_step and not last and not writes_logs(self.trainer):
            watched.append(self.global_step)
            set_sync_debug(True)

    def on_batch_end(self):  # Lightning's after the batch-end hooks: it reads the progress-bar values
        real_batch_end(self)
        set_sync_debug(False)

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING in str(message):
            found[culprit()] += 1
        else:
            show_other(message, category, filename, lineno, file, line)

    LitGPT.on_train_batch_start, _LoggerConnector.on_batch_end = on_train_batch_start, on_batch_end
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("always")
        show_other, warnings.showwarning = warnings.showwarning, record
        if torch.cuda.is_available():  # the probe must see a known sync, or its silence means nothing
            set_sync_debug(True)
            torch.ones(1, device="cuda").item()
            set_sync_debug(False)
            if not found:
                raise SystemExit("CUDA sync debug warnings did not reach the recorder; the check cannot work")
            found.clear()
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("train", overrides=["logger=csv", "trainer.enable_progress_bar=false", *overrides,
                                              f"paths.output_dir={tmp}"])
        train.run(cfg)
    print(f"watched steps: {watched}")
    print(f"host syncs inside them: {sum(found.values())}")
    for where, count in found.most_common():
        print(f"{count:5d}  {where}")
    if args.json:
        Path(args.json).write_text(json.dumps({"overrides": overrides, "watched_steps": watched,
                                               "syncs": dict(found.most_common())}, indent=1))
    if not watched:  # silence over no step is no evidence
        print("no step was watched (too few steps, or every step writes logs): nothing was checked")
        return 2
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
