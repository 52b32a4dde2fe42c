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


def creation_mode() -> int:
    """The mode open() gives a new file: 0o666 less the process umask. mkstemp makes its files 0o600
    whatever the umask, so files written through a temp file take this mode explicitly (shared
    machines: a group that may read a run's files reads its checkpoints and results too)."""
    try:
        with open("/proc/self/status") as status:  # Linux: the umask, read without changing it
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def temp_file_beside(path: Path, prefix: str, suffix: str = "") -> tuple[int, str]:
    """(fd, name) of a new temp file in `path`'s folder, with the mode a plainly created file gets."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
    os.fchmod(fd, creation_mode())
    return fd, name


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Open a binary temp file next to `path`; on clean exit fsync it and rename it onto
    `path`. On an exception the temp file is deleted and `path` is left untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = temp_file_beside(path, path.name + TMP_MARKER)
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
