"""What the eval commands share: the checkpoints `ckpt=` names loaded in turn, the data they are
evaluated on, devices and autocast, their result files, wandb.

A `ckpt=` argument may name
  - a checkpoint file (`.../checkpoints/best.ckpt`),
  - a run directory (the folder train.py wrote: `.hydra/`, `results.json`, `checkpoints/`),
    whose best checkpoint is used (`which=last` for the last one), or
  - a folder holding run directories (a multirun sweep), which evaluates every run in it
(runs/run.py reads them; runs/model.py rebuilds a checkpoint's model or refuses it).

A checkpoint carries its tokenizer (`data.tokenizers.tokenizer_record`): the eval commands use
it, and refuse a `data=` config whose tokenizer is another one, naming both. On the run's own data
config they tokenize with the checkpoint's tokenizer as it is (a BPE is never trained again), so
a run whose config would now train another tokenizer (an older attnlab's) still evaluates on the
tokens it was trained on.

Results go to the run directory's eval/ folder (`runs.run.eval_result_path`): `<run>/eval/<ckpt stem>.<kind>-<split>.json`,
and for a checkpoint outside a run directory beside the checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterable

import torch
from omegaconf import DictConfig, OmegaConf

from data.atomic import temp_file_beside
from data.tokenizers import Tokenizer, describe_tokenizer
from runs.config_dir import CONFIG_DIR  # absolute: the entry points find it however they are started
from runs.model import LoadedRun, load_run
from runs.run import resolve_checkpoints
from runs.wandb_quiet import wandb_init_settings, where_wandb_keeps

log = logging.getLogger("attnlab.eval")

PRECISIONS = ("auto", "32", "bf16", "fp16")


# ---------------------------------------------------------------------------- data


def data_config_for(run: LoadedRun, cfg: DictConfig) -> DictConfig:
    """The data config to evaluate on: the run's own (identical data and tokenizer) unless the
    eval command selected one with `data=<option>`. Interpolations such as ${model.context},
    ${paths.cache_dir} resolve against the run's config (or the eval config without one)."""
    override = cfg.get("data") if "data" in cfg else None
    run_config = run.run.config if run.run is not None else None
    if run_config is None and override is None:
        raise ValueError(
            f"checkpoint {run.checkpoint_path} is not inside a run directory with .hydra/config.yaml, so its "
            "data config is unknown: pass data=<option> (e.g. data=shakespeare) to the eval command"
        )
    # a plain-container copy of the root (eval or run config) whose `data` is replaced
    root = OmegaConf.to_container(run_config if run_config is not None else cfg, resolve=False)
    if run_config is None:
        # the eval config has no model/train keys the data presets interpolate: give them
        root.setdefault("model", {})["context"] = run.model_config.context
        root.setdefault("train", {}).update({"batch_size": 8, "val_tokens": 65536})
        root.setdefault("seed", 0)
    if override is not None:
        root["data"] = OmegaConf.to_container(override, resolve=False)
    paths = root.setdefault("paths", {})
    if "output_dir" in paths:
        del paths["output_dir"]  # ${hydra:...} cannot resolve outside the training job
    if cfg.get("cache_dir"):
        root["data"]["cache_dir"] = str(cfg.cache_dir)
    full = OmegaConf.create(root)
    return full.data


# the data modules an evaluation may build from a run's config (read as data, never as code)
DATAMODULES = {"data.datamodule.TokenDataModule"}
_HYDRA_KEYS = ("_target_", "_args_", "_partial_", "_convert_", "_recursive_")


