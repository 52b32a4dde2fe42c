"""Launch settings every kernel family shares, read from the environment (no Triton import here).
The runtime's own are in attn/kernels/runtime.py (ATTNLAB_KERNEL_CONFIG, ATTNLAB_DIRECT_LAUNCH, ATTNLAB_TMA,
ATTNLAB_DECODE_SPLITS, ATTNLAB_INTERPRET_BLOCKS); family-specific ones stay in their modules
(ATTNLAB_FIXED_SHIFT, ATTNLAB_SOFTMAX_DQ, ATTNLAB_DIFF_DKDV, ATTNLAB_SIGMOID_PATH)."""

from __future__ import annotations

import os

# "0": no timing; every kernel runs one fixed tile config, the first unless the family lets an
# environment variable pick it (`attn.pin_kernel_configs`, deterministic=true)
PIN_ENV = "ATTNLAB_AUTOTUNE"


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1, the CPU tests): one config, no timing."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def autotune_pinned() -> bool:
    """Pinned to one config, so two processes sum in the same order (read at each tuning)."""
    return os.environ.get(PIN_ENV, "1") == "0"
