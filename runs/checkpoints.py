"""Checkpoint files (<run>/checkpoints/*.ckpt): written atomically with a digest of their content, read
without unpickling code (weights_only=True), and what a checkpoint records besides weights (its tokenizer)."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from data.atomic import temp_file_beside
from data.tokenizers import Tokenizer, tokenizer_from_record


# sha256 over the content of a checkpoint dict, stored in the file: torch.load notices some
# flipped bits in the pickled metadata but none in tensor bytes, which would load silently.
CHECKSUM_KEY = "attnlab_content_sha256"


def tensor_digest(obj) -> str:
    """sha256 over a nested dict/list, in order: every tensor's dtype, shape and bytes, every
    key and every plain value (numbers, strings), so a flipped bit anywhere is noticed."""
    digest = hashlib.sha256()

    def walk(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            digest.update(f"T{t.dtype}{tuple(x.shape)}".encode())
            digest.update(t.view(torch.uint8).numpy())  # the buffer itself, no extra copy
        elif isinstance(x, dict):
            for key, value in x.items():
                digest.update(f"K{key!r}".encode())
                walk(value)
        elif isinstance(x, (list, tuple)):
            digest.update(f"L{len(x)}".encode())
            for value in x:
                walk(value)
        elif x is None or isinstance(x, (bool, int, float, str, bytes)):
            digest.update(f"V{type(x).__name__}:{x!r}".encode())  # steps, hyperparameters, loop state
        else:
            digest.update(f"O{type(x).__name__}".encode())

    walk(obj)
    return digest.hexdigest()


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """Write to a temp file in the same directory, fsync, then rename over `path`:
    a crash leaves either the previous file or the new one, never a torn one. A dict gets
    the sha256 of its content (CHECKSUM_KEY), verified by load_checkpoint."""
    path = Path(path)
    if isinstance(obj, dict):
        obj = {**obj, CHECKSUM_KEY: tensor_digest(obj)}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file_beside(path, f".{path.name}.", ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:
        Path(tmp).unlink(missing_ok=True)
        free = shutil.disk_usage(path.parent).free
        # torch.save wraps the OS's error (a file too large, a quota) in an "[enforce fail at
        # inline_container.cc] ..." RuntimeError that carries it as its context
        os_error = next((e for e in (error, error.__cause__, error.__context__)
                         if isinstance(e, OSError) and e.errno is not None), None)
        if os_error is not None and os_error.errno != errno.ENOSPC:
            raise OSError(os_error.errno, f"{os_error.strerror} writing checkpoint {path} (the previous {path.name} "
                          f"is intact): {error}") from None
        # a full disk; torch's own message may carry no errno at all: then judged by the space left
        if os_error is not None or free < 64 * 2**20:
            raise OSError(errno.ENOSPC, f"no space left on the device writing checkpoint {path} "
                          f"({free / 2**20:.0f} MiB free there; the previous {path.name} is intact): {error}") from None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_failure(error: Exception) -> str:
    """What torch.load(weights_only=True) found wrong, in one line, without torch's advice to load the
    file with weights_only=False or to allow-list its globals (that would run code from a file someone
    handed over)."""
    text = str(error)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\s+was not an allowed global|\n\n|$)", text, re.DOTALL)
    if found:  # a pickled object or an instruction the safe unpickler refuses
        return f"it holds what a safe load refuses ({' '.join(found.group(1).split())})"
    first_sentence = re.split(r"(?<=\.)\s", text.strip(), maxsplit=1)[0]
    return f"{type(error).__name__}: {' '.join(first_sentence.split())}"


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Load a checkpoint with weights_only=True; errors name the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        with warnings.catch_warnings():  # torch's note on a file's pickle protocol: not about a checkpoint of ours
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated, bit-flipped or not a checkpoint at all
        raise ValueError(f"checkpoint {path} cannot be read safely (corrupt, truncated or not a torch file): "
                         f"{load_failure(e)}") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise ValueError(f"checkpoint {path} is not an attnlab training checkpoint (no state_dict / hyper_parameters)")
    expected = ckpt.pop(CHECKSUM_KEY, None)  # absent in checkpoints written before the checksum existed
    if expected is not None and tensor_digest(ckpt) != expected:
        raise ValueError(f"checkpoint {path} fails its content sha256 checksum (corrupted on disk: flipped bits)")
    return ckpt


def checkpoint_tokenizer(checkpoint: dict, path: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer a loaded checkpoint records (data.tokenizers.tokenizer_record); None in checkpoints
    that do not record it. `path` names the file in the errors."""
    record = checkpoint.get("tokenizer")
    return tokenizer_from_record(record, f"checkpoint {path}") if record is not None else None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer and reader through atomic_torch_save and load_checkpoint."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        return load_checkpoint(path, map_location=map_location or "cpu")
