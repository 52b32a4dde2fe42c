"""Crash-safe file writes and a cross-process build lock.

Every cache artifact (sdist download, tokenizer file, token shard, manifest) is written to a
temporary file in the destination directory, flushed and fsynced, then moved into place with
`os.replace`. A reader therefore sees either the old complete file or the new complete file,
never a half-written one; a crash leaves at most a stray `*.tmp-*` file that the next build
removes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

TMP_MARKER = ".tmp-"


def _fsync_dir(directory: Path) -> None:
    # The rename itself lives in the directory entry; without this fsync a power loss can
    # forget the rename even though the file data reached the disk.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Open a binary temp file next to `path`; on clean exit fsync it and rename it onto
    `path`. On an exception the temp file is deleted and `path` is left untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=path.name + TMP_MARKER, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, payload: bytes) -> None:
    with atomic_writer(path) as handle:
        handle.write(payload)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def remove_stale_temp_files(directory: str | os.PathLike) -> None:
    """Delete leftovers of writes that crashed before their rename."""
    directory = Path(directory)
    if directory.is_dir():
        for leftover in directory.glob(f"*{TMP_MARKER}*"):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def exclusive_lock(lock_path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (created if needed).

    Parallel jobs of a Hydra multirun that need the same cache then build it once: the
    second waits here and finds the first one's finished result. Where `fcntl` is missing
    (Windows) this is a no-op; the atomic renames still keep the cache consistent.
    """
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
