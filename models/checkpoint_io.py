"""Checkpoint files written atomically and read without unpickling code."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """Write to a temp file in the same directory, fsync, then rename over `path`:
    a crash leaves either the previous file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Load a checkpoint with weights_only=True; errors name the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated, bit-flipped or not a checkpoint at all
        raise ValueError(f"checkpoint {path} cannot be read safely (corrupt, truncated or not a torch file): {e}") from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise ValueError(f"checkpoint {path} is not an attnlab training checkpoint (no state_dict / hyper_parameters)")
    return ckpt


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        return load_checkpoint(path, map_location=map_location or "cpu")
