"""attnlab training (Hydra): `python train.py attn=alsc` in a clone, `attnlab-train attn=alsc` from an
installed attnlab (cli below); see README.md."""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import math
import os
import sys
import time
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
from hydra.types import RunMode
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf, open_dict

import attn
from data.tokenizers import tokenizer_record
from models.lit import LitGPT
from models.pretrained import GPT2Weights
from runs.checkpoints import AtomicCheckpointIO
from runs.config_dir import CONFIG_DIR
from runs.run import Run, run_dir_to_resume_in
from training.callbacks.checkpoints import (PREEMPTED_EXIT_CODE, CheckpointOnSigterm, LogsOnDiskWithCheckpoints,
                                          WandbRunIdInCheckpoint)
from training.callbacks.configured import build_configured_callbacks
from training.callbacks.interrupted_validation import RerunInterruptedValidation
from training.callbacks.nonfinite_guard import NonFiniteGuard
from training.callbacks.validate_at_last_step import ValidateAtLastStep
from training.command_line import one_line_errors, run_with_one_line_errors
from training.config_checks import check_config, cuda_graphs_enabled
from training.evaluate_after import run_evaluations
from training.launch import devices_per_run, launched_rank_argv, output_dir_chosen, run_dir_for_launched_ranks
from training.loggers import build_loggers, finish_wandb, run_label_of, wandb_group
from training.process_settings import restored_process_settings
from training.quiet_logs import logs_above_progress_bars, silence_third_party_notices
from training.resume import resume_changes, resume_checkpoint, resumed_state
from training.run_files import (RunDirectoryLock, is_global_rank_zero, move_file_logs, refuse_replacing_a_run,
                                 removed_if_the_run_never_started, write_hydra_record)
import training.run_label  # noqa: F401  (registers the attnlab_folder_label resolver that configs/train.yaml's sweep dir uses)

log = logging.getLogger("attnlab.train")


def model_config(cfg: DictConfig) -> dict:
    """The model dict LitGPT records in its checkpoints (hyper_parameters["model"]), without the
    vocabulary size (the tokenizer's): cfg.model with cfg.attn under "attn"."""
    return {**OmegaConf.to_container(cfg.model, resolve=True), "attn": OmegaConf.to_container(cfg.attn, resolve=True)}


def build_model(cfg: DictConfig, vocab_size: int, bytes_per_token: dict, tokenizer: dict | None = None) -> LitGPT:
    cuda = torch.cuda.is_available() and cfg.trainer.get("accelerator", "auto") in ("auto", "gpu", "cuda")
    cuda_graphs, why = cuda_graphs_enabled(cfg.train, devices_per_run(cfg.trainer), cuda)
    log.info("CUDA graphs: %s", why)
    model = {**model_config(cfg), "vocab_size": vocab_size}
    return LitGPT(
        model=model, optimizer=OmegaConf.to_container(cfg.optimizer, resolve=True),
        scheduler=OmegaConf.to_container(cfg.scheduler, resolve=True),
        compile=cfg.train.compile, compile_unit=cfg.train.compile_unit, cuda_graphs=cuda_graphs,
        bytes_per_token=bytes_per_token, peak_tflops=peak_tflops(cfg.train.peak_tflops),
        log_grad_norm_per_layer=cfg.train.log_grad_norm_per_layer, tokenizer=tokenizer,
    )


# dense bf16 tensor-core peaks (TFLOP/s) by device name, for MFU when train.peak_tflops is null
KNOWN_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 125.0, "4090": 165.2}


def pretrained_weights(cfg: DictConfig) -> GPT2Weights | None:
    """train.init_from's GPT-2-family folder (None when unset), its sizes written into cfg.model
    (the preset's blocks must be GPT-2's: model=gpt2_compat)."""
    if not cfg.train.init_from:
        return None
    weights = GPT2Weights(str(cfg.train.init_from))
    weights.check_blocks(cfg.model)
    with open_dict(cfg):
        for key, value in weights.model_fields().items():
            cfg.model[key] = value
    log.info("train.init_from=%s: model sizes %s", cfg.train.init_from, weights.model_fields())
    return weights


