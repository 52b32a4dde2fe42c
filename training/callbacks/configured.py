"""The callbacks of configs/callbacks/: one per entry with a `_target_`, in the config's order."""

from __future__ import annotations

import lightning as L
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig


def build_configured_callbacks(callbacks_cfg: DictConfig | None) -> list[L.Callback]:
    """Null entries are left out (check_config refused anything else), and so are callbacks built
    switched off (`enabled` false, e.g. MaxLogitMonitor under train.log_max_logit=false). A callback's
    own ValueError about its settings is raised as it is, not wrapped by Hydra."""
    built = []
    for node in (callbacks_cfg or {}).values():
        if node is None:
            continue
        try:
            callback = instantiate(node)
        except InstantiationException as e:
            if isinstance(e.__cause__, ValueError):
                raise e.__cause__ from None
            raise
        if getattr(callback, "enabled", True):
            built.append(callback)
    return built
