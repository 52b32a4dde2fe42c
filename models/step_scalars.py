"""The few scalars every optimizer step needs (gradient norm, clip divisor, non-finite flag), in
as few device ops as the math allows.

At research sizes the step is host-bound: each eager op costs host time whatever its size. They
run eagerly: compiled into one fused kernel each, torch.compile's call overhead with ~50 gradient
inputs exceeds the launches it saves (docs/results/captured_step/).
"""

from __future__ import annotations

import torch

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: clip / (norm + eps)


def norm_and_clip(per_param_norms: list[torch.Tensor], max_norm: float | None):
    """(global norm in fp32, clip divisor) from the per-parameter norms (torch._foreach_norm's).
    The gradients are divided by max(1, (norm + eps) / max_norm): torch.nn.utils.clip_grad_norm_'s
    rule (it multiplies by the inverse), and what a fused optimizer applies as its `grad_scale`.
    The divisor is None without a clip."""
    norm = torch.linalg.vector_norm(torch.stack(per_param_norms).float())
    if max_norm is None:
        return norm, None
    return norm, torch.clamp((norm + CLIP_EPS) / max_norm, min=1.0)


def nonfinite_flag(grad_norm: torch.Tensor, loss: torch.Tensor, skipped: torch.Tensor):
    """(found, skipped + found): found is 1.0 when the step's loss or gradient norm is not finite
    (a non-finite gradient makes the norm non-finite; so does their sum), else 0.0, as a 0-d fp32
    tensor (the dtype a fused optimizer's `found_inf` takes)."""
    found = torch.logical_not(torch.isfinite(grad_norm + loss)).float().reshape(())
    return found, skipped + found
