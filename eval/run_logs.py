"""Reading a finished run's CSV log (`<run dir>/csv/metrics.csv`, written by logger=csv)."""

from __future__ import annotations

import csv
from pathlib import Path


def metric_by_step(run_dir: Path, name: str) -> dict[int, float]:
    """Global step -> value of one logged metric, for the rows that hold it (ascending steps; a
    step logged twice keeps its last value)."""
    with open(Path(run_dir) / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


def train_losses(run_dir: Path) -> dict[int, float]:
    """Global step -> logged training loss."""
    return metric_by_step(run_dir, "train/loss")
