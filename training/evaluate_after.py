"""Evaluations run by train.py after training, in the training process (`evaluate` in configs/train.yaml).

`evaluate: {perplexity: {split: test}, attention_stats: {}}` runs, once the run has its results.json,
what `python -m eval.perplexity ckpt=<run dir> split=test` and `python -m eval.attention_stats
ckpt=<run dir>` would run: the same config (configs/eval/<name>.yaml with those settings), the same
result files in the run's eval/ folder. In the training process a sweep pays for its imports, CUDA
context and kernel compiles once instead of once per evaluation process. On the command line:
`+evaluate.perplexity.split=test`, or `evaluate='{perplexity:{split:test},attention_stats:{}}'`.
Settings are values of the eval config's own keys; a config group (data=<option>, another corpus)
is chosen on the eval command's own command line.

A failed evaluation is logged with its traceback and recorded in results.json under
`evaluations.<name>.error`; the training result stays, and a sweep goes on with its next run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

log = logging.getLogger("attnlab.evaluate_after")


def _perplexity(cfg) -> list[dict]:
    from eval.perplexity import run_perplexity

    return run_perplexity(cfg)


def _attention_stats(cfg) -> list[dict]:
    from eval.attention_stats import run_attention_stats

    return run_attention_stats(cfg)


# name -> the eval command's entry (configs/eval/<name>.yaml is its config)
EVALUATIONS: dict[str, Callable] = {"perplexity": _perplexity, "attention_stats": _attention_stats}
# set by the training run itself
RESERVED = ("ckpt",)


def _settings(name: str, settings) -> dict:
    if settings is None:
        return {}
    if not OmegaConf.is_dict(settings):
        raise ValueError(f"evaluate.{name} must be a mapping of eval.{name} settings (e.g. {{split: test}}) "
                         f"or null to leave it out, got {settings!r}")
    return OmegaConf.to_container(settings, resolve=True)


def check_evaluate_config(node) -> None:
    """`evaluate` is a mapping of evaluation name -> settings of that command's config."""
    if node is None:
        return
    if not OmegaConf.is_dict(node):
        raise ValueError(f"evaluate must be a mapping of evaluation -> its settings "
                         f"(names: {sorted(EVALUATIONS)}), got {node!r}")
    for name, settings in node.items():
        if name not in EVALUATIONS:
            raise ValueError(f"evaluate.{name}: unknown evaluation; allowed: {sorted(EVALUATIONS)}")
        if settings is None:
            continue
        values = _settings(name, settings)
        allowed = set(compose_eval_config(name, Path("."), {})) - {"hydra", "paths", *RESERVED}
        for key in values:
            if key in RESERVED:
                raise ValueError(f"evaluate.{name}.{key} is set by the training run (its own directory)")
            if key not in allowed:
                raise ValueError(f"evaluate.{name}.{key}: no such setting of eval.{name}; allowed: {sorted(allowed)}")


def compose_eval_config(name: str, run_dir: Path, settings: dict):
    """configs/eval/<name>.yaml with ckpt=<run_dir> and `settings` merged in."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from runs.config_dir import CONFIG_DIR

    if GlobalHydra.instance().is_initialized():  # inside train.py's Hydra app: its config search path
        cfg = compose(config_name=f"eval/{name}", overrides=[f"ckpt={run_dir}"])
    else:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose(config_name=f"eval/{name}", overrides=[f"ckpt={run_dir}"])
    for key, value in settings.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def run_evaluations(node, run_dir: Path) -> dict[str, dict]:
    """Run each configured evaluation on the run in `run_dir`; {name: {"paths": [...]} or {"error": ...}}."""
    outcome: dict[str, dict] = {}
    if node is None:
        return outcome
    for name, settings in node.items():
        if settings is None:
            continue
        values = _settings(name, settings)
        try:
            results = EVALUATIONS[name](compose_eval_config(name, run_dir, values))
            outcome[name] = {"settings": values, "paths": [r.get("path") for r in results]}
        except Exception as e:  # noqa: BLE001 - reported and recorded; the training result stands
            log.exception("evaluation %s of %s failed", name, run_dir)
            outcome[name] = {"settings": values, "error": f"{type(e).__name__}: {e}"}
    return outcome
