"""Which checkpoint a run resumes from, and what it recorded about the run (wandb run id, tokenizer)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

from data.tokenizers import Tokenizer
from runs.checkpoints import checkpoint_tokenizer, load_checkpoint
from runs.run import Run

log = logging.getLogger("attnlab.train")


def resume_checkpoint(ckpt_path: str | None, output_dir: Path) -> str | None:
    """The checkpoint to resume from: `ckpt_path` itself, or with `ckpt_path=auto` the run
    directory's own checkpoints/last.ckpt when there is one (a fresh start when not): the same
    command restarts a preempted run where it stopped (SLURM --requeue, with a fixed hydra.run.dir)."""
    if ckpt_path != "auto":
        return ckpt_path
    last = Run(output_dir).last_checkpoint_path
    if last.is_file():
        log.info("ckpt_path=auto: resuming from %s", last)
        return str(last)
    log.info("ckpt_path=auto: no %s yet, starting fresh", last)
    return None


class ResumedState(NamedTuple):
    """What the checkpoint a run resumes from recorded about the run (None where it records nothing,
    or for a fresh start)."""

    wandb_run_id: str | None
    tokenizer: Tokenizer | None
    hyper_parameters: dict | None


def resumed_state(ckpt_path: str | None) -> ResumedState:
    if not ckpt_path:
        return ResumedState(None, None, None)
    checkpoint = load_checkpoint(ckpt_path)
    return ResumedState(checkpoint.get("wandb_run_id"), checkpoint_tokenizer(checkpoint, ckpt_path),
                        checkpoint.get("hyper_parameters"))


# model fields a resume may change: they regularize training and define no parameter or computation
# of the trained model (the attention backend computes the same function)
CHANGEABLE_MODEL_FIELDS = frozenset({"model.dropout", "model.attn_dropout", "model.embed_dropout", "attn.backend"})


def _flat(tree, prefix: str) -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}"))
    return out


def _model_fields(model: dict) -> dict:
    """A checkpoint's (or a config's) model dict as config paths: model.* and attn.* (the vocabulary
    size comes from the tokenizer, which a resume takes from the checkpoint)."""
    model = {k: v for k, v in model.items() if k != "vocab_size"}
    attn_cfg = model.pop("attn", {})
    return {**_flat(model, "model"), **_flat(attn_cfg, "attn")}


def _changes(old: dict, new: dict) -> dict[str, list]:
    """{path: [old, new]} of the paths both hold with different values (a field one of them lacks, as a
    checkpoint from before it existed, is not a change)."""
    return {key: [old[key], new[key]] for key in sorted(old.keys() & new.keys()) if old[key] != new[key]}


def resume_changes(ckpt_path: str, hyper_parameters: dict | None, model: dict, optimizer: dict,
                   scheduler: dict) -> dict[str, list]:
    """Compare the run a checkpoint was trained as with the config resuming it. A change to the model
    or its attention (what the weights mean) is refused with a one-line diff; the changes a resume may
    make on purpose (optimizer, schedule, dropout, attention backend) are returned as {path: [old,
    new]}, for results.json and a warning. model: the config's model dict with its `attn` dict."""
    if not isinstance(hyper_parameters, dict) or not isinstance(hyper_parameters.get("model"), dict):
        return {}
    changes = _changes(_model_fields(hyper_parameters["model"]), _model_fields(model))
    refused = {key: change for key, change in changes.items() if key not in CHANGEABLE_MODEL_FIELDS}
    if refused:
        diff = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in refused.items())
        raise ValueError(f"ckpt_path={ckpt_path} was trained as another model ({diff}): resume it with its own "
                         "settings, or start a fresh run in a new hydra.run.dir")
    for name, now in (("optimizer", optimizer), ("scheduler", scheduler)):
        before = hyper_parameters.get(name)
        if isinstance(before, dict):
            changes.update(_changes(_flat(before, name), _flat(now, name)))
    if changes:
        log.warning("resuming with changed settings: %s",
                    "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changes.items()))
    return changes
