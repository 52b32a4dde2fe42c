"""train.py's command line: a variant-parameter override reaches attnlab's own check, and a user error
(a bad override or value, a missing file) prints one `error:` line and exits with status 2, as the
eval commands do. `-v` makes the process verbose (runs/command_line.py)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Callable

from hydra.errors import HydraException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

from runs.command_line import USER_ERROR_EXIT_CODE, verbose, without_verbose_flag

# a variant parameter set without Hydra's + prefixes, e.g. attn.params.cap=5
PARAMS_OVERRIDE = re.compile(r"attn\.params\.[^=]+=")
USER_ERRORS = (ValueError, FileNotFoundError, HydraException, OmegaConfBaseException)


def params_overrides_may_add(argv: list[str]) -> list[str]:
    """`attn.params.cap=5` as `++attn.params.cap=5` (set, added where the variant's config lacks the key).
    Hydra alone refuses a key the variant's config does not list ("Key 'capp' is not in struct ... use
    +attn.params.capp=3") before attnlab's check could name the variant's parameters; added, the model
    check refuses it in its own words (attn=softmax does not take ['capp']; allowed parameters: ['sm_scale'])."""
    return [argv[0], *(f"++{arg}" if PARAMS_OVERRIDE.match(arg) else arg for arg in argv[1:])]


def one_line(error: BaseException) -> str:
    """The error's message on one line: Hydra's multi-line reports shortened (a missing config option
    with the options there are; a struct error with the first line of its cause)."""
    text = str(error)
    if isinstance(error, MissingConfigException) and error.options:
        text = f"{text.splitlines()[0]}; available options: {', '.join(error.options)}"
    elif isinstance(error, HydraException) and error.__cause__ is not None:
        text += "\n" + str(error.__cause__).splitlines()[0]  # OmegaConf's first line; the rest is its key dump
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


@contextlib.contextmanager
def one_line_errors():
    """A user error inside prints one `error:` line and exits with status 2 (unless -v was given)."""
    try:
        yield
    except USER_ERRORS as error:
        if verbose():
            raise
        print(f"error: {one_line(error)}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)


def run_with_one_line_errors(main: Callable[[], object], argv: list[str]) -> None:
    """Run a @hydra.main entry point (it reads sys.argv, given here as `argv`), its task wrapped in
    one_line_errors. Errors of composing the config (an unknown option, a bad override) come before the
    task: Hydra raises them instead of printing its report (HYDRA_FULL_ERROR=1 for this process), and
    they print one line too."""
    sys.argv = params_overrides_may_add(without_verbose_flag(argv))
    os.environ["HYDRA_FULL_ERROR"] = "1"
    with one_line_errors():
        main()
