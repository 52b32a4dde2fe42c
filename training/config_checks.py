"""Whole-config checks run before any data or model is built: each error names the field."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import os
from pathlib import Path
from typing import get_args

from hydra.utils import get_object
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT
from lightning.fabric.utilities.seed import max_seed_value, min_seed_value
from omegaconf import DictConfig, OmegaConf

from models.gpt import check_model_config
from models.lit import gpt_config_from_dict
from runs.config_dir import CONFIG_DIR
from training.evaluate_after import check_evaluate_config

ATTN_KEYS = {"name", "backend", "params", "qk_norm", "out_norm", "out_norm_eps", "lambda_mode", "window"}
LOGGER_KINDS = ("wandb", "csv", "tensorboard", "none")
# metrics logged at every validation: what a callback's `monitor` may name
VALIDATION_METRICS = ("val/loss", "val/ppl", "val/bpb")
NUMBER_FIELDS = ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2")
# what each may be (the optimizer or schedule would refuse it only after the data is built): (test, as named)
NUMBER_RANGES = {
    "min_lr_ratio": (lambda x: 0 <= x <= 1, "in [0, 1]"),
    "weight_decay": (lambda x: x >= 0, ">= 0"),
    "beta1": (lambda x: 0 <= x < 1, "in [0, 1)"),
    "beta2": (lambda x: 0 <= x < 1, "in [0, 1)"),
}
# trainer.precision values Lightning takes (its own list: the strings and their int forms)
PRECISIONS = tuple(value for literal in get_args(_PRECISION_INPUT) for value in get_args(literal))


@functools.cache
def train_keys() -> tuple[str, ...]:
    """The train.* keys there are: those of configs/train.yaml (a `+train.foo=1` typo must not pass silently)."""
    return tuple(OmegaConf.load(Path(CONFIG_DIR) / "train.yaml").train.keys())


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


CUDA_GRAPHS_CHOICES = (True, False, "auto", "step")


def cuda_graphs_enabled(train_cfg, n_devices: int, cuda: bool) -> tuple[bool | str, str]:
    """(mode, why) for train.cuda_graphs: true (torch.compile's graphs), false and step (the whole
    forward and backward as one graph, models/captured_step.py) as given; auto picks step where
    graphs are known to hold: a compiled model on one CUDA device, without gradient accumulation
    (step is the fastest of the three there: docs/results/captured_step/)."""
    graphs = train_cfg.get("cuda_graphs", "auto")
    if graphs == "step":
        reasons = [why for bad, why in ((not cuda, "no CUDA device"), (n_devices != 1, f"{n_devices} devices"))
                   if bad]
        if reasons:
            raise ValueError("train.cuda_graphs=step needs one CUDA device (" + ", ".join(reasons) + ")")
        return "step", "train.cuda_graphs=step: the forward, loss and backward of each step as one captured graph"
    if graphs != "auto":
        return bool(graphs), f"train.cuda_graphs={str(graphs).lower()}: {'on' if graphs else 'off'}"
    reasons = [why for bad, why in ((not train_cfg.compile, "train.compile=false"),
                                    (not cuda, "no CUDA device"),
                                    (n_devices != 1, f"{n_devices} devices"),
                                    (train_cfg.grad_accum != 1, f"train.grad_accum={train_cfg.grad_accum}")) if bad]
    if reasons:
        return False, "train.cuda_graphs=auto: off (" + ", ".join(reasons) + ")"
    return "step", "train.cuda_graphs=auto: step (compiled, one CUDA device, no gradient accumulation)"


def check_config(cfg: DictConfig) -> None:
    attn_cfg = OmegaConf.to_container(cfg.attn, resolve=True)
    unknown = sorted(set(attn_cfg) - ATTN_KEYS)
    if unknown:
        raise ValueError(f"unknown attn fields {unknown}; allowed: {sorted(ATTN_KEYS)} (variant parameters go in attn.params)")
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model["vocab_size"] = 2  # the real size comes from the tokenizer
    model["attn"] = attn_cfg
    try:
        gpt = gpt_config_from_dict(model)
    except TypeError as e:
        raise ValueError(f"bad model/attn config fields: {e}") from e
    check_model_config(gpt)

    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path not in (None, "auto") and not Path(os.path.expanduser(str(ckpt_path))).is_file():
        raise FileNotFoundError(f"ckpt_path: checkpoint not found: {ckpt_path} (a .ckpt file, or auto: the run "
                                "directory's own checkpoints/last.ckpt when there is one)")
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or not min_seed_value <= cfg.seed <= max_seed_value:
        raise ValueError(f"seed must be an int in [{min_seed_value}, {max_seed_value}], got {cfg.seed!r}")
    precision = cfg.trainer.get("precision")
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"trainer.precision must be null (bf16-mixed on CUDA, 32-true elsewhere) or one of "
                         f"{[str(p) for p in PRECISIONS if isinstance(p, str)]}, got {precision!r}")
    t = cfg.train
    unknown = sorted(set(t) - set(train_keys()))
    if unknown:
        raise ValueError(f"unknown train fields {unknown}; allowed: {sorted(train_keys())}")
    for name in NUMBER_FIELDS:
        if not _is_number(t[name]) or not math.isfinite(t[name]):
            raise ValueError(f"train.{name} must be a number, got {t[name]!r}")
    for name, (allowed, what) in NUMBER_RANGES.items():
        if not allowed(t[name]):
            raise ValueError(f"train.{name} must be {what}, got {t[name]!r}")
    if t.grad_clip is not None and not _is_number(t.grad_clip):
        raise ValueError(f"train.grad_clip must be a number > 0 or null, got {t.grad_clip!r}")
    if not isinstance(t.warmup_steps, int) or isinstance(t.warmup_steps, bool):
        raise ValueError(f"train.warmup_steps must be an int >= 0, got {t.warmup_steps!r}")
    for name in ("max_steps", "batch_size", "grad_accum", "val_every", "val_tokens", "log_every"):
        if not isinstance(t[name], int) or t[name] < 1:
            raise ValueError(f"train.{name} must be a positive int, got {t[name]!r}")
    if t.stop_at_step is not None and not (isinstance(t.stop_at_step, int) and 1 <= t.stop_at_step <= t.max_steps):
        raise ValueError(f"train.stop_at_step must be null or an int in [1, train.max_steps], got {t.stop_at_step!r}")
    stop_at_time = t.get("stop_at_time")
    if stop_at_time is not None and not _is_number(stop_at_time):
        raise ValueError(f"train.stop_at_time must be null or a unix time in seconds, got {stop_at_time!r}")
    if stop_at_time is not None and cfg.trainer.get("max_time") is not None:
        raise ValueError("set one of train.stop_at_time (a deadline) and trainer.max_time (a duration), not both")
    if not isinstance(t.overwrite, bool):
        raise ValueError(f"train.overwrite must be true or false, got {t.overwrite!r}")
    if t.init_from is not None and (not isinstance(t.init_from, str) or not t.init_from):
        raise ValueError(f"train.init_from must be a model folder (or Hub name) or null, got {t.init_from!r}")
    every = t.ckpt_every_steps
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ValueError(f"train.ckpt_every_steps must be null or a positive int, got {every!r}")
    for key in ("log_samples", "sample_tokens"):
        value = t.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"train.{key} must be an int >= 0, got {value!r}")
    sequences = t.get("attention_stats_sequences", 0)
    if not isinstance(sequences, int) or isinstance(sequences, bool) or sequences < 0:
        raise ValueError(f"train.attention_stats_sequences must be an int >= 0, got {sequences!r}")
    graphs = t.get("cuda_graphs", "auto")
    if graphs not in CUDA_GRAPHS_CHOICES:
        raise ValueError(f"train.cuda_graphs must be one of true, false, auto, step; got {graphs!r}")
    if graphs == "step" and t.grad_accum != 1:
        raise ValueError(f"train.cuda_graphs=step needs train.grad_accum=1 (a replay overwrites the gradients), "
                         f"got {t.grad_accum}")
    if graphs is True:
        if not t.compile:
            raise ValueError("train.cuda_graphs=true needs train.compile=true (the graphs are torch.compile's)")
        if t.grad_accum != 1:
            raise ValueError(f"train.cuda_graphs=true needs train.grad_accum=1 (a replay reuses the memory of the "
                             f"previous micro-batch's gradients), got {t.grad_accum}")
    if t.grad_clip is not None and not t.grad_clip > 0:
        raise ValueError(f"train.grad_clip must be > 0 or null, got {t.grad_clip!r}")
    if not t.lr > 0:
        raise ValueError(f"train.lr must be > 0, got {t.lr}")
    if not isinstance(t.log_grad_norm_per_layer, bool):
        raise ValueError(f"train.log_grad_norm_per_layer must be true or false, got {t.log_grad_norm_per_layer!r}")
    check_optimizer_config(cfg)
    check_scheduler_config(cfg.get("scheduler"))
    check_callbacks_config(cfg.get("callbacks"))
    check_evaluate_config(cfg.get("evaluate"))
    if cfg.logger.kind not in LOGGER_KINDS:
        raise ValueError(f"logger.kind must be one of {LOGGER_KINDS}, got {cfg.logger.kind!r}")
    if cfg.logger.kind == "tensorboard" and not any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):
        raise ValueError("logger=tensorboard needs the tensorboard package, which is not installed: "
                         "pip install tensorboard (or pip install 'attnlab[tensorboard]')")


def _target_and_settings(node, group: str):
    """(the object `_target_` names, the settings it is given) of a config built with `_partial_: true`."""
    if not OmegaConf.is_dict(node) or "_target_" not in node:
        raise ValueError(f"{group} must be a config with a `_target_` (configs/{group}/*.yaml), got {node!r}")
    if node.get("_partial_") is not True:
        raise ValueError(f"{group}._partial_ must be true ({group}._target_ is called later with its "
                         f"{'parameter groups' if group == 'optimizer' else 'step'}), got {node.get('_partial_')!r}")
    try:
        target = get_object(node._target_)
    except Exception as e:
        raise ValueError(f"{group}._target_={node._target_!r} does not import: {e}") from None
    settings = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not str(k).startswith("_")}
    return target, settings


def _check_takes(target, first_argument, settings: dict, group: str) -> None:
    try:
        inspect.signature(target).bind(first_argument, **settings)
    except TypeError as e:
        params = [p for p in inspect.signature(target).parameters][1:]
        raise ValueError(f"{group}: {getattr(target, '__qualname__', target)} does not take the settings "
                         f"{sorted(settings)} ({e}); it takes {params}") from None


def check_optimizer_config(cfg: DictConfig) -> None:
    target, settings = _target_and_settings(cfg.get("optimizer"), "optimizer")
    check_available = getattr(target, "check_available", None)  # e.g. Muon: torch.optim.Muon exists
    if check_available is not None:
        check_available()
    _check_takes(target, [], settings, "optimizer")
    strategy = cfg.trainer.get("strategy")
    sharded = OmegaConf.is_dict(strategy) and "FSDP" in str(strategy.get("_target_", ""))
    if sharded and getattr(target, "takes_hidden_matrix_group", False):
        raise ValueError(f"optimizer={cfg.optimizer._target_} does not run under an FSDP trainer: each rank holds a "
                         f"flat 1-D shard of every weight, and Muon needs whole 2-D matrices; use trainer=ddp or optimizer=adamw")


def check_scheduler_config(node) -> None:
    target, settings = _target_and_settings(node, "scheduler")
    _check_takes(target, 0, settings, "scheduler")
    target(0, **settings)  # the schedule checks its own settings (models/schedules.py), naming them


def check_callbacks_config(node) -> None:
    if node is None:
        return
    if not OmegaConf.is_dict(node):
        raise ValueError(f"callbacks must be a mapping of name -> callback config (configs/callbacks/), got {node!r}")
    for name, entry in node.items():
        if entry is None:  # left out
            continue
        if not OmegaConf.is_dict(entry) or "_target_" not in entry:
            raise ValueError(f"callbacks.{name} must be a config with a `_target_` (or null to leave it out), got {entry!r}")
        try:
            get_object(entry._target_)
        except Exception as e:
            raise ValueError(f"callbacks.{name}._target_={entry._target_!r} does not import: {e}") from None
        monitor = entry.get("monitor")
        if monitor is not None and monitor not in VALIDATION_METRICS:
            raise ValueError(f"callbacks.{name}.monitor must be one of {VALIDATION_METRICS} (logged at every "
                             f"validation), got {monitor!r}")
