"""Files a run writes through a temp file (checkpoints, eval JSONs, caches' atomic writes) get the
umask's mode, as files written plainly do (mkstemp alone makes them 0600)."""

import os
import stat

import pytest
import torch

from data.atomic import atomic_write_text
from eval.common import write_json
from runs.checkpoints import atomic_torch_save

WRITERS = {
    "checkpoint": lambda path: atomic_torch_save({"w": torch.zeros(2)}, path),
    "eval json": lambda path: write_json(path, {"loss": 1.0}),
    "atomic text": lambda path: atomic_write_text(path, "x"),
}


@pytest.fixture
def umask():
    previous = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_written_files_take_the_umask_mode(tmp_path, umask, writer, mask):
    umask(mask)
    path = tmp_path / "out.file"
    WRITERS[writer](path)
    plain = tmp_path / "plain.file"
    plain.write_text("x")
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode) == 0o666 & ~mask
