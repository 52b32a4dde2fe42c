"""A run's label: its variant plus the variant settings given as overrides, e.g.
`softcap_tanh[cap=2]` or `diff_threshold[lambda_mode=scalar_clamp]`.

Runs of a sweep over a variant's own parameter (`-m attn=softcap_tanh attn.params.cap=2,50`)
differ only there: the label keeps them apart in wandb names and tags, in multirun folder names
(`${attnlab_label:${attn.name},${hydra.job.override_dirname}}` in configs/train.yaml) and as the
rows of scripts/ablation_report.py. Settings are the `attn.*` overrides except the backend
(which changes how, not what, is computed); `params.` is dropped from their names.
"""

from __future__ import annotations

from omegaconf import OmegaConf

NOT_A_SETTING = ("attn.backend",)


def run_label(variant: str, overrides: list[str] | tuple[str, ...]) -> str:
    settings = []
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith("attn.") and key not in NOT_A_SETTING:
            settings.append(f"{key.removeprefix('attn.').removeprefix('params.')}={value}")
    return f"{variant}[{','.join(sorted(settings))}]" if settings else variant


def _label_from_dirname(variant: str, override_dirname: str) -> str:
    """Hydra's override_dirname joins the job's overrides as key=value with commas."""
    return run_label(variant, override_dirname.split(",") if override_dirname else [])


OmegaConf.register_new_resolver("attnlab_label", _label_from_dirname, replace=True)
