"""What the eval commands' command lines share (`python -m eval.<command>`, `attnlab-eval <command>`):
a user error (a missing file, an incompatible checkpoint, a bad option) prints one `error:` line and
exits with status 2; `-v` makes the process verbose (runs/command_line.py: the error's traceback
instead, and wandb's own run output). Imports nothing heavy, so that a command can refuse bad input
before it imports torch."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from runs.command_line import USER_ERROR_EXIT_CODE, verbose, without_verbose_flag


def run(main: Callable[[], object]) -> None:
    """Run an eval command's Hydra app (`main`, which reads its overrides from sys.argv) with `-v`
    taken off the command line; verbose, Hydra lets the error through with its whole traceback."""
    sys.argv = without_verbose_flag(sys.argv)
    if verbose():
        os.environ["HYDRA_FULL_ERROR"] = "1"
    main()


@contextlib.contextmanager
def clean_errors():
    """A user error inside prints one line and exits with status 2 instead of a traceback (unless -v)."""
    try:
        yield
    except (FileNotFoundError, ValueError) as e:
        if verbose():
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)


def require_ckpt(cfg: DictConfig) -> None:
    if OmegaConf.is_missing(cfg, "ckpt") or not cfg.ckpt:
        raise ValueError("ckpt=... is required: a checkpoint file, a run directory or a folder of runs")