def peak_tflops(configured: float | None) -> float | None:
    if configured is not None:
        return float(configured)
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in KNOWN_PEAK_TFLOPS.items() if k in name), None)


def run(cfg: DictConfig) -> dict:
    """Train, validate, checkpoint; returns the final metrics (also written to results.json).
    Resuming from a run's checkpoint without naming an output directory continues in that run's
    directory (its CSV log, checkpoints and wandb run); this invocation's Hydra files stay in the
    directory Hydra made for it."""
    task_cfg = copy.deepcopy(cfg)  # as composed: the run's .hydra/config.yaml
    check_config(cfg)
    output_dir = Path(cfg.paths.output_dir)
    original = run_dir_to_resume_in(cfg.ckpt_path) if not output_dir_chosen() else None
    if original is not None and original != output_dir.resolve():
        log.info("resuming in the checkpoint's run directory %s", original)
        move_file_logs(output_dir, original)
        log.info("resuming in the checkpoint's run directory (this invocation's Hydra files: %s)", output_dir)
        with open_dict(cfg):  # every ${paths.output_dir} (checkpoint callback, loggers) follows
            cfg.paths.output_dir = str(original)
        output_dir = original
    output_dir.mkdir(parents=True, exist_ok=True)
    # ranks other than 0 write into rank 0's directory by design; rank 0 holds it against other runs
    with RunDirectoryLock(output_dir) if is_global_rank_zero() else contextlib.nullcontext(), \
            restored_process_settings():
        if is_global_rank_zero():
            refuse_replacing_a_run(output_dir, cfg.ckpt_path, cfg.train.overwrite)
            write_hydra_record(task_cfg)
        return _run(cfg, output_dir)


