"""attnlab training entry point (Hydra). `python train.py attn=alsc`; see README.md."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from pathlib import Path

# matplotlib, imported by torchmetrics through lightning, writes a font cache on import: keep it
# in attnlab's cache (ATTNLAB_CACHE_DIR, else the default paths.cache_dir) unless the user chose a place.
os.environ.setdefault(
    "MPLCONFIGDIR", os.path.join(os.environ.get("ATTNLAB_CACHE_DIR") or os.path.expanduser("~/.cache/attnlab"), "matplotlib")
)

import hydra  # noqa: E402
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf, open_dict

import attn
from data.tokenizers import Tokenizer, tokenizer_from_record, tokenizer_record
from models.lit import LitGPT
from models.quiet_logs import silence_third_party_notices, without_wandb_anonymous
from models.run_label import run_label
from training.callbacks.checkpoints import PREEMPTED_EXIT_CODE, CheckpointOnSigterm, WandbRunIdInCheckpoint
from training.callbacks.configured import build_configured_callbacks
from training.callbacks.nonfinite_guard import NonFiniteGuard
from training.callbacks.validate_at_last_step import ValidateAtLastStep
from training.checkpoint_io import AtomicCheckpointIO, load_checkpoint
from training.config_checks import check_config, cuda_graphs_enabled
from training.run_files import ResumedCSVLogger, RunDirectoryLock, checkpoint_run_dir, is_global_rank_zero, move_file_logs

log = logging.getLogger("attnlab.train")


# Lightning's ddp launcher starts ranks 1.. by re-running this script with the same argv.
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


def _label(cfg: DictConfig) -> str:
    """The run's label (models/run_label.py) from the job's command-line overrides."""
    try:
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # composed outside @hydra.main (tests): no command line
        overrides = []
    return run_label(cfg.attn.name, overrides)


def _group(cfg: DictConfig) -> str:
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
                save_dir=str(output_dir), group=_group(cfg), name=f"{_label(cfg)}-s{cfg.seed}",
                tags=sorted({cfg.attn.name, _label(cfg), f"seed{cfg.seed}"}),
                id=resume_run_id, resume="allow" if resume_run_id else None,
                config=OmegaConf.to_container(cfg, resolve=True),
            )
        ))
    return loggers


def finish_wandb(loggers) -> None:
    """End this job's wandb run: the next job of an in-process multirun must start its own
    (Lightning's WandbLogger would otherwise reuse the active run)."""
    for lg in loggers:
        if lg.__class__.__name__ == "WandbLogger" and lg._experiment is not None:
            lg.experiment.finish()


def resume_checkpoint(ckpt_path: str | None, output_dir: Path) -> str | None:
    """The checkpoint to resume from: `ckpt_path` itself, or with `ckpt_path=auto` the run
    directory's own checkpoints/last.ckpt when there is one (a fresh start when not): the same
    command restarts a preempted run where it stopped (SLURM --requeue, with a fixed hydra.run.dir)."""
    if ckpt_path != "auto":
        return ckpt_path
    last = output_dir / "checkpoints" / "last.ckpt"
    if last.is_file():
        log.info("ckpt_path=auto: resuming from %s", last)
        return str(last)
    log.info("ckpt_path=auto: no %s yet, starting fresh", last)
    return None


def resumed_state(ckpt_path: str | None) -> tuple[str | None, Tokenizer | None]:
    """(wandb run id, tokenizer) recorded in the checkpoint a run resumes from; (None, None) for a
    fresh start, None for what a checkpoint does not record."""
    if not ckpt_path:
        return None, None
    checkpoint = load_checkpoint(ckpt_path)
    record = checkpoint.get("tokenizer")
    tokenizer = tokenizer_from_record(record, f"checkpoint {ckpt_path}") if record is not None else None
    return checkpoint.get("wandb_run_id"), tokenizer


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


def build_model(cfg: DictConfig, vocab_size: int, bytes_per_token: dict, tokenizer: dict | None = None) -> LitGPT:
    cuda = torch.cuda.is_available() and cfg.trainer.get("accelerator", "auto") in ("auto", "gpu", "cuda")
    cuda_graphs, why = cuda_graphs_enabled(cfg.train, devices_per_run(cfg.trainer), cuda)
    log.info("CUDA graphs: %s", why)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model["vocab_size"] = vocab_size
    model["attn"] = OmegaConf.to_container(cfg.attn, resolve=True)
    return LitGPT(
        model=model, optimizer=OmegaConf.to_container(cfg.optimizer, resolve=True),
        scheduler=OmegaConf.to_container(cfg.scheduler, resolve=True),
        compile=cfg.train.compile, compile_unit=cfg.train.compile_unit, cuda_graphs=cuda_graphs,
        bytes_per_token=bytes_per_token, peak_tflops=peak_tflops(cfg.train.peak_tflops),
        log_grad_norm_per_layer=cfg.train.log_grad_norm_per_layer, tokenizer=tokenizer,
    )


# dense bf16 tensor-core peaks (TFLOP/s) by device name, for MFU when train.peak_tflops is null
KNOWN_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 125.0, "4090": 165.2}


