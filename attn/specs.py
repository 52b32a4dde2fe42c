"""Frozen per-family configs that kernels specialize on (hashable, safe as custom-op args)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from attn.caps import CAP_METHODS


def _finite_number(value) -> bool:
    """A real number (not a bool, a string or None) that is finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_sm_scale(sm_scale) -> None:
    if sm_scale is not None and not (_finite_number(sm_scale) and sm_scale > 0):
        raise ValueError(f"attn.sm_scale must be > 0 and finite, or null (D^-1/2), got {sm_scale!r}")


@dataclass(frozen=True)
class SoftmaxFamilySpec:
    """softmax / softcap / alsc: z = t_i * cap(sm_scale * q.k), softmax over visible keys."""

    cap: str = "none"  # one of CAP_METHODS
    cap_value: float = 30.0  # c > 0 (unused when cap == "none")
    knee: float = 0.5  # ALSC kappa in [0, 1)
    sm_scale: float | None = None  # default D^-1/2

    def __post_init__(self):
        if self.cap not in CAP_METHODS:
            raise ValueError(f"attn.cap must be one of {CAP_METHODS}, got {self.cap!r}")
        if self.cap != "none" and not (_finite_number(self.cap_value) and self.cap_value > 0):
            raise ValueError(f"attn.cap (the cap value c) must be > 0 and finite for cap method {self.cap!r}, got {self.cap_value!r}")
        if self.cap == "alsc" and not (_finite_number(self.knee) and 0.0 <= self.knee < 1.0):
            raise ValueError(f"attn.knee (kappa) must be in [0, 1), got {self.knee!r}")
        _check_sm_scale(self.sm_scale)

    def scale(self, head_dim: int) -> float:
        return self.sm_scale if self.sm_scale is not None else head_dim**-0.5


@dataclass(frozen=True)
class ThresholdFamilySpec:
    """threshold / diff_threshold: w = relu(q.k - tau_i)^p [- lambda_h relu(q2.k2 - tau_i)^p]."""

    beta: float = 1.0
    power: float = 2.0  # p > 0
    differential: bool = False

    def __post_init__(self):
        if not (_finite_number(self.power) and self.power > 0):
            raise ValueError(f"attn.power (p) must be a finite float > 0, got {self.power!r}")
        if not _finite_number(self.beta):
            raise ValueError(f"attn.beta must be a finite float, got {self.beta!r}")


@dataclass(frozen=True)
class SigmoidFamilySpec:
    """sigmoid: w = sigmoid(sm_scale * q.k + b_i), no row normalization; b_i = `bias`, or -ln(n_i) when None."""

    bias: float | None = None  # None: -ln(n_i), n_i the keys query i sees
    sm_scale: float | None = None  # default D^-1/2

    def __post_init__(self):
        if self.bias is not None and not _finite_number(self.bias):
            raise ValueError(f"attn.bias must be a finite float or null (-ln(n_i)), got {self.bias!r}")
        _check_sm_scale(self.sm_scale)

    def scale(self, head_dim: int) -> float:
        return self.sm_scale if self.sm_scale is not None else head_dim**-0.5


AttentionSpec = SoftmaxFamilySpec | ThresholdFamilySpec | SigmoidFamilySpec
