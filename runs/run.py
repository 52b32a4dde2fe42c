"""A training run's directory, as train.py writes it and every reader reads it:

    <run>/.hydra/config.yaml     the run's composed config (hydra.yaml: Hydra's own, overrides.yaml)
    <run>/results.json           what the run recorded at its end (variant, label, seed, wandb group, ...)
    <run>/checkpoints/*.ckpt     its checkpoints (best and last; runs/checkpoints.py reads and writes them)
    <run>/csv/metrics.csv        its metric log (logger=csv)
    <run>/eval/                  the eval commands' results of its checkpoints (older runs: in checkpoints/)

`Run.open(path)` takes a run directory or a checkpoint inside one; `runs_in(path)` the runs of a sweep
folder (or the run a path is); `resolve_checkpoints` the checkpoint files an eval command's `ckpt=` names.
"""

from __future__ import annotations

import json
import logging
import os
from functools import cached_property
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from data.atomic import atomic_write_text

log = logging.getLogger("attnlab.runs")

CHECKPOINT_CHOICES = ("best", "last")
EVAL_FOLDER = "eval"  # <run>/eval/: the eval commands' results of the run's checkpoints
# where a run directory holds its eval JSONs: eval/, and checkpoints/ in runs evaluated by an attnlab
# that wrote them beside the checkpoints
EVAL_FOLDERS = (EVAL_FOLDER, "checkpoints")


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "results.json").is_file() or (path / "checkpoints").is_dir())


class Run:
    """One training run's directory. Its config and results are read when first asked for (and may
    be given instead, as a test does)."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)

    def __repr__(self) -> str:
        return f"Run({str(self.dir)!r})"

    @classmethod
    def open(cls, path: str | os.PathLike) -> Run:
        """The run `path` names: a run directory, or a checkpoint file inside one."""
        path = Path(path)
        if path.is_file():
            run = cls.of_checkpoint(path)
            if run is None:
                raise FileNotFoundError(f"checkpoint {path} is not inside a run directory (<run>/checkpoints/{path.name})")
            return run
        if not path.exists():
            raise FileNotFoundError(f"no such file or directory: {path}")
        if not is_run_dir(path):
            raise FileNotFoundError(f"{path} is not a training run (it holds no results.json or checkpoints/)")
        return cls(path)

    @classmethod
    def of_checkpoint(cls, checkpoint_path: Path) -> Run | None:
        """train.py writes <run>/checkpoints/<name>.ckpt; the run is recognised by its .hydra/ or results.json."""
        candidate = Path(checkpoint_path).resolve().parent.parent
        if (candidate / ".hydra" / "config.yaml").is_file() or (candidate / "results.json").is_file():
            return cls(candidate)
        return None

    # ------------------------------------------------------------------------ what the run recorded

    @cached_property
    def config(self) -> DictConfig | None:
        """The run's composed config (.hydra/config.yaml) as plain data, unresolved; None without one.
        Nothing in it is instantiated here: whoever builds from it refuses the code it names."""
        config_file = self.dir / ".hydra" / "config.yaml"
        return OmegaConf.load(config_file) if config_file.is_file() else None

    @cached_property
    def results(self) -> dict | None:
        """The run's results.json, or None where there is none or it cannot be read (an empty one, left by a
        kill while an older attnlab wrote it): the run's checkpoints are evaluated all the same, after a
        warning naming the file."""
        path = self.dir / "results.json"
        if not path.is_file():
            return None
        try:
            results = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            log.warning("%s is not valid JSON (%s): evaluating the run without it", path, e)
            return None
        return results if isinstance(results, dict) else None

    def write_results(self, results: dict) -> None:
        """results.json replaced atomically: a kill or a full disk during the write leaves the previous
        file, never an empty one."""
        atomic_write_text(self.dir / "results.json", json.dumps(results, indent=2))

    @property
    def seed(self) -> int | None:
        if self.results and "seed" in self.results:
            return self.results["seed"]
        if self.config is not None and "seed" in self.config:
            return self.config.seed
        return None

    @property
    def label(self) -> str | None:
        """The run's label (its variant and its own overridden settings, training/run_label.py) when
        recorded, else its variant."""
        results = self.results or {}
        return results.get("label") or results.get("variant")

    @property
    def wandb_group(self) -> str | None:
        """The run's wandb group: results.json's `wandb_group` when recorded, else derived as train.py
        does (`<group>` for a single run, `<group>-<sweep folder>` in a multirun)."""
        if self.results and self.results.get("wandb_group"):
            return self.results["wandb_group"]
        if self.config is None:
            return None
        group = self.config.get("group")
        hydra_file = self.dir / ".hydra" / "hydra.yaml"
        if group and hydra_file.is_file():
            hydra_cfg = OmegaConf.load(hydra_file).hydra
            if str(hydra_cfg.get("mode")) == "MULTIRUN":
                sweep = OmegaConf.to_container(hydra_cfg.sweep, resolve=False) if "sweep" in hydra_cfg else {}
                sweep_dir = str(sweep.get("dir") or "")
                if not sweep_dir or "${" in sweep_dir:
                    # the saved sweep dir still holds ${now:...}: walk up from the job's folder instead,
                    # one level per path component of the job's subdir
                    subdir = str(sweep.get("subdir") or "job").strip("/")
                    output_dir = OmegaConf.select(hydra_cfg, "runtime.output_dir", default=None)
                    job_dir = Path(output_dir) if output_dir else self.dir
                    sweep_dir = job_dir.parents[subdir.count("/")]
                return f"{group}-{Path(sweep_dir).name}"
        return group

    def previous_files(self) -> list[str]:
        """What a run left here that a fresh run would replace: its results, checkpoints and metric log
        (Hydra's own files and logs are not a run's results)."""
        found = []
        if (self.dir / "results.json").is_file():
            found.append("results.json")
        checkpoints = sorted(p.name for p in (self.dir / "checkpoints").glob("*.ckpt"))
        if checkpoints:
            found.append(f"checkpoints/ ({', '.join(checkpoints[:3])}{', ...' if len(checkpoints) > 3 else ''})")
        if (self.dir / "csv" / "metrics.csv").is_file():
            found.append("csv/metrics.csv")
        return found

    # ------------------------------------------------------------------------ checkpoints

    @property
    def last_checkpoint_path(self) -> Path:
        """Where the run's newest checkpoint is written (whether or not it exists yet)."""
        return self.dir / "checkpoints" / "last.ckpt"

    def checkpoint(self, which: str = "best") -> Path:
        """The run's best (or last) checkpoint file in the run directory itself, wherever it was moved or
        copied; best falls back to last when there is none."""
        if which not in CHECKPOINT_CHOICES:
            raise ValueError(f"which must be one of {CHECKPOINT_CHOICES}, got {which!r}")
        candidates = []
        results = self.results or {}
        key = f"{which}_checkpoint"
        if results.get(key):
            # only the recorded file's name: its absolute path is where the run was trained, and a moved or
            # copied run directory must be evaluated from its own files (the original may have trained on)
            candidates.append(self.dir / "checkpoints" / Path(results[key]).name)
        candidates.append(self.dir / "checkpoints" / f"{which}.ckpt")
        if which == "best":
            candidates.append(self.dir / "checkpoints" / "last.ckpt")
        for path in candidates:
            if path.is_file():
                return path
        raise FileNotFoundError(
            f"run directory {self.dir} has no {which} checkpoint (looked for {[str(c) for c in candidates]})"
        )

    def tokenizer(self, which: str = "best"):
        """The tokenizer the run's best (or last) checkpoint records (None in checkpoints that do not)."""
        from runs.checkpoints import checkpoint_tokenizer, load_checkpoint

        path = self.checkpoint(which)
        return checkpoint_tokenizer(load_checkpoint(path), path)

    # ------------------------------------------------------------------------ evaluations

    @property
    def eval_dir(self) -> Path:
        return self.dir / EVAL_FOLDER

    def eval_result(self, kind: str, split: str) -> dict | None:
        """The eval JSON of kind `kind` (perplexity, attention) of the run's best checkpoint (else of any
        checkpoint) for `split`, from eval/ or (older runs) checkpoints/: eval/ first for each name."""
        results = self.results or {}
        names = []
        if results.get("best_checkpoint"):
            names.append(f"{Path(results['best_checkpoint']).stem}.{kind}-{split}.json")
        names += [f"best.{kind}-{split}.json", f"last.{kind}-{split}.json"]
        folders = [self.dir / name for name in EVAL_FOLDERS]
        names += sorted({path.name for folder in folders for path in folder.glob(f"*.{kind}-{split}.json")})
        for name in names:
            for folder in folders:
                if (folder / name).is_file():
                    return json.loads((folder / name).read_text())
        return None


