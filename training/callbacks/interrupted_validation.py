"""A validation that a checkpoint interrupted (SIGTERM mid-validation) runs again, from its first batch,
when the run resumes from that checkpoint."""

from __future__ import annotations

import lightning as L

# where Lightning keeps the fit loop's validation progress in a checkpoint
VAL_PROGRESS = "epoch_loop.val_loop.batch_progress"
# set in a checkpoint written during a validation, read back on resume
INTERRUPTED_KEY = "validation_interrupted"


class RerunInterruptedValidation(L.Callback):
    """Lightning resumes a checkpoint written during a validation (CheckpointOnSigterm's) after that
    validation, which then never runs: its val/loss is missing and its model is never ranked for
    best.ckpt. Such a checkpoint's validation progress is saved as Lightning's "restarted
    mid-evaluation" at the validation's first batch, so the resumed run validates again from the start
    (the partial loss sums are not in the checkpoint). That state counts one batch in flight; when the
    validation starts again, the running total gives it back, or a later resume from a validation's own
    checkpoint would look like another interrupted one and validate twice."""

    def __init__(self):
        self._resumed_interrupted = False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        # a validation's own checkpoint (ModelCheckpoint, at its end) is written after its last batch
        finished = trainer.fit_loop.epoch_loop.val_loop.batch_progress.is_last_batch
        if not trainer.validating or trainer.sanity_checking or finished:
            return
        progress = checkpoint["loops"]["fit_loop"][VAL_PROGRESS]
        earlier = progress["total"]["completed"] - progress["current"]["completed"]  # batches of earlier validations
        progress["total"] = {"ready": earlier + 1, "started": earlier + 1, "processed": earlier, "completed": earlier}
        progress["current"] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
        progress["is_last_batch"] = False
        checkpoint[INTERRUPTED_KEY] = True

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self._resumed_interrupted = bool(checkpoint.get(INTERRUPTED_KEY))

    def on_validation_start(self, trainer, pl_module):
        if self._resumed_interrupted and not trainer.sanity_checking:
            total = trainer.fit_loop.epoch_loop.val_loop.batch_progress.total
            total.ready -= 1
            total.started -= 1
            self._resumed_interrupted = False
