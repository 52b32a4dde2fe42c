"""DESIGN.md §6 tolerance rule as a test assertion (the rule itself: `attn.testing.error_ratio`)."""

from __future__ import annotations

from attn.testing import error_ratio, max_error


def assert_within_reference_error(name, fused, torch_same_dtype, ref64, floor=1e-5, factor=2.0) -> float:
    """Assert the rule; returns err(fused) / (factor * err(torch) + floor) (<= 1 passes)."""
    ratio = error_ratio(fused, torch_same_dtype, ref64, floor, factor)
    if ratio == float("inf"):
        raise AssertionError(f"{name}: non-finite values (an unwritten NaN-poisoned element?)")
    assert ratio <= 1.0, (f"{name}: error {max_error(fused, ref64):.3e} > {factor} x torch-{fused.dtype} error "
                          f"({max_error(torch_same_dtype, ref64):.3e}) + {floor:g}")
    return ratio
