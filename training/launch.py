"""Launcher helpers: the environment that makes Lightning's launched DDP ranks join rank 0's run
directory and job, how many devices a run asks for, and whether an invocation names its output
directory."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig


# Lightning's ddp launcher starts ranks 1.. by re-running train.py with the same argv.
# Rank 0 records its run directory (and, in a multirun, its job's overrides) in the
# environment first, so the other ranks write into rank 0's directory (configs/train.yaml
# reads ATTNLAB_RUN_DIR in hydra.run.dir) and run rank 0's job rather than the whole sweep.
RUN_DIR_ENV = "ATTNLAB_RUN_DIR"
JOB_OVERRIDES_ENV = "ATTNLAB_JOB_OVERRIDES"


@contextlib.contextmanager
def run_dir_for_launched_ranks(output_dir: Path):
    """Sets ATTNLAB_RUN_DIR (and ATTNLAB_JOB_OVERRIDES in a multirun) while training runs.
    In the process that launches the ranks, it also undoes the launcher's rank variables and
    process group afterwards, so the next job of a sequential multirun launches its own ranks."""
    launching = "LOCAL_RANK" not in os.environ  # set: a launched rank, or ranks created by SLURM / torchrun
    keys = [RUN_DIR_ENV, JOB_OVERRIDES_ENV]
    if launching:
        keys += ["LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    saved = {key: os.environ.get(key) for key in keys}
    os.environ[RUN_DIR_ENV] = str(output_dir.resolve())
    try:
        hc = HydraConfig.get()
    except ValueError:  # composed outside @hydra.main (tests): no re-run argv to fix
        hc = None
    if hc is not None and hc.mode.name == "MULTIRUN":
        os.environ[JOB_OVERRIDES_ENV] = json.dumps(list(hc.overrides.task))
    try:
        yield
    finally:  # the next job of a sequential multirun sets its own
        if launching and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def launched_rank_argv(argv: list[str]) -> list[str]:
    """argv for a rank that Lightning's launcher started by re-running a multirun command:
    rank 0's single job (its overrides, no -m), in rank 0's run directory. Other argv
    (single runs; processes started by SLURM or torchrun) is returned unchanged."""
    overrides = os.environ.get(JOB_OVERRIDES_ENV)
    is_launched_rank = os.environ.get("LOCAL_RANK", "0") != "0" and RUN_DIR_ENV in os.environ
    if not (is_launched_rank and overrides and ("-m" in argv or "--multirun" in argv)):
        return argv
    # keep option flags (-cn NAME, --config-dir=...) and hydra.* settings (Lightning appends some);
    # drop -m and the sweep's overrides, replaced by the job's own
    kept, skip_value = [], False
    for arg in argv[1:]:
        if skip_value:
            kept.append(arg)
            skip_value = False
        elif arg in ("-m", "--multirun"):
            continue
        elif arg.startswith("-"):
            kept.append(arg)
            skip_value = "=" not in arg and arg in ("-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir")
        elif arg.startswith(("hydra.run.dir=", "hydra.output_subdir=")):
            continue  # set below
        elif arg.startswith("hydra."):
            kept.append(arg)
        # else: a config override (key=value, ~key, +key=value): the job's own list replaces them
    run_dir = os.environ[RUN_DIR_ENV]
    return [argv[0], *kept, *json.loads(overrides), f"hydra.run.dir={run_dir}", "hydra.output_subdir=null"]


def devices_per_run(trainer_cfg) -> int:
    """How many devices the trainer config asks for in all (devices x num_nodes; -1 / "auto": every GPU here)."""
    devices = trainer_cfg.get("devices", "auto")
    if isinstance(devices, str) and devices != "auto":
        devices = [d for d in devices.split(",") if d.strip()]
    if not isinstance(devices, int) and not isinstance(devices, str):
        devices = len(devices)
    if devices in (-1, "auto"):
        devices = max(torch.cuda.device_count(), 1)
    return int(devices) * int(trainer_cfg.get("num_nodes", 1))


def output_dir_chosen() -> bool:
    """Whether this invocation names its output directory (hydra.run.dir / paths.output_dir on the
    command line, a multirun's sweep folder, a launched DDP rank); True outside @hydra.main."""
    if os.environ.get(RUN_DIR_ENV):
        return True
    try:
        hc = HydraConfig.get()
    except ValueError:
        return True
    if hc.mode.name == "MULTIRUN":
        return True
    keys = ("hydra.run.dir=", "paths.output_dir=", "+paths.output_dir=", "++paths.output_dir=")
    return any(o.startswith(keys) for o in [*hc.overrides.task, *hc.overrides.hydra])  # hydra.* land in .hydra
