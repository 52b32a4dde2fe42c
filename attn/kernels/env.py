"""Launch settings both kernel families read from the environment (no Triton import here)."""

from __future__ import annotations

import os

# "0": every kernel runs its first tile config (`attn.pin_kernel_configs`, deterministic=true)
PIN_ENV = "ATTNLAB_AUTOTUNE"


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1, the CPU tests): one config, no timing."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def autotune_pinned() -> bool:
    """Pinned to the first config, so two processes sum in the same order (read at each tuning)."""
    return os.environ.get(PIN_ENV, "1") == "0"
