"""The project is declared in pyproject.toml; this adds what pyproject.toml cannot say: configs/ ships
as the package `attnlab_configs` (every Hydra config as package data), so an installed attnlab finds
its configs (runs/config_dir.py) without the clone."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["attn*", "models*", "runs*", "training*", "data*", "eval*"]), "attnlab_configs"],
    package_dir={"attnlab_configs": "configs"},
    package_data={"attnlab_configs": ["**/*.yaml"]},
)
