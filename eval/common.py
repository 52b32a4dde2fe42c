"""What every eval command shares: finding and loading a trained run, its data, its wandb group.

A `ckpt=` argument may name
  - a checkpoint file (`.../checkpoints/best.ckpt`),
  - a run directory (the folder train.py wrote: `.hydra/`, `results.json`, `checkpoints/`),
    whose best checkpoint is used (`which=last` for the last one), or
  - a folder holding run directories (a multirun sweep), which evaluates every run in it.

Checkpoints are read with `training.checkpoint_io.load_checkpoint` (weights_only=True, never
unpickling code). A checkpoint that this attnlab cannot rebuild (unknown variant, unknown or
missing config fields, weights that do not fit the model) is refused with a ValueError that
names the file and what does not match.

A checkpoint carries its tokenizer (`data.tokenizers.tokenizer_record`): the eval commands use
it, and refuse a `data=` config whose tokenizer is another one, naming both. On the run's own data
config they tokenize with the checkpoint's tokenizer as it is (a BPE is never trained again), so
a run whose config would now train another tokenizer (an older attnlab's) still evaluates on the
tokens it was trained on.

Results go to the run directory's eval/ folder (`output_path`): `<run>/eval/<ckpt stem>.<kind>-<split>.json`,
and for a checkpoint outside a run directory beside the checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from omegaconf import DictConfig, OmegaConf

import attn
from data.atomic import temp_file_beside
from data.tokenizers import Tokenizer, describe_tokenizer, tokenizer_from_record
from training.checkpoint_io import load_checkpoint
from training.config_dir import CONFIG_DIR  # absolute: the entry points find it however they are started
from training.quiet_logs import wandb_init_settings, where_wandb_keeps
from models.gpt import GPT, GPTConfig
from models.lit import gpt_config_from_dict

log = logging.getLogger("attnlab.eval")

CHECKPOINT_CHOICES = ("best", "last")
PRECISIONS = ("auto", "32", "bf16", "fp16")


@dataclass
class LoadedRun:
    """A trained model rebuilt from its checkpoint, with whatever the run directory adds."""

    model: GPT
    model_config: GPTConfig
    checkpoint_path: Path
    hparams: dict
    run_dir: Path | None  # the training run's directory, when the checkpoint sits in one
    run_config: DictConfig | None  # the run's composed config (.hydra/config.yaml), unresolved
    results: dict | None  # the run's results.json
    global_step: int | None
    tokens_seen: int | None
    tokenizer: Tokenizer | None = None  # the checkpoint's own; None in checkpoints that do not record it

    @property
    def variant(self) -> str:
        return self.model_config.attn.name

    @property
    def family(self) -> str:
        return attn.get_variant(self.variant).family

    @property
    def seed(self) -> int | None:
        if self.results and "seed" in self.results:
            return self.results["seed"]
        if self.run_config is not None and "seed" in self.run_config:
            return self.run_config.seed
        return None

    def describe(self) -> dict:
        """Identity of the evaluated model, stored in every eval JSON."""
        return {
            "checkpoint": str(self.checkpoint_path),
            "run_dir": str(self.run_dir) if self.run_dir else None,
            "variant": self.variant,
            "family": self.family,
            "seed": self.seed,
            "global_step": self.global_step,
            "tokens_seen": self.tokens_seen,
            "params": self.model.num_params(),
            "training_context": self.model_config.context,
            "tokenizer": self.tokenizer.describe() if self.tokenizer is not None else None,
        }


# ---------------------------------------------------------------------------- finding runs


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "results.json").is_file() or (path / "checkpoints").is_dir())


def find_run_dirs(root: str | os.PathLike) -> list[Path]:
    """`root` itself when it is a run directory, else the run directories below it (sorted)."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no such file or directory: {root}")
    if is_run_dir(root):
        return [root]
    runs = sorted({p.parent for p in root.rglob("results.json")} | {p.parent for p in root.rglob("checkpoints")})
    runs = [r for r in runs if is_run_dir(r)]
    if not runs:
        raise FileNotFoundError(
            f"{root} holds no training run (looked for results.json or checkpoints/ in it and below it)"
        )
    return runs


def checkpoint_of_run(run_dir: Path, which: str = "best") -> Path:
    """The run's best (or last) checkpoint file in the run directory itself, wherever it was moved or
    copied; best falls back to last when there is none."""
    if which not in CHECKPOINT_CHOICES:
        raise ValueError(f"which must be one of {CHECKPOINT_CHOICES}, got {which!r}")
    candidates = []
    results = read_run_results(run_dir) or {}
    key = f"{which}_checkpoint"
    if results.get(key):
        # only the recorded file's name: its absolute path is where the run was trained, and a moved or
        # copied run directory must be evaluated from its own files (the original may have trained on)
        candidates.append(run_dir / "checkpoints" / Path(results[key]).name)
    candidates.append(run_dir / "checkpoints" / f"{which}.ckpt")
    if which == "best":
        candidates.append(run_dir / "checkpoints" / "last.ckpt")
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"run directory {run_dir} has no {which} checkpoint (looked for {[str(c) for c in candidates]})"
    )


