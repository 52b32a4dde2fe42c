"""The run's loggers: a CSV log (one a resume in the same directory extends), tensorboard or wandb
(named by the run's label, grouped by experiment or sweep), and ending a job's wandb run."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from runs.wandb_quiet import wandb_init_settings, where_wandb_keeps
from training.quiet_logs import without_wandb_anonymous
from training.run_label import run_label


class ResumedCSVLogger(L.pytorch.loggers.CSVLogger):
    """Lightning's CSV logger, except that it keeps the rows of a metrics.csv already in its folder
    (a run resumed in its own directory; Lightning deletes that file) and appends after them. Steps
    between the checkpoint and the interruption appear twice; the later rows are the resumed run's."""

    @property
    @L.pytorch.loggers.logger.rank_zero_experiment
    def experiment(self):
        if self._experiment is None:
            path = Path(self.log_dir) / "metrics.csv"
            kept = path.read_text() if path.is_file() else None
            writer = super().experiment  # deletes the file
            if kept:
                path.write_text(kept)
                header = next(csv.reader([kept.splitlines()[0]]))
                writer.metrics_keys = sorted(header)  # as Lightning writes it: appended rows line up
        return self._experiment


def run_label_of(cfg: DictConfig) -> str:
    """The run's label (training/run_label.py) from the job's command-line overrides."""
    try:
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # composed outside @hydra.main (tests): no command line
        overrides = []
    return run_label(cfg.attn.name, overrides)


def wandb_group(cfg: DictConfig) -> str:
    """wandb group: the experiment/group name; in a multirun, one group per sweep."""
    try:
        hc = HydraConfig.get()
    except ValueError:  # composed outside @hydra.main (tests)
        return cfg.group
    if hc.mode.name == "MULTIRUN":
        return f"{cfg.group}-{Path(hc.sweep.dir).name}"
    return cfg.group


def build_loggers(cfg: DictConfig, output_dir: Path, resume_run_id: str | None, resuming: bool):
    csv_logger = ResumedCSVLogger if resuming else L.pytorch.loggers.CSVLogger
    loggers = [csv_logger(save_dir=str(output_dir), name="", version="csv")]
    if cfg.logger.kind == "tensorboard":  # check_config made sure tensorboard is installed
        loggers.append(L.pytorch.loggers.TensorBoardLogger(save_dir=str(output_dir), name="", version="tensorboard"))
    if cfg.logger.kind == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(without_wandb_anonymous(
            WandbLogger(
                project=cfg.logger.project, entity=cfg.logger.entity, offline=cfg.logger.offline,
                save_dir=str(output_dir), group=wandb_group(cfg), name=f"{run_label_of(cfg)}-s{cfg.seed}",
                tags=sorted({cfg.attn.name, run_label_of(cfg), f"seed{cfg.seed}"}),
                id=resume_run_id, resume="allow" if resume_run_id else None,
                config=OmegaConf.to_container(cfg, resolve=True), **wandb_init_settings(),
            )
        ))
    return loggers


def finish_wandb(loggers) -> str | None:
    """End this job's wandb run: the next job of an in-process multirun must start its own
    (Lightning's WandbLogger would otherwise reuse the active run). Returns where the run is
    (where_wandb_keeps), None without one."""
    for lg in loggers:
        if lg.__class__.__name__ == "WandbLogger" and lg._experiment is not None:
            lg.experiment.finish()
            return where_wandb_keeps(lg.experiment)
    return None