def peak_tflops(configured: float | None) -> float | None:
    if configured is not None:
        return float(configured)
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in KNOWN_PEAK_TFLOPS.items() if k in name), None)


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


def run(cfg: DictConfig) -> dict:
    """Train, validate, checkpoint; returns the final metrics (also written to results.json).
    Resuming from a run's checkpoint without naming an output directory continues in that run's
    directory (its CSV log, checkpoints and wandb run); this invocation's Hydra files stay in the
    directory Hydra made for it."""
    check_config(cfg)
    output_dir = Path(cfg.paths.output_dir)
    original = checkpoint_run_dir(cfg.ckpt_path) if not output_dir_chosen() else None
    if original is not None and original != output_dir.resolve():
        log.info("resuming in the checkpoint's run directory %s", original)
        move_file_logs(output_dir, original)
        log.info("resuming in the checkpoint's run directory (this invocation's Hydra files: %s)", output_dir)
        with open_dict(cfg):  # every ${paths.output_dir} (checkpoint callback, loggers) follows
            cfg.paths.output_dir = str(original)
        output_dir = original
    output_dir.mkdir(parents=True, exist_ok=True)
    # ranks other than 0 write into rank 0's directory by design; rank 0 holds it against other runs
    with RunDirectoryLock(output_dir) if is_global_rank_zero() else contextlib.nullcontext():
        return _run(cfg, output_dir)


