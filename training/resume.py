"""Which checkpoint a run resumes from, and what it recorded about the run (wandb run id, tokenizer)."""

from __future__ import annotations

import logging
from pathlib import Path

from data.tokenizers import Tokenizer, tokenizer_from_record
from training.checkpoint_io import load_checkpoint

log = logging.getLogger("attnlab.train")


def resume_checkpoint(ckpt_path: str | None, output_dir: Path) -> str | None:
    """The checkpoint to resume from: `ckpt_path` itself, or with `ckpt_path=auto` the run
    directory's own checkpoints/last.ckpt when there is one (a fresh start when not): the same
    command restarts a preempted run where it stopped (SLURM --requeue, with a fixed hydra.run.dir)."""
    if ckpt_path != "auto":
        return ckpt_path
    last = output_dir / "checkpoints" / "last.ckpt"
    if last.is_file():
        log.info("ckpt_path=auto: resuming from %s", last)
        return str(last)
    log.info("ckpt_path=auto: no %s yet, starting fresh", last)
    return None


def resumed_state(ckpt_path: str | None) -> tuple[str | None, Tokenizer | None]:
    """(wandb run id, tokenizer) recorded in the checkpoint a run resumes from; (None, None) for a
    fresh start, None for what a checkpoint does not record."""
    if not ckpt_path:
        return None, None
    checkpoint = load_checkpoint(ckpt_path)
    record = checkpoint.get("tokenizer")
    tokenizer = tokenizer_from_record(record, f"checkpoint {ckpt_path}") if record is not None else None
    return checkpoint.get("wandb_run_id"), tokenizer
