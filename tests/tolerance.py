"""DESIGN.md §6 tolerance rule: a kernel's error vs float64 is at most 2x the error of the
same PyTorch computation in the kernel's dtype, plus a small absolute floor."""

from __future__ import annotations

import torch


def max_error(x: torch.Tensor, ref64: torch.Tensor) -> float:
    return (x.double() - ref64).abs().max().item() if x.numel() else 0.0


def assert_within_reference_error(name, fused, torch_same_dtype, ref64, floor=1e-5, factor=2.0) -> float:
    """Assert the rule; returns err(fused) / (factor * err(torch) + floor) (<= 1 passes)."""
    if not torch.isfinite(fused).all():
        raise AssertionError(f"{name}: non-finite values (an unwritten NaN-poisoned element?)")
    err = max_error(fused, ref64)
    budget = factor * max_error(torch_same_dtype, ref64) + floor
    assert err <= budget, f"{name}: error {err:.3e} > {factor} x torch-{fused.dtype} error + {floor:g} = {budget:.3e}"
    return err / budget