def _run(cfg: DictConfig, output_dir: Path) -> dict:
    silence_third_party_notices()
    # every file this run writes goes under one of these two (plus Hydra's files in the run dir)
    log.info("run dir: %s", output_dir.resolve())
    log.info("cache dir: %s", Path(str(cfg.data.get("cache_dir", cfg.paths.cache_dir))).expanduser().resolve())
    L.seed_everything(cfg.seed, workers=True)
    if cfg.deterministic:  # autotuning by timing could pick another tile (summation order) per process
        attn.pin_kernel_configs(True)

    ckpt_path = resume_checkpoint(cfg.ckpt_path, output_dir)
    resume_run_id, resumed_tokenizer = resumed_state(ckpt_path)
    try:
        # a resumed run tokenizes with its checkpoint's tokenizer, never with one the data config would
        # train now (another attnlab's BPE training)
        datamodule = instantiate(cfg.data, use_tokenizer=resumed_tokenizer)
    except InstantiationException as e:  # surface our own clear config errors unwrapped
        if isinstance(e.__cause__, (ValueError, FileNotFoundError)):
            raise e.__cause__ from None
        raise
    datamodule.prepare_data()
    datamodule.setup("fit")
    bytes_per_token = {s: datamodule.bytes_per_token(s) for s in ("train", "val")}
    # every checkpoint carries the tokenizer itself, so evaluation and export need no data config
    model = build_model(cfg, datamodule.vocab_size, bytes_per_token, tokenizer_record(datamodule.tokenizer))
    n_params = model.model.num_params()  # counted now: after fit, FSDP leaves each rank its shard only
    log.info(
        "model: %s, %.2fM parameters, %.3g training FLOPs/token",
        cfg.attn.name, n_params / 1e6, model.model.flops_per_token(),
    )

    precision = cfg.trainer.precision or ("bf16-mixed" if torch.cuda.is_available() else "32-true")
    configured = build_configured_callbacks(cfg.get("callbacks"))  # configs/callbacks/
    checkpointing = next((c for c in configured if isinstance(c, L.pytorch.callbacks.ModelCheckpoint)), None)
    guard = next((c for c in configured if isinstance(c, NonFiniteGuard)), None)  # None: callbacks.nonfinite_guard=null
    on_sigterm = CheckpointOnSigterm(output_dir / "checkpoints" / "last.ckpt")
    # built here, not in configs/callbacks/: the run's machinery (train.py reads the SIGTERM
    # checkpoint; the final validation and a wandb resume depend on the others)
    callbacks = [*configured, WandbRunIdInCheckpoint(), ValidateAtLastStep(), on_sigterm]
    if cfg.trainer.get("enable_progress_bar", True):
        # the values change once per log interval: refresh then (refresh_rate counts batches,
        # micro-batches under gradient accumulation)
        callbacks.append(L.pytorch.callbacks.TQDMProgressBar(refresh_rate=cfg.train.log_every * cfg.train.grad_accum))
    loggers = build_loggers(cfg, output_dir, resume_run_id, resuming=ckpt_path is not None)
    trainer: L.Trainer = instantiate(
        cfg.trainer,
        precision=precision,
        max_steps=cfg.train.stop_at_step or cfg.train.max_steps,
        val_check_interval=cfg.train.val_every * cfg.train.grad_accum,  # Lightning counts batches here
        check_val_every_n_epoch=None,
        accumulate_grad_batches=cfg.train.grad_accum,
        gradient_clip_val=cfg.train.grad_clip,
        log_every_n_steps=cfg.train.log_every,
        deterministic=cfg.deterministic,
        default_root_dir=str(output_dir),
        logger=loggers,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        # the "model:" log line above gives parameters and FLOPs per token; Lightning's summary
        # table printed FLOPs 0 (it counts none without an example input)
        enable_model_summary=cfg.trainer.get("enable_model_summary", False),
    )
    try:
        with run_dir_for_launched_ranks(output_dir):
            trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
            # a finished run resumed: fit had nothing left to do and the checkpoint holds the last
            # validation (as computed then, whatever the validation settings are now). A checkpoint
            # without it (older, or a last.ckpt written before a final validation that crashed)
            # validates again, which fails under multi-GPU FSDP (see ValidateAtLastStep)
            if model.last_validation.get("step") != trainer.global_step:
                trainer.validate(model, datamodule=datamodule, verbose=False)
            final = model.last_validation  # either way the same full-precision value
    except SIGTERMException:
        log.warning("SIGTERM: stopped after step %s, checkpoint %s; resume with ckpt_path=%s (exit status %d)",
                    on_sigterm.saved_step, on_sigterm.path, on_sigterm.path, PREEMPTED_EXIT_CODE)
        raise SystemExit(PREEMPTED_EXIT_CODE) from None
    finally:
        finish_wandb(loggers)

    nats = final["val/loss"]
    results = {
        "variant": cfg.attn.name,
        "label": _label(cfg),  # the variant and its own overridden settings
        "run_dir": str(output_dir),
        "wandb_group": _group(cfg),
        "seed": cfg.seed,
        "steps": trainer.global_step,
        "tokens": model.tokens_seen,
        "params": n_params,
        "val_loss": nats,
        "val_ppl": math.exp(min(nats, 50.0)),
        "val_bpb": nats / math.log(2) / bytes_per_token["val"],
        "unigram_bpb": datamodule.unigram_bpb("val"),
        "tokens_per_s": model.mean_tokens_per_s(),
        "mfu": (model.mean_tokens_per_s() or 0) * model.flops_per_token / (model.peak_tflops * 1e12 * trainer.world_size)
        if model.peak_tflops else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        # steps skipped for a non-finite loss or gradient (None: no guard, callbacks.nonfinite_guard=null)
        "nonfinite_steps": guard.nonfinite_steps if guard is not None else None,
        "best_checkpoint": checkpointing.best_model_path if checkpointing is not None else None,
        "last_checkpoint": str(output_dir / "checkpoints" / "last.ckpt"),
    }
    if results["nonfinite_steps"]:
        log.warning("%d of %d steps were skipped for a non-finite loss or gradient (train.nonfinite=%s): their "
                    "updates are missing from this run", results["nonfinite_steps"], results["steps"], cfg.train.nonfinite)
    if trainer.is_global_zero:
        (output_dir / "results.json").write_text(json.dumps(results, indent=2))
        print(
            f"\n[{cfg.attn.name}] val loss {nats:.4f} nats/token | perplexity {results['val_ppl']:.2f} | "
            f"{results['val_bpb']:.4f} bits/byte (unigram baseline {results['unigram_bpb']:.4f} bits/byte)\n"
            f"checkpoints: {output_dir / 'checkpoints'}"
        )
    return results


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float:
    return run(cfg)["val_loss"]  # the value a Hydra sweeper would minimize


if __name__ == "__main__":
    sys.argv = launched_rank_argv(sys.argv)
    main()
