"""Process-wide settings a training run changes for itself, given back when it ends.

A run with `deterministic=true` pins attnlab's kernel tile configs (ATTNLAB_AUTOTUNE, through
`attn.pin_kernel_configs`), and Lightning's Trainer sets torch's deterministic-algorithms mode, cuDNN's
benchmark flag and CUBLAS_WORKSPACE_CONFIG for the whole process. A caller that runs more in the same
process (a Hydra multirun's next job, a notebook, the tests) gets its own settings back, so the next
run is not pinned or slowed by this one's choice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from attn.kernels.env import PIN_ENV

RUN_ENV_VARS = (PIN_ENV, "CUBLAS_WORKSPACE_CONFIG")


@contextlib.contextmanager
def restored_process_settings() -> Iterator[None]:
    env = {name: os.environ.get(name) for name in RUN_ENV_VARS}
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
