"""Where the Hydra configs are. In a clone (or an editable install) they are configs/ beside the
packages; an installed wheel ships the same folder as the package `attnlab_configs` (setup.py),
which sits beside the packages in site-packages. Both are looked up next to this code, so a clone
always reads its own configs, never those of another installed attnlab."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

_PACKAGES_ROOT = Path(__file__).resolve().parents[1]


def _config_dir() -> str:
    candidates = [_PACKAGES_ROOT / "attnlab_configs", _PACKAGES_ROOT / "configs"]
    for folder in candidates:
        if (folder / "train.yaml").is_file():
            return str(folder)
    raise FileNotFoundError(f"attnlab's Hydra configs are missing: looked for train.yaml in {[str(c) for c in candidates]}")


CONFIG_DIR = _config_dir()


def group_options(group: str) -> str:
    """The options of config group `group` (its configs/<group>/*.yaml), comma-separated: the resolver
    `${attnlab_group_options:<group>}` with which the eval commands' --help lists the groups they accept
    (configs/eval/common.yaml). `group` is a group's name (letters, digits, _ and / between them),
    never a path outside the configs."""
    if not isinstance(group, str) or not re.fullmatch(r"[A-Za-z0-9_]+(/[A-Za-z0-9_]+)*", group):
        raise ValueError(f"attnlab_group_options takes a config group's name (e.g. data/tokenizer), got {group!r}")
    folder = Path(CONFIG_DIR) / group
    if not folder.is_dir():
        raise ValueError(f"attnlab_group_options: no config group {group!r} in {CONFIG_DIR}")
    return ", ".join(sorted(path.stem for path in folder.glob("*.yaml")))


OmegaConf.register_new_resolver("attnlab_group_options", group_options, replace=True)