def _run(cfg: DictConfig, output_dir: Path) -> dict:
    silence_third_party_notices()
    # every file this run writes goes under one of these two (plus Hydra's files in the run dir)
    log.info("run dir: %s", output_dir.resolve())
    log.info("cache dir: %s", Path(str(cfg.data.get("cache_dir", cfg.paths.cache_dir))).expanduser().resolve())
    pretrained = pretrained_weights(cfg)  # before the resume check, which compares model sizes
    ckpt_path = resume_checkpoint(cfg.ckpt_path, output_dir)
    resumed = resumed_state(ckpt_path)
    resume_run_id, resumed_tokenizer = resumed.wandb_run_id, resumed.tokenizer
    changed_on_resume = {}
    if ckpt_path is not None:  # before any data work: a resume that would change the model is refused
        changed_on_resume = resume_changes(
            ckpt_path, resumed.hyper_parameters, model_config(cfg),
            OmegaConf.to_container(cfg.optimizer, resolve=True), OmegaConf.to_container(cfg.scheduler, resolve=True))
    L.seed_everything(cfg.seed, workers=True)
    if cfg.deterministic:  # autotuning by timing could pick another tile (summation order) per process
        attn.pin_kernel_configs(True)
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
    vocab_size = datamodule.vocab_size
    if pretrained is not None:
        pretrained.check_tokenizer(datamodule.tokenizer)
        vocab_size = pretrained.vocab_size
    model = build_model(cfg, vocab_size, bytes_per_token, tokenizer_record(datamodule.tokenizer))
    if pretrained is not None and ckpt_path is None:  # a resume takes every weight from its checkpoint
        pretrained.load_into(model.model)
    n_params = model.model.num_params()  # counted now: after fit, FSDP leaves each rank its shard only
    log.info(
        "model: %s, %.2fM parameters, %.3g training FLOPs/token",
        cfg.attn.name, n_params / 1e6, model.model.flops_per_token(),
    )

    precision = cfg.trainer.precision or ("bf16-mixed" if torch.cuda.is_available() else "32-true")
    configured = build_configured_callbacks(cfg.get("callbacks"))  # configs/callbacks/
    checkpointing = next((c for c in configured if isinstance(c, L.pytorch.callbacks.ModelCheckpoint)), None)
    guard = next((c for c in configured if isinstance(c, NonFiniteGuard)), None)  # None: callbacks.nonfinite_guard=null
    run_directory = Run(output_dir)
    on_sigterm = CheckpointOnSigterm(run_directory.last_checkpoint_path)
    # built here, not in configs/callbacks/: the run's machinery (train.py reads the SIGTERM
    # checkpoint; the logs, the final validation, resumed validations and a wandb resume depend on the others)
    callbacks = [*configured, LogsOnDiskWithCheckpoints(), WandbRunIdInCheckpoint(), ValidateAtLastStep(),
                 RerunInterruptedValidation(), on_sigterm]
    if cfg.trainer.get("enable_progress_bar", True):
        # the values change once per log interval: refresh then (refresh_rate counts batches,
        # micro-batches under gradient accumulation)
        callbacks.append(L.pytorch.callbacks.TQDMProgressBar(refresh_rate=cfg.train.log_every * cfg.train.grad_accum))
    loggers = build_loggers(cfg, output_dir, resume_run_id, resuming=ckpt_path is not None)
    time_limit = {}
    if cfg.train.get("stop_at_time") is not None:  # the deadline as the duration left now
        left = float(cfg.train.stop_at_time) - time.time()
        if left <= 0:
            raise ValueError(f"train.stop_at_time passed {-left:.0f} s ago: not starting {output_dir}")
        time_limit["max_time"] = datetime.timedelta(seconds=left)
    trainer: L.Trainer = instantiate(
        cfg.trainer,
        **time_limit,
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
        with run_dir_for_launched_ranks(output_dir), logs_above_progress_bars():
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
        wandb_run = finish_wandb(loggers)

    nats = final["val/loss"]
    results = {
        "variant": cfg.attn.name,
        "label": run_label_of(cfg),  # the variant and its own overridden settings
        "run_dir": str(output_dir),
        "wandb_group": wandb_group(cfg),
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
        "last_checkpoint": str(run_directory.last_checkpoint_path),
    }
    if changed_on_resume:  # settings this invocation changed from the checkpoint's: {path: [before, now]}
        results["changed_on_resume"] = changed_on_resume
    if results["nonfinite_steps"]:
        log.warning("%d of %d steps were skipped for a non-finite loss or gradient (train.nonfinite=%s): their "
                    "updates are missing from this run", results["nonfinite_steps"], results["steps"], cfg.train.nonfinite)
    if trainer.is_global_zero:
        # replaced atomically: a kill or a full disk during the write leaves the previous file, never an
        # empty one (which every eval command would refuse). Written before the evaluations too: a
        # process killed during one keeps the training result
        run_directory.write_results(results)
        if cfg.get("evaluate"):  # on the checkpoints just written (configs/train.yaml: evaluate)
            results["evaluations"] = run_evaluations(cfg.evaluate, output_dir)
            run_directory.write_results(results)
        print(summary_line(results, wandb_run))
    return results


def summary_line(results: dict, wandb_run: str | None) -> str:
    """The one line a run ends with: its variant, steps, final validation, run directory and wandb run."""
    parts = [f"[{results['label']}] {results['steps']} steps", f"val loss {results['val_loss']:.4f} nats/token",
             f"perplexity {results['val_ppl']:.2f}",
             f"{results['val_bpb']:.4f} bits/byte (unigram baseline {results['unigram_bpb']:.4f})",
             f"run dir {results['run_dir']}"]
    return " | ".join(parts + ([wandb_run] if wandb_run else []))


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> float:
    hydra_cfg = HydraConfig.get()
    # in a multirun a job's error goes to Hydra, which runs the other jobs, then raises it (one line
    # from run_with_one_line_errors); exiting here would end the sweep at the failing job
    single_run = hydra_cfg.mode == RunMode.RUN
    with removed_if_the_run_never_started(Path(hydra_cfg.runtime.output_dir)), \
            one_line_errors() if single_run else contextlib.nullcontext():
        return run(cfg)["val_loss"]  # the value a Hydra sweeper would minimize


def cli() -> None:
    """`python train.py ...` and the console command `attnlab-train ...` (Hydra's command line)."""
    run_with_one_line_errors(main, launched_rank_argv(sys.argv))


if __name__ == "__main__":
    cli()
