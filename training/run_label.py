"""A run's label: its variant plus the variant settings given as overrides, e.g.
`softcap_tanh[cap=2]` or `diff_threshold[lambda_mode=scalar_clamp]`.

Runs of a sweep over a variant's own parameter (`-m attn=softcap_tanh attn.params.cap=2,50`)
differ only there: the label keeps them apart in wandb names and tags, as the rows of
scripts/analysis/ablation_report.py and, as `folder_label` writes it, in multirun folder names
(`${attnlab_folder_label:${attn.name},${hydra.job.override_dirname}}` in configs/train.yaml).
Settings are the `attn.*` overrides except the backend (which changes how, not what, is
computed); `params.` is dropped from their names.
"""

from __future__ import annotations

import re

from omegaconf import OmegaConf

NOT_A_SETTING = ("attn.backend",)
# what a folder name holds: nothing a shell or a Hydra override value would have to quote
FOLDER_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def run_settings(overrides: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """The variant settings among `overrides`: (name, value) pairs of the `attn.*` overrides, in the
    order of their `name=value` text."""
    settings = []
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith("attn.") and key not in NOT_A_SETTING:
            settings.append((key.removeprefix("attn.").removeprefix("params."), value))
    return sorted(settings, key=lambda setting: f"{setting[0]}={setting[1]}")


def run_label(variant: str, overrides: list[str] | tuple[str, ...]) -> str:
    settings = run_settings(overrides)
    return f"{variant}[{','.join(f'{key}={value}' for key, value in settings)}]" if settings else variant


def folder_label(variant: str, overrides: list[str] | tuple[str, ...]) -> str:
    """The label as a folder name that needs no quoting in a shell or in a Hydra override (`ckpt=...`):
    each setting joined to the variant by `+`, its name and value by `-`, and any run of other
    characters than letters, digits, `_`, `.` and `-` written `-` between words and left out at either end
    (`softcap_tanh+cap-2`, `diff_threshold+beta-0.5+lambda_mode-scalar_clamp`, `x=[1,2]` as `x-1-2`).
    Two settings may give one name (`'a b'` and `a-b`): the job number in front of it keeps a sweep's
    folders apart."""
    def safe(text: str) -> str:
        return "-".join(FOLDER_UNSAFE.sub(" ", text).split())

    settings = ["-".join(filter(None, (safe(key), safe(value)))) for key, value in run_settings(overrides)]
    return "+".join([variant, *settings])


def _folder_label_from_dirname(variant: str, override_dirname: str) -> str:
    """Hydra's override_dirname joins the job's overrides as key=value with commas."""
    return folder_label(variant, override_dirname.split(",") if override_dirname else [])


OmegaConf.register_new_resolver("attnlab_folder_label", _folder_label_from_dirname, replace=True)
