import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter. Set before anything imports attn (which
# loads the kernels where Triton can run) or triton: a jit function created without it cannot run
# on CPU, whichever module made it first. Here only: a test module that set it at import would, on a
# GPU machine, switch the whole pytest process to the interpreter's launch settings after its kernels
# were compiled for CUDA (the interpreter's tests of CPU tensors fail there instead).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attn.kernels.runtime import clear_launch_plans  # noqa: E402
from attn.testing import nan_poisoned_empty  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests/tolerance.py and friends


@pytest.fixture
def nan_poison(monkeypatch):
    """Floating tensors from torch.empty / empty_like start as NaN, so an element a kernel
    never wrote fails the comparison instead of passing by luck."""
    with nan_poisoned_empty():
        yield


@pytest.fixture
def first_tile_configs(monkeypatch):
    """Every kernel on its first tile config: no candidates compiled and timed, which correctness does
    not need (and tuning must not run inside a CUDA-graph capture)."""
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "0")


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch, tmp_path_factory):
    """Tests never touch the network or the user's caches."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path_factory.getbasetemp()))
    os.environ.setdefault("ATTNLAB_TEST", "1")


@pytest.fixture(autouse=True)
def _restore_torch_deterministic_mode():
    """Lightning's Trainer sets torch.use_deterministic_algorithms for the whole process (train.run
    gives the mode back itself; a test that builds a Trainer might not); tests that read the mode get
    it as it was before."""
    mode, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Kernel launch plans are built from module state that some tests patch (interpreting, device
    properties, row limits): every test starts and ends without any."""
    clear_launch_plans()
    yield
    clear_launch_plans()