def resolve_checkpoints(ckpt: Any, which: str = "best") -> list[Path]:
    """Checkpoint files named by `ckpt`: a file, a run directory, a sweep folder, or a list of them."""
    if ckpt is None or ckpt == "" or ckpt == "???":
        raise ValueError("ckpt=... is required: a checkpoint file, a run directory or a folder of runs")
    if isinstance(ckpt, (list, tuple)) or OmegaConf.is_list(ckpt):
        return [p for item in ckpt for p in resolve_checkpoints(item, which)]
    path = Path(os.path.expanduser(str(ckpt)))
    if path.is_file():
        return [path]
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path} (ckpt= takes a .ckpt file, a run directory or a folder of runs)")
    return [checkpoint_of_run(run, which) for run in find_run_dirs(path)]


def run_dir_of(checkpoint_path: Path) -> Path | None:
    """train.py writes <run>/checkpoints/<name>.ckpt; the run is recognised by its .hydra/ or results.json."""
    candidate = checkpoint_path.resolve().parent.parent
    if (candidate / ".hydra" / "config.yaml").is_file() or (candidate / "results.json").is_file():
        return candidate
    return None


def read_run_results(run_dir: Path) -> dict | None:
    """The run's results.json, or None where there is none or it cannot be read (an empty one, left by a
    kill while an older attnlab wrote it): the run's checkpoints are evaluated all the same, after a
    warning naming the file."""
    path = run_dir / "results.json"
    if not path.is_file():
        return None
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        log.warning("%s is not valid JSON (%s): evaluating the run without it", path, e)
        return None
    return results if isinstance(results, dict) else None


# ---------------------------------------------------------------------------- loading models


def _state_dict_of_model(state_dict: dict, path: Path) -> dict:
    """LitGPT saves the GPT under the `model.` prefix."""
    inner = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
    if not inner:
        raise ValueError(
            f"checkpoint {path} has no GPT weights (no state_dict key starts with 'model.'; "
            f"found e.g. {sorted(state_dict)[:5]})"
        )
    return inner


def build_model_from_checkpoint(ckpt: dict, path: Path, backend: str | None = None) -> tuple[GPT, GPTConfig]:
    """Rebuild the GPT a checkpoint was trained with and load its weights, or explain why not."""
    hparams = ckpt["hyper_parameters"]
    model_dict = hparams.get("model") if isinstance(hparams, dict) else None
    if not isinstance(model_dict, dict):
        raise ValueError(f"checkpoint {path} is not an attnlab GPT checkpoint: hyper_parameters has no 'model' dict")
    model, cfg = build_model_from_config(model_dict, f"checkpoint {path}", backend)
    weights = _state_dict_of_model(ckpt["state_dict"], path)
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"checkpoint {path}: weights do not fit the model its config describes: {e}") from e
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model its config describes: "
            f"missing weights {list(missing)[:8]}, unexpected weights {list(unexpected)[:8]}"
        )
    return model.eval(), cfg


def build_model_from_config(model_dict: dict, where: str, backend: str | None = None) -> tuple[GPT, GPTConfig]:
    """A GPT (freshly initialized) from a plain model-config dict (GPTConfig's fields, `attn` a
    dict of AttnConfig's); `where` names the config's file in the errors."""
    model_dict = dict(model_dict)
    attn_dict = dict(model_dict.get("attn") or {})
    name = attn_dict.get("name", "softmax")
    if name not in attn.variant_names():
        raise ValueError(
            f"{where} was trained with attention variant {name!r}, which this attnlab does not "
            f"register; registered variants: {attn.variant_names()}"
        )
    if backend is not None:
        attn_dict["backend"] = backend
    model_dict["attn"] = attn_dict
    try:
        cfg = gpt_config_from_dict(model_dict)
    except TypeError as e:  # unknown or missing dataclass fields
        raise ValueError(f"{where} has a model config this attnlab cannot build ({e})") from e
    try:
        model = GPT(cfg)
    except ValueError as e:
        raise ValueError(f"{where} has an invalid model config: {e}") from e
    return model, cfg


def load_run(path: str | os.PathLike, device: str | torch.device = "cpu", backend: str | None = None) -> LoadedRun:
    """Load one checkpoint file into a GPT in eval mode, plus its run directory's config and results."""
    path = Path(path)
    ckpt = load_checkpoint(path)  # FileNotFoundError / ValueError with the file named
    model, cfg = build_model_from_checkpoint(ckpt, path, backend)
    tokenizer = None
    if ckpt.get("tokenizer") is not None:
        tokenizer = tokenizer_from_record(ckpt["tokenizer"], f"checkpoint {path}")
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"checkpoint {path}: its tokenizer has {tokenizer.vocab_size} tokens, more than the "
                             f"model's vocabulary ({cfg.vocab_size})")
    run_dir = run_dir_of(path)
    run_config = None
    results = None
    if run_dir is not None:
        config_file = run_dir / ".hydra" / "config.yaml"
        if config_file.is_file():
            run_config = OmegaConf.load(config_file)
        results = read_run_results(run_dir)
    return LoadedRun(
        model=model.to(device),
        model_config=cfg,
        checkpoint_path=path,
        hparams=ckpt["hyper_parameters"],
        run_dir=run_dir,
        run_config=run_config,
        results=results,
        global_step=ckpt.get("global_step"),
        tokens_seen=ckpt.get("tokens_seen"),
        tokenizer=tokenizer,
    )


