"""Learning-rate schedules: pure functions of the optimizer step, returning the factor on the base
learning rate (torch's LambdaLR multiplies each group's lr by it). configs/scheduler/*.yaml name one
with `_partial_: true`, so Hydra gives a function of the step alone.

Every schedule starts with the same linear warm-up: step s < warmup_steps has factor
(s + 1) / warmup_steps, so step 0 already trains (at 1/warmup_steps) and step warmup_steps - 1 is
at 1. Decay phases end at min_lr_ratio at step max_steps (the step after the last one trained,
so the last trained step, max_steps - 1, sits one step short of the floor); later steps stay at
the floor.
"""

from __future__ import annotations

import math

DECAY_SHAPES = ("linear", "cosine")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_common(warmup_steps, max_steps, min_lr_ratio) -> None:
    if not _is_int(warmup_steps) or warmup_steps < 0:
        raise ValueError(f"scheduler.warmup_steps (train.warmup_steps) must be an int >= 0, got {warmup_steps!r}")
    if not _is_int(max_steps) or max_steps < 1:
        raise ValueError(f"scheduler.max_steps (train.max_steps) must be an int >= 1, got {max_steps!r}")
    if isinstance(min_lr_ratio, bool) or not isinstance(min_lr_ratio, (int, float)) or not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"scheduler.min_lr_ratio (train.min_lr_ratio) must be in [0, 1], got {min_lr_ratio!r}")


def _decay(progress: float, min_lr_ratio: float, shape: str) -> float:
    """The factor at `progress` in [0, 1] of a decay from 1 to min_lr_ratio."""
    if shape == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr_ratio + (1 - min_lr_ratio) * (1 - progress)


def warmup_cosine(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up, then cosine decay from 1 to min_lr_ratio between warmup_steps and max_steps."""
    _check_common(warmup_steps, max_steps, min_lr_ratio)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return _decay(progress, min_lr_ratio, "cosine")


def warmup_linear(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up, then linear decay from 1 to min_lr_ratio between warmup_steps and max_steps."""
    _check_common(warmup_steps, max_steps, min_lr_ratio)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return _decay(progress, min_lr_ratio, "linear")


def decay_steps(max_steps: int, decay_fraction: float) -> int:
    """The number of steps of warmup_stable_decay's decay phase: decay_fraction of max_steps, rounded."""
    return round(decay_fraction * max_steps)


def warmup_stable_decay(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float,
                        decay_fraction: float, decay_shape: str = "linear") -> float:
    """Warm-up-stable-decay: linear warm-up, factor 1 until the decay phase, then decay from 1 to
    min_lr_ratio (linear or cosine-shaped) over the last decay_steps(max_steps, decay_fraction)
    steps: the decay phase starts at step max_steps - decay_steps and reaches the floor at max_steps."""
    _check_common(warmup_steps, max_steps, min_lr_ratio)
    if isinstance(decay_fraction, bool) or not isinstance(decay_fraction, (int, float)) or not 0 < decay_fraction <= 1:
        raise ValueError(f"scheduler.decay_fraction must be in (0, 1], got {decay_fraction!r}")
    if decay_shape not in DECAY_SHAPES:
        raise ValueError(f"scheduler.decay_shape must be one of {DECAY_SHAPES}, got {decay_shape!r}")
    n_decay = decay_steps(max_steps, decay_fraction)
    decay_start = max_steps - n_decay
    if n_decay < 1 or decay_start < warmup_steps:
        raise ValueError(
            f"scheduler.decay_fraction={decay_fraction} gives a decay phase of {n_decay} of train.max_steps={max_steps} "
            f"steps, starting at step {decay_start}: it must be at least 1 step and start at or after the warm-up's "
            f"end (train.warmup_steps={warmup_steps})"
        )
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step < decay_start:
        return 1.0
    return _decay(min(1.0, (step - decay_start) / n_decay), min_lr_ratio, decay_shape)
