"""Validation inside fit after the last step."""

from __future__ import annotations

import lightning as L


class ValidateAtLastStep(L.Callback):
    """Validate inside fit after the last step, whatever val_every is: the run's final numbers
    and checkpoint ranking include it, and no trainer.validate() follows fit (which fails under
    multi-GPU FSDP: Lightning does not re-wrap the root, issue Lightning-AI/pytorch-lightning#19015)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # Lightning validates on a stop request, and writes logs on it. Requested at the start of
        # the last step's last micro-batch, so that its training_step already sees a log step
        # (models.lit.writes_logs) and the last log row holds the last step's values.
        last_step = trainer.max_steps > 0 and trainer.global_step + 1 >= trainer.max_steps
        if last_step and not trainer.fit_loop._should_accumulate():
            trainer.should_stop = True
