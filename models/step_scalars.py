"""The few scalars every optimizer step needs (gradient norm, clip divisor, non-finite flag), in
as few device ops as the math allows.

At research sizes the step is host-bound: each eager op costs host time whatever its size. Under
train.cuda_graphs=step they are computed inside the captured graph, after the backward
(`step_scalars`, models/captured_step.py), and cost no host time; otherwise they run eagerly
(compiled into one fused kernel each, torch.compile's call overhead with ~50 gradient inputs
exceeds the launches it saves: docs/results/captured_step/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: clip / (norm + eps)


@dataclass
class StepScalars:
    """One step's gradient statistics, device tensors: the per-parameter gradient norms (in the
    order of the gradients given), their global norm (fp32), the clip divisor (None without a
    clip) and the non-finite flag of the norm and the step's loss (None where no loss was given)."""

    per_param_norms: list
    norm: torch.Tensor
    divisor: torch.Tensor | None
    found_nonfinite: torch.Tensor | None


# a pytree node: a captured step's tail returns one (its tensors are the graph's static outputs)
pytree.register_dataclass(StepScalars)


def norm_and_clip(per_param_norms: list[torch.Tensor], max_norm: float | None):
    """(global norm in fp32, clip divisor) from the per-parameter norms (torch._foreach_norm's).
    The gradients are divided by max(1, (norm + eps) / max_norm): torch.nn.utils.clip_grad_norm_'s
    rule (it multiplies by the inverse), and what a fused optimizer applies as its `grad_scale`.
    The divisor is None without a clip."""
    norm = torch.linalg.vector_norm(torch.stack(per_param_norms).float())
    if max_norm is None:
        return norm, None
    return norm, torch.clamp((norm + CLIP_EPS) / max_norm, min=1.0)


def nonfinite_found(grad_norm: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """1.0 when the step's loss or gradient norm is not finite (a non-finite gradient makes the norm
    non-finite; so does their sum), else 0.0, as a 0-d fp32 tensor (the dtype a fused optimizer's
    `found_inf` takes)."""
    return torch.logical_not(torch.isfinite(grad_norm + loss)).float().reshape(())


def step_scalars(grads: list[torch.Tensor], max_norm: float | None, loss: torch.Tensor | None = None) -> StepScalars:
    """Every scalar of the step from its (non-empty list of) gradients, and the non-finite flag
    with its loss where given."""
    per_param = list(torch._foreach_norm(grads))
    norm, divisor = norm_and_clip(per_param, max_norm)
    found = nonfinite_found(norm, loss.detach()) if loss is not None else None
    return StepScalars(per_param, norm, divisor, found)