# ---------------------------------------------------------------------------- data


def data_config_for(run: LoadedRun, cfg: DictConfig) -> DictConfig:
    """The data config to evaluate on: the run's own (identical data and tokenizer) unless the
    eval command selected one with `data=<option>`. Interpolations such as ${model.context},
    ${paths.cache_dir} resolve against the run's config (or the eval config without one)."""
    override = cfg.get("data") if "data" in cfg else None
    if run.run_config is None and override is None:
        raise ValueError(
            f"checkpoint {run.checkpoint_path} is not inside a run directory with .hydra/config.yaml, so its "
            "data config is unknown: pass data=<option> (e.g. data=shakespeare) to the eval command"
        )
    # a plain-container copy of the root (eval or run config) whose `data` is replaced
    root = OmegaConf.to_container(run.run_config if run.run_config is not None else cfg, resolve=False)
    if run.run_config is None:
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


EVAL_FOLDER = "eval"  # <run>/eval/: the eval commands' results of the run's checkpoints


def eval_dir_of(checkpoint_path: Path) -> Path:
    """Where the results of evaluating `checkpoint_path` go: the eval/ folder of the run directory it
    belongs to (`run_dir_of`), or the checkpoint's own folder for a checkpoint outside a run directory."""
    run_dir = run_dir_of(checkpoint_path)
    return run_dir / EVAL_FOLDER if run_dir is not None else checkpoint_path.parent


def output_path(checkpoint_path: Path, kind: str, split: str, out: str | None = None, suffix: str = ".json",
                settings: str = "") -> Path:
    """Results live in the run's eval/ folder (`eval_dir_of`): <ckpt stem>.<kind>-<split>.json for the
    command's default settings, <ckpt stem>.<kind>-<split>.<settings>.json for others (`settings_tag`),
    so an eval with other settings never overwrites one with the defaults; `out` when given."""
    if out:
        return Path(out)
    tag = f".{settings}" if settings else ""
    return eval_dir_of(checkpoint_path) / f"{checkpoint_path.stem}.{kind}-{split}{tag}{suffix}"


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


def wandb_group(run: LoadedRun) -> str | None:
    """The training run's wandb group: results.json's `wandb_group` when recorded, else derived
    as train.py does (`<group>` for a single run, `<group>-<sweep folder>` in a multirun)."""
    if run.results and run.results.get("wandb_group"):
        return run.results["wandb_group"]
    if run.run_config is None:
        return None
    group = run.run_config.get("group")
    hydra_file = run.run_dir / ".hydra" / "hydra.yaml" if run.run_dir else None
    if group and hydra_file is not None and hydra_file.is_file():
        hydra_cfg = OmegaConf.load(hydra_file).hydra
        if str(hydra_cfg.get("mode")) == "MULTIRUN":
            sweep = OmegaConf.to_container(hydra_cfg.sweep, resolve=False) if "sweep" in hydra_cfg else {}
            sweep_dir = str(sweep.get("dir") or "")
            if not sweep_dir or "${" in sweep_dir:
                # the saved sweep dir still holds ${now:...}: walk up from the job's folder instead,
                # one level per path component of the job's subdir
                subdir = str(sweep.get("subdir") or "job").strip("/")
                output_dir = OmegaConf.select(hydra_cfg, "runtime.output_dir", default=None)
                job_dir = Path(output_dir) if output_dir else run.run_dir
                sweep_dir = job_dir.parents[subdir.count("/")]
            return f"{group}-{Path(sweep_dir).name}"
    return group


def wandb_enabled(run: LoadedRun, cfg: DictConfig) -> bool:
    enabled = cfg.wandb.enabled
    if enabled == "auto":
        return bool(run.run_config is not None and OmegaConf.select(run.run_config, "logger.kind") == "wandb")
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
    run_logger = OmegaConf.select(run.run_config, "logger", default=None) if run.run_config is not None else None
    offline = cfg.wandb.offline
    if offline is None:
        offline = bool(run_logger.get("offline", True)) if run_logger is not None else True
    project = cfg.wandb.project or (run_logger.get("project") if run_logger is not None else None) or "attnlab"
    entity = run_logger.get("entity") if run_logger is not None else None
    save_dir = run.run_dir or run.checkpoint_path.parent
    seed = run.seed
    return wandb.init(
        project=project,
        entity=entity,
        group=wandb_group(run),
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

