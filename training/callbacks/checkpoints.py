"""Checkpoints a run writes besides the validation's ModelCheckpoint (configs/callbacks/): last.ckpt
every N steps, a checkpoint at SIGTERM, the logs on disk with every checkpoint, and the wandb run id
inside every checkpoint, so that a resumed run continues the same wandb run (docs/reliability.md)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException


class LastCheckpointEveryNSteps(L.Callback):
    """Refreshes `path` (checkpoints/last.ckpt, which the validation's ModelCheckpoint also writes)
    every `every` optimizer steps, except at validation steps: there the validation's own write
    follows, and a write before it would make a kill during that validation lose it on resume.
    One last.ckpt, always the newest (two ModelCheckpoints saving "last" would make one last-v1.ckpt).
    `every` null (train.ckpt_every_steps): at validations only; configs/callbacks/ leaves it out."""

    def __init__(self, path: str | Path, every: int | None, val_every: int):
        self.path, self.every, self.val_every = Path(path), every, val_every
        self.enabled = every is not None
        self._saved_step = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step  # optimizer steps: micro-batches of one step see the same value
        if step % self.every or step % self.val_every == 0 or step == self._saved_step:
            return
        if step == trainer.max_steps:  # the last step validates (ValidateAtLastStep), which writes it
            return
        trainer.save_checkpoint(str(self.path))
        self._saved_step = step


# exit status of a run stopped by SIGTERM after its checkpoint (128 + SIGTERM, as a shell reports it)
PREEMPTED_EXIT_CODE = 143


class CheckpointOnSigterm(L.Callback):
    """SIGTERM (SLURM preemption, scancel, a container stop): Lightning finishes the current training
    step and stops; this writes `path` (checkpoints/last.ckpt) at that step boundary, so
    `ckpt_path=<it>` resumes from there, and train.py exits with status 143."""

    def __init__(self, path: Path):
        self.path = path
        self.saved_step: int | None = None
        self._checkpointed_step: int | None = None  # the step of the latest checkpoint written

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._checkpointed_step = trainer.global_step

    def on_exception(self, trainer, pl_module, exception):
        if isinstance(exception, SIGTERMException):
            # a signal during the step whose validation already checkpointed (last.ckpt included)
            # keeps that checkpoint: one written from inside the validation's hooks would resume
            # with the step's loop state half done
            if not (self._checkpointed_step == trainer.global_step and self.path.is_file()):
                trainer.save_checkpoint(str(self.path))
            self.saved_step = trainer.global_step


class LogsOnDiskWithCheckpoints(L.Callback):
    """Everything logged up to a checkpoint is on disk with it: the log step LitGPT defers to the next
    batch end is written and the loggers are flushed (Lightning's CSV logger writes its file every 100
    steps only), so a kill loses no row of the steps a resume will not run again."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        pl_module.write_log_step(progress_bar=False)
        for logger in trainer.loggers:
            logger.save()


class WandbRunIdInCheckpoint(L.Callback):
    """A resumed run continues the same wandb run."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        for lg in trainer.loggers:
            if lg.__class__.__name__ == "WandbLogger":
                checkpoint["wandb_run_id"] = lg.experiment.id
