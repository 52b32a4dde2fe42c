"""The GPT a checkpoint was trained as, rebuilt with its weights (`load_run`), or refused.

Checkpoints are read with `runs.checkpoints.load_checkpoint` (weights_only=True, never unpickling
code). A checkpoint that this attnlab cannot rebuild (unknown variant, unknown or missing config
fields, weights that do not fit the model) is refused with a ValueError that names the file and what
does not match.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

import attn
from data.tokenizers import Tokenizer
from models.gpt import GPT, GPTConfig
from models.lit import gpt_config_from_dict
from runs.checkpoints import checkpoint_tokenizer, load_checkpoint
from runs.run import Run


@dataclass
class LoadedRun:
    """A trained model rebuilt from its checkpoint, with whatever the run directory adds."""

    model: GPT
    model_config: GPTConfig
    checkpoint_path: Path
    hparams: dict
    run: Run | None  # the training run, when the checkpoint sits in its directory
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
        return self.run.seed if self.run is not None else None

    def describe(self) -> dict:
        """Identity of the evaluated model, stored in every eval JSON."""
        return {
            "checkpoint": str(self.checkpoint_path),
            "run_dir": str(self.run.dir) if self.run is not None else None,
            "variant": self.variant,
            "family": self.family,
            "seed": self.seed,
            "global_step": self.global_step,
            "tokens_seen": self.tokens_seen,
            "params": self.model.num_params(),
            "training_context": self.model_config.context,
            "tokenizer": self.tokenizer.describe() if self.tokenizer is not None else None,
        }


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
    tokenizer = checkpoint_tokenizer(ckpt, path)
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"checkpoint {path}: its tokenizer has {tokenizer.vocab_size} tokens, more than the "
                         f"model's vocabulary ({cfg.vocab_size})")
    run = Run.of_checkpoint(path)
    if run is not None:
        run.results  # noqa: B018  (read with the checkpoint: a warning about an unreadable results.json comes now)
    return LoadedRun(
        model=model.to(device),
        model_config=cfg,
        checkpoint_path=path,
        hparams=ckpt["hyper_parameters"],
        run=run,
        global_step=ckpt.get("global_step"),
        tokens_seen=ckpt.get("tokens_seen"),
        tokenizer=tokenizer,
    )
