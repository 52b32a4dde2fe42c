"""Third-party output that says nothing about the run, kept off the console: Lightning's product tips,
two warnings that do not apply to attnlab's data and models, and wandb's warning about a setting
Lightning passes on its own (wandb's run header and summary block: runs/wandb_quiet.py). Log lines
written while a progress bar is drawn go above the bar, not into it."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

from tqdm.contrib.logging import logging_redirect_tqdm

# messages (their start) that Lightning's rank-zero logger prints as INFO on every fit
LIGHTNING_TIPS = ("💡 Tip: For seamless cloud",)
IGNORED_WARNINGS = (
    # Lightning's own pytree helper on torch >= 2.10: internal, nothing to act on in a run
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # attnlab's training stream defines __len__ for the progress bar; with several loader workers
    # each takes every num_workers-th batch (data/sampling.py), so the length stays right
    r"Your `IterableDataset` has `__len__` defined",
)


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_TIPS)


def silence_third_party_notices() -> None:
    """Install the filters (idempotent)."""
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropTips) for f in rank_zero.filters):
        rank_zero.addFilter(_DropTips())
    for message in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def without_wandb_anonymous(wandb_logger):
    """Lightning's WandbLogger passes `anonymous=None` to wandb.init, which wandb >= 0.19 answers
    with "The anonymous setting has no effect" on every run: leave the argument out."""
    init_kwargs = getattr(wandb_logger, "_wandb_init", None)
    if isinstance(init_kwargs, dict) and init_kwargs.get("anonymous") is None:
        init_kwargs.pop("anonymous", None)
    return wandb_logger


def _writes_to_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


@contextlib.contextmanager
def logs_above_progress_bars() -> Iterator[None]:
    """While inside, every logger that writes to the console (the root logger's console handler,
    Lightning's own) writes through tqdm, which clears the progress bars drawn at that moment
    (Lightning's), writes the line and draws them again below it."""
    loggers = [logging.root, *(logger for logger in logging.root.manager.loggerDict.values()
                               if isinstance(logger, logging.Logger))]
    with logging_redirect_tqdm([logger for logger in loggers if any(map(_writes_to_console, logger.handlers))]):
        yield