def runs_in(root: str | os.PathLike) -> list[Run]:
    """The run `root` is, or else the runs below it (a sweep folder; sorted by directory)."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no such file or directory: {root}")
    if is_run_dir(root):
        return [Run(root)]
    found = sorted({p.parent for p in root.rglob("results.json")} | {p.parent for p in root.rglob("checkpoints")})
    found = [Run(r) for r in found if is_run_dir(r)]
    if not found:
        raise FileNotFoundError(
            f"{root} holds no training run (looked for results.json or checkpoints/ in it and below it)"
        )
    return found


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
    return [run.checkpoint(which) for run in runs_in(path)]


def eval_dir_of(checkpoint_path: Path) -> Path:
    """Where the results of evaluating `checkpoint_path` go: the eval/ folder of the run directory it
    belongs to (`Run.of_checkpoint`), or the checkpoint's own folder for a checkpoint outside a run directory."""
    run = Run.of_checkpoint(checkpoint_path)
    return run.eval_dir if run is not None else checkpoint_path.parent


def eval_result_path(checkpoint_path: Path, kind: str, split: str, out: str | None = None, suffix: str = ".json",
                     settings: str = "") -> Path:
    """Results live in the run's eval/ folder (`eval_dir_of`): <ckpt stem>.<kind>-<split>.json for the
    command's default settings, <ckpt stem>.<kind>-<split>.<settings>.json for others (the eval
    commands' settings tag), so an eval with other settings never overwrites one with the defaults;
    `out` when given."""
    if out:
        return Path(out)
    tag = f".{settings}" if settings else ""
    return eval_dir_of(checkpoint_path) / f"{checkpoint_path.stem}.{kind}-{split}{tag}{suffix}"


def run_dir_to_resume_in(ckpt_path: str | None) -> Path | None:
    """The run directory a checkpoint that a run resumes from belongs to (<run>/checkpoints/<name>.ckpt
    beside the run's results.json or csv/ log), else None."""
    if not ckpt_path or ckpt_path == "auto":
        return None
    path = Path(ckpt_path)
    run = path.parent.parent
    if path.is_file() and path.parent.name == "checkpoints" and ((run / "results.json").is_file() or (run / "csv").is_dir()):
        return run.resolve()
    return None
