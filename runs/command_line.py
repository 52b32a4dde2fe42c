"""What every attnlab command line shares (train.py's and the eval commands'): `-v` (or
HYDRA_FULL_ERROR=1) makes the process verbose, so that a user error shows its traceback and wandb prints
its own run header and summary block (runs/wandb_quiet.py keeps them quiet otherwise); a user error
without it prints one `error:` line and exits with USER_ERROR_EXIT_CODE."""

from __future__ import annotations

import os

VERBOSE_FLAG = "-v"
USER_ERROR_EXIT_CODE = 2
_verbose = False  # set by without_verbose_flag from the command line


def verbose() -> bool:
    """Whether the command line asked for verbose output (`-v` or HYDRA_FULL_ERROR=1)."""
    return _verbose


def without_verbose_flag(argv: list[str]) -> list[str]:
    """`argv` without `-v` (no Hydra app takes it), the process made verbose when it was there or
    HYDRA_FULL_ERROR=1 is set."""
    global _verbose
    _verbose = VERBOSE_FLAG in argv[1:] or os.environ.get("HYDRA_FULL_ERROR") == "1"
    return [argv[0], *(arg for arg in argv[1:] if arg != VERBOSE_FLAG)]
