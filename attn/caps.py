"""Logit cap functions of the softmax family (DESIGN.md §4), torch forms.

The Triton forms live beside these in `attn/kernels/` (same names, `tl` ops); the
tests check that both agree.
"""

from __future__ import annotations

import torch

CAP_METHODS = ("none", "tanh", "soft_sign", "alsc")


def tanh_cap(y: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(y / cap)


def soft_sign_cap(y: torch.Tensor, cap: float) -> torch.Tensor:
    return y / (1 + y.abs() / cap)


def alsc_cap(y: torch.Tensor, cap: float, knee: float) -> torch.Tensor:
    """Adaptive linear soft cap: identity on [-a, a] (a = knee * cap), tanh-shaped beyond, bounded by cap."""
    a = knee * cap
    outside = a + (cap - a) * torch.tanh((y.abs() - a) / (cap - a))
    return torch.where(y.abs() <= a, y, torch.sign(y) * outside)


def apply_cap(y: torch.Tensor, method: str, cap: float, knee: float) -> torch.Tensor:
    if method == "none":
        return y
    if method == "tanh":
        return tanh_cap(y, cap)
    if method == "soft_sign":
        return soft_sign_cap(y, cap)
    if method == "alsc":
        return alsc_cap(y, cap, knee)
    raise ValueError(f"cap method must be one of {CAP_METHODS}, got {method!r}")
