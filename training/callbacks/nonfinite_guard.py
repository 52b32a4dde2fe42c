"""The non-finite guard: a step with a non-finite loss or gradient is skipped, or stops the run.

NonFiniteGuard (train.nonfinite: skip | stop | off)
    After backward and before gradient clipping and the optimizer step (Lightning's
    on_before_optimizer_step), the loss of the step and every gradient are checked, the gradients
    through their norm (LitGPT.grad_norm, computed once per step and reused by clipping).
    - skip: AdamW leaves every parameter, its moments and its step count untouched; the step
      is counted in `train/nonfinite_steps` (saved in checkpoints). The LR schedule still
      advances: the step index stays the data position. With a fused optimizer (AdamW on
      GPU) the check and the skip stay on the device, through the optimizer's `found_inf`
      (the mechanism GradScaler uses), so training never waits for the host; otherwise the
      step costs one host sync and the gradients are dropped (set to None).
    - stop: raises NonFiniteError naming the global step, whether the loss was finite, the first
      parameter (module order) with a non-finite gradient and the first module whose forward
      output went non-finite (found by re-running the batch's forward with hooks, only then).
    Under precision=16-mixed the GradScaler already skips steps with inf/NaN (scaled) gradients
    and lowers the scale; the guard then leaves gradients to it and only checks the loss.
"""

from __future__ import annotations

import lightning as L
import torch

from models.lit import writes_logs
from models.step_scalars import nonfinite_found
from training.sharding import call_with_whole_params, shards_gradients

POLICIES = ("skip", "stop", "off")


class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss or gradient under train.nonfinite=stop."""


def _all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


class NonFiniteGuard(L.Callback):
    def __init__(self, policy: str = "skip"):
        if policy not in POLICIES:
            raise ValueError(f"train.nonfinite must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._skipped: torch.Tensor | int = 0  # a device tensor once steps are checked
        self._loss: torch.Tensor | None = None  # the step's loss (summed over micro-batches), detached
        self._batch = None

    @property
    def nonfinite_steps(self) -> int:
        return int(self._skipped)

    # the batch is kept only to locate the first non-finite module if we stop
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._batch = batch
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._loss = None

    def on_before_backward(self, trainer, pl_module, loss):
        # the step's loss, summed over micro-batches (one bad micro-batch makes the sum non-finite):
        # checked once per step, on the device, with the gradient norm
        loss = loss.detach()
        self._loss = loss if self._loss is None else self._loss + loss

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.policy == "off":
            return
        scaler_handles_grads = str(trainer.precision) == "16-mixed"
        loss = self._loss if self._loss is not None else torch.zeros((), device=pl_module.device)
        if not isinstance(self._skipped, torch.Tensor):
            self._skipped = torch.tensor(float(self._skipped), device=pl_module.device)
        # a non-finite gradient makes the step's gradient norm non-finite (LitGPT.nonfinite_flag);
        # under the scaler only the loss is ours to check
        found = nonfinite_found(loss, loss) if scaler_handles_grads else pl_module.nonfinite_flag(loss)
        skipped_if_skipped = self._skipped + found
        if shards_gradients(trainer) and torch.distributed.is_initialized():
            # each rank checked only its own gradient shard: agree before skipping. (DDP needs
            # none: a non-finite value on one rank reaches every rank's all-reduced gradients,
            # and a non-finite loss gives non-finite gradients; it saves a collective per step.)
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
            skipped_if_skipped = self._skipped + found
        optimizer = getattr(optimizer, "optimizer", optimizer)  # unwrap a LightningOptimizer
        if self.policy == "skip" and getattr(optimizer, "_step_supports_amp_scaling", False) and not scaler_handles_grads:
            optimizer.found_inf = found  # the fused step skips itself when found == 1
            self._skipped = skipped_if_skipped
            return
        if not bool(found):  # one host sync per step
            return
        bad_param = None
        if not scaler_handles_grads:  # only after a failure: name the first bad gradient
            bad_param = next(
                (name for name, p in pl_module.named_parameters() if p.grad is not None and not _all_finite(p.grad)),
                None,
            )
        if self.policy == "stop":
            raise NonFiniteError(self._describe(trainer, pl_module, bad_param))
        self._skipped = self._skipped + 1
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._batch = None
        if self.policy != "off" and writes_logs(trainer):  # only steps whose logs are written
            # with the step's other logs: read on the host once the device has finished the step
            # (models/log_step_metrics.py)
            pl_module.log_step_metrics.add("train/nonfinite_steps", self._skipped)

    def _describe(self, trainer, pl_module, bad_param: str | None) -> str:
        step = trainer.global_step
        parts = [f"non-finite values at global step {step} (train.nonfinite=stop)"]
        parts.append("loss is finite" if self._loss is None or _all_finite(self._loss) else "loss is not finite")
        if bad_param is not None:
            parts.append(f"first parameter with a non-finite gradient: {bad_param}")
        module = self._first_nonfinite_module(trainer, pl_module)
        if module is not None:
            parts.append(f"first module with a non-finite forward output: {module}")
        return "; ".join(parts)

    @torch.no_grad()
    def _first_nonfinite_module(self, trainer, pl_module) -> str | None:
        """Re-run the step's forward with hooks (only after a failure, so it costs nothing otherwise)."""
        if self._batch is None:
            return None
        found: list[str] = []
        handles = []
        for name, module in pl_module.named_modules():
            if not name:
                continue

            def hook(mod, args, output, name=name):
                if not found and isinstance(output, torch.Tensor) and output.is_floating_point() and not _all_finite(output):
                    found.append(name)

            handles.append(module.register_forward_hook(hook))
        try:
            # eager: hooks do not fire inside a compiled graph; under the step's precision context
            # (autocast), so the re-run sees the step's dtypes (and FSDP's bf16 weights work).
            # Every rank gets here under FSDP: the ranks agreed on the non-finite flag.
            with trainer.precision_plugin.forward_context():
                call_with_whole_params(trainer, pl_module, "_loss", self._batch, eager=True)
        finally:
            for h in handles:
                h.remove()
        return found[0] if found else None

    def state_dict(self):
        return {"nonfinite_steps": self.nonfinite_steps}

    def load_state_dict(self, state_dict):
        self._skipped = int(state_dict.get("nonfinite_steps", 0))
