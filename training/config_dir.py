"""Where the Hydra configs are. In a clone (or an editable install) they are configs/ beside the
packages; an installed wheel ships the same folder as the package `attnlab_configs` (setup.py),
which sits beside the packages in site-packages. Both are looked up next to this code, so a clone
always reads its own configs, never those of another installed attnlab."""

from __future__ import annotations

from pathlib import Path

_PACKAGES_ROOT = Path(__file__).resolve().parents[1]


def _config_dir() -> str:
    candidates = [_PACKAGES_ROOT / "attnlab_configs", _PACKAGES_ROOT / "configs"]
    for folder in candidates:
        if (folder / "train.yaml").is_file():
            return str(folder)
    raise FileNotFoundError(f"attnlab's Hydra configs are missing: looked for train.yaml in {[str(c) for c in candidates]}")


CONFIG_DIR = _config_dir()