def _refuse_code(node, where: str) -> None:
    """A run directory may come from someone else: no `_target_` (or other instantiation key)
    below the data module's own, since building it would run whatever it names."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _HYDRA_KEYS:
                raise ValueError(f"{where}.{key}: the data config may not name code to run ({value!r}); "
                                 "evaluation builds only the data module, from plain values")
            _refuse_code(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _refuse_code(value, f"{where}[{i}]")


def refuse_another_tokenizer(checkpoint_tokenizer: Tokenizer, data_tokenizer: Tokenizer | None,
                             data_kind: str | None = None) -> None:
    """A data config whose tokenizer is not the checkpoint's is refused, naming both. `data_tokenizer`
    None: the data config would train a tokenizer of kind `data_kind` (on its own corpus: another one)."""
    if data_tokenizer is not None and data_tokenizer.hash == checkpoint_tokenizer.hash:
        return
    theirs = (describe_tokenizer(data_tokenizer) if data_tokenizer is not None
              else f"a kind={data_kind} tokenizer not trained yet (evaluating would train one on its corpus)")
    raise ValueError(
        f"data/tokenizer mismatch: the checkpoint's tokenizer is {describe_tokenizer(checkpoint_tokenizer)}, the data "
        f"config's is {theirs}; evaluate on data tokenized with the checkpoint's tokenizer (leave data= out to use "
        "the run's own data config)"
    )


def build_datamodule(data_cfg: DictConfig, use_tokenizer: Tokenizer | None = None,
                     checkpoint_tokenizer: Tokenizer | None = None):
    """Construct (from an allow-list, with plain values only; with `use_tokenizer`, that tokenizer
    instead of the config's), prepare (builds or verifies the token cache) and set up the data module.
    With `checkpoint_tokenizer`, a data config whose tokenizer is another one is refused first, before
    a tokenizer is trained or a corpus tokenized."""
    from data.datamodule import TokenDataModule

    values = OmegaConf.to_container(data_cfg, resolve=True)
    target = values.pop("_target_", None)
    if target not in DATAMODULES:
        raise ValueError(f"data._target_ must be one of {sorted(DATAMODULES)} (evaluation runs no other code "
                         f"named in a run's config), got {target!r}")
    _refuse_code(values, "data")
    datamodule = TokenDataModule(**values, use_tokenizer=use_tokenizer)
    if checkpoint_tokenizer is not None:
        refuse_another_tokenizer(checkpoint_tokenizer, datamodule.tokenizer_without_training(),
                                 datamodule.tokenizer_config["kind"])
    datamodule.prepare_data()
    datamodule.setup("test")
    return datamodule


# ---------------------------------------------------------------------------- devices


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name} but CUDA is not available; use device=cpu or device=auto")
    return device


def autocast(device: torch.device, precision: str):
    """bf16 autocast on CUDA by default (as in training), fp32 on CPU."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "32"
    if precision == "32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


# ---------------------------------------------------------------------------- outputs


def write_json(path: Path, payload: Any) -> None:
    """Atomic write (temp file + rename): a crash never leaves a half-written result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=2, default=_json_default, allow_nan=True)
    fd, tmp = temp_file_beside(path, f".{path.name}.", ".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


MAX_TAG_CHARS = 80


def settings_tag(cfg: DictConfig, command: str, keys: Iterable[str]) -> str:
    """The result-affecting settings of `cfg` that differ from eval command `command`'s defaults
    (configs/eval/<command>.yaml over common.yaml), as `key=value` joined by `_` in the order of
    `keys` ("" at the defaults); a data=<option> adds data=<source kind>. Longer than
    MAX_TAG_CHARS: a hash of it instead."""
    folder = Path(CONFIG_DIR) / "eval"
    defaults = OmegaConf.merge(*(OmegaConf.load(folder / f"{name}.yaml") for name in ("common", command)))
    parts = []
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if value != OmegaConf.select(defaults, key):
            value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            text = "-".join(map(str, value)) if isinstance(value, list) else str(value)
            parts.append(f"{key}={text}")
    source = OmegaConf.select(cfg, "data.source.kind")
    if source is not None:
        parts.append(f"data={source}")
    tag = "_".join(parts)
    tag = "".join(c if c.isalnum() or c in "=-._" else "-" for c in tag)
    if len(tag) > MAX_TAG_CHARS:
        tag = "settings-" + hashlib.sha256(tag.encode()).hexdigest()[:12]
    return tag


def eval_config_record(cfg: DictConfig, data_cfg: DictConfig | None = None) -> dict:
    """The eval command's own resolved config and command-line overrides, stored with its result.
    `data` is the data config actually used (the run's, or the one data=<option> selected, resolved
    against the run's config); a data= group alone cannot resolve its ${model.context}-style keys."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra", None)
    plain.pop("data", None)
    record = OmegaConf.to_container(OmegaConf.create(plain), resolve=True)
    record["data"] = OmegaConf.to_container(data_cfg, resolve=True) if data_cfg is not None else None
    overrides = None
    with contextlib.suppress(Exception):
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    return {"config": record, "overrides": overrides}


def finite_or_none(x: float) -> float | None:
    return x if x is not None and math.isfinite(x) else None


# ---------------------------------------------------------------------------- wandb


def wandb_enabled(run: LoadedRun, cfg: DictConfig) -> bool:
    enabled = cfg.wandb.enabled
    if enabled == "auto":
        return bool(run.run is not None and run.run.config is not None
                    and OmegaConf.select(run.run.config, "logger.kind") == "wandb")
    if not isinstance(enabled, bool):
        raise ValueError(f"wandb.enabled must be auto, true or false, got {enabled!r}")
    return enabled


def start_wandb(run: LoadedRun, cfg: DictConfig, job_type: str, extra_config: dict | None = None):
    """A wandb run in the training run's group (offline unless configured otherwise), or None."""
    if not wandb_enabled(run, cfg):
        return None
    try:
        import wandb
    except ImportError:
        log.warning("wandb is not installed: skipping wandb logging (results are in the JSON file)")
        return None
    run_config = run.run.config if run.run is not None else None
    run_logger = OmegaConf.select(run_config, "logger", default=None) if run_config is not None else None
    offline = cfg.wandb.offline
    if offline is None:
        offline = bool(run_logger.get("offline", True)) if run_logger is not None else True
    project = cfg.wandb.project or (run_logger.get("project") if run_logger is not None else None) or "attnlab"
    entity = run_logger.get("entity") if run_logger is not None else None
    save_dir = run.run.dir if run.run is not None else run.checkpoint_path.parent
    seed = run.seed
    return wandb.init(
        project=project,
        entity=entity,
        group=run.run.wandb_group if run.run is not None else None,
        job_type=job_type,
        name=f"{run.variant}-s{seed}-{job_type}" if seed is not None else f"{run.variant}-{job_type}",
        tags=[run.variant, f"seed{seed}", job_type],
        dir=str(save_dir),
        mode="offline" if offline else "online",
        config={"eval": extra_config or {}, "model": run.describe()},
        **wandb_init_settings(),
    )


def finish_wandb(wb) -> None:
    """End an eval's wandb run (start_wandb) with one line saying where it is (wandb's own run
    summary block prints only with -v)."""
    wb.finish()
    log.info("logged to %s", where_wandb_keeps(wb))


def iter_runs(cfg: DictConfig, device: torch.device) -> Iterable[LoadedRun]:
    """Load each checkpoint named by cfg.ckpt in turn (one model in memory at a time)."""
    paths = resolve_checkpoints(cfg.get("ckpt"), cfg.get("which", "best"))
    if cfg.get("out") and len(paths) > 1:
        raise ValueError(f"out= names one file but ckpt= gives {len(paths)} checkpoints; leave out= unset")
    for path in paths:
        yield load_run(path, device=device, backend=cfg.get("backend"))


class DataModuleCache:
    """One data module per distinct data config: a sweep's runs share their data, load it once."""

    def __init__(self):
        self._modules: dict[str, Any] = {}

    def get(self, data_cfg: DictConfig, vocab_size: int | None = None, tokenizer: Tokenizer | None = None,
            own_config: bool = False):
        """The data module of `data_cfg`; refused when its tokenizer is not `tokenizer` (the
        checkpoint's) or, for a checkpoint without one, its vocabulary size is not `vocab_size`.
        `own_config` (data_cfg is the run's own): tokenized with `tokenizer` itself."""
        given = tokenizer if own_config else None
        key = json.dumps([OmegaConf.to_container(data_cfg, resolve=True), given.hash if given else None],
                         sort_keys=True, default=str)
        if key not in self._modules:
            self._modules[key] = build_datamodule(data_cfg, use_tokenizer=given, checkpoint_tokenizer=tokenizer)
        datamodule = self._modules[key]
        if tokenizer is not None:
            refuse_another_tokenizer(tokenizer, datamodule.tokenizer)
        if vocab_size is not None and datamodule.vocab_size != vocab_size:
            raise ValueError(
                f"data/tokenizer mismatch: the data config gives vocabulary size {datamodule.vocab_size}, "
                f"the checkpoint's model has {vocab_size}; evaluate with the data config it was trained on"
            )
        return datamodule

    def for_run(self, run: LoadedRun, data_cfg: DictConfig, cfg: DictConfig):
        """The data module of data_config_for(run, cfg) (`data_cfg`), checked against the checkpoint."""
        return self.get(data_cfg, run.model_config.vocab_size, run.tokenizer, own_config=cfg.get("data") is None)


def tokenizer_for_run(run: LoadedRun, cfg: DictConfig) -> tuple[Tokenizer, DictConfig | None]:
    """(tokenizer, data config used or None). The checkpoint's tokenizer, checked against the
    data= config when one is given; for a checkpoint that does not record its tokenizer, the
    tokenizer of the run's data config (or of data=)."""
    if run.tokenizer is not None and cfg.get("data") is None:
        return run.tokenizer, None
    data_cfg = data_config_for(run, cfg)
    return DataModuleCache().for_run(run, data_cfg, cfg).tokenizer, data_cfg


def versions() -> dict:
    """Software versions and the code commit, stored with every result."""
    import platform
    import subprocess

    info = {"python": platform.python_version(), "torch": torch.__version__}
    with contextlib.suppress(Exception):
        import triton

        info["triton"] = triton.__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    with contextlib.suppress(Exception):
        root = Path(__file__).resolve().parent.parent
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        ).stdout.strip() or None
    return info

