"""What a training run does with its directory (runs/run.py reads it): a lock against a second live run, no
fresh run over an earlier one, Hydra's record written once the run holds the directory, its log files
following a resume into the checkpoint's run directory, and no directory left by a run that never
started (docs/reliability.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

from runs.run import Run
from training.callbacks.checkpoints import PREEMPTED_EXIT_CODE


class RunDirectoryLock:
    """An exclusive lock on <run dir>/.run.lock for the run's lifetime: a second live run given the
    same directory stops at once, naming the holder, instead of mixing checkpoints and logs (or
    crashing mid-run). Released by the OS when the holding process ends, however it ends."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".run.lock"
        self._handle = None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # non-POSIX: no lock
            return self
        self._handle = open(self.path, "a+")
        try:
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._handle.seek(0)
            holder = self._handle.read().strip() or "unknown"
            self._handle.close()
            raise ValueError(f"run directory {self.path.parent} is in use by another live run (pid {holder}); "
                             "give this run another hydra.run.dir, or wait for that one to end") from None
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(str(os.getpid()))
        self._handle.flush()
        return self

    def __exit__(self, *exc):
        if self._handle is not None:
            self._handle.close()  # closing releases the lock


def refuse_replacing_a_run(run_dir: Path, ckpt_path: str | None, overwrite: bool) -> None:
    """A fresh run (no ckpt_path) into a directory that holds a run would replace its checkpoints and
    logs: refused, naming the directory and the ways on, unless train.overwrite=true."""
    if ckpt_path or overwrite:
        return
    found = Run(run_dir).previous_files()
    if found:
        raise ValueError(f"run directory {run_dir} already holds a run ({'; '.join(found)}): resume it with "
                         "ckpt_path=auto, give this run a new hydra.run.dir, or replace it with train.overwrite=true")


def write_hydra_record(task_cfg) -> Path | None:
    """Write Hydra's record of this invocation (.hydra/config.yaml, hydra.yaml, overrides.yaml in its
    output directory, as Hydra writes them) now that the run holds its directory: configs/train.yaml
    sets hydra.output_subdir to null so that Hydra does not write them before the directory lock and
    the refusals (a refused run rewrote the record of the live or finished run there). `task_cfg`: the
    composed config as the task received it. None (nothing written) outside @hydra.main or where
    hydra.output_subdir names a folder (Hydra wrote it)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized() or HydraConfig.get().output_subdir is not None:
        return None
    hydra_cfg = HydraConfig.instance().cfg
    folder = Path(hydra_cfg.hydra.runtime.output_dir) / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in (("config.yaml", task_cfg), ("hydra.yaml", hydra_cfg),
                          ("overrides.yaml", hydra_cfg.hydra.overrides.task)):
        (folder / name).write_text(OmegaConf.to_yaml(content), encoding="utf-8")
    return folder


def is_global_rank_zero() -> bool:
    """Before Lightning sets up: rank 0 by the launchers' environment (none set: a single process)."""
    return all(os.environ.get(key, "0") == "0" for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def move_file_logs(old_dir: Path, new_dir: Path) -> list[Path]:
    """Re-point the root logger's file handlers that write into `old_dir` (Hydra's <job>.log) to the
    file of the same name in `new_dir`, appending; returns the new files."""
    moved = []
    root = logging.getLogger()
    for handler in _file_log_handlers(old_dir):
        target = new_dir / Path(handler.baseFilename).name
        replacement = logging.FileHandler(target, mode="a", encoding=handler.encoding)
        replacement.setLevel(handler.level)
        replacement.setFormatter(handler.formatter)
        root.removeHandler(handler)
        handler.close()
        root.addHandler(replacement)
        moved.append(target)
    return moved


def _file_log_handlers(directory: Path) -> list[logging.FileHandler]:
    root = logging.getLogger()
    return [h for h in root.handlers
            if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == directory.resolve()]


def _only_start_files(directory: Path) -> bool:
    """Whether `directory` holds nothing but what starting a run writes: Hydra's job log (*.log), the run
    lock and the invocation's record (.hydra/)."""
    return all((p.is_file() and (p.suffix == ".log" or p.name == ".run.lock")) or (p.is_dir() and p.name == ".hydra")
               for p in directory.iterdir())


@contextlib.contextmanager
def removed_if_the_run_never_started(run_dir: Path):
    """A run that fails before writing anything of its own (a bad value, a missing checkpoint) leaves no
    folder: on an error, the directory Hydra made for this invocation is removed when it still holds only
    Hydra's job log, the run lock and the invocation's .hydra/ record. Only a directory that held nothing
    but an empty job log when the invocation began: the directory of a live or an earlier run is never
    touched. A SIGTERM stop is no error (the invocation's record stays, as after a finished run)."""
    fresh = run_dir.is_dir() and all(p.suffix == ".log" and p.stat().st_size == 0 for p in run_dir.iterdir())
    try:
        yield
    except BaseException as error:
        preempted = isinstance(error, SystemExit) and error.code == PREEMPTED_EXIT_CODE
        if fresh and not preempted and run_dir.is_dir() and _only_start_files(run_dir):
            for handler in _file_log_handlers(run_dir):
                logging.getLogger().removeHandler(handler)
                handler.close()
            shutil.rmtree(run_dir)
        raise
