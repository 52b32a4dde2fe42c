"""The few scalars every optimizer step needs (gradient norm, clip factors, non-finite flag), each
group computed by one call that is one fused kernel on CUDA.

At research sizes the step is host-bound: each eager op costs tens of microseconds of host time
whatever its size, and the gradient norm, the clip and the non-finite check were about twenty small
ops per step. On CUDA these functions run compiled (torch.compile, one Triton kernel per function,
compiled on the first step); elsewhere eagerly: the same code, so CPU tests check the math.
"""

from __future__ import annotations

import torch

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: clip / (norm + eps)


class OnDevice:
    """fn run compiled when its first tensor argument is on CUDA, eagerly otherwise."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = None

    def __call__(self, first, *args):
        tensor = first[0] if isinstance(first, (list, tuple)) else first
        if tensor.device.type != "cuda":
            return self.fn(first, *args)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, fullgraph=True, dynamic=False)
        return self._compiled(first, *args)


def _norm_and_clip(per_param_norms: list[torch.Tensor], max_norm: float | None):
    """(global norm in fp32, clip scale, clip divisor) from the per-parameter norms
    (torch._foreach_norm's). scale = min(1, max_norm / (norm + eps)) multiplies the gradients
    (clip_grad_norm_'s rule); divisor = 1 / scale is what a fused optimizer divides them by
    (its `grad_scale`). Both None without a clip."""
    norm = torch.linalg.vector_norm(torch.stack(per_param_norms).float())
    if max_norm is None:
        return norm, None, None
    scale = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
    return norm, scale, 1.0 / scale


def _nonfinite_flag(grad_norm: torch.Tensor, loss: torch.Tensor, skipped: torch.Tensor):
    """(found, skipped + found): found is 1.0 when the step's loss or gradient norm is not finite
    (a non-finite gradient makes the norm non-finite), else 0.0, as a 0-d fp32 tensor (the dtype
    a fused optimizer's `found_inf` takes)."""
    found = torch.logical_not(torch.isfinite(grad_norm) & torch.isfinite(loss)).float().reshape(())
    return found, skipped + found


norm_and_clip = OnDevice(_norm_and_clip)
nonfinite_flag = OnDevice(_nonfinite_flag)
