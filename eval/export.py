"""Export a trained checkpoint as a self-contained folder: safetensors weights, JSON config, tokenizer.

    python -m eval.export ckpt=RUN_DIR out=DIR [which=best] [overwrite=true]

The folder holds
    config.json        format, the GPT config (models.gpt.GPTConfig as a dict), the weights' and
                       the tokenizer's file names, sha256s and the tokenizer's kind, vocab and hash,
                       and where it came from (checkpoint, variant, step, versions)
    model.safetensors  the GPT's weights (the tied head stored once)
    tokenizer.json     a Hugging Face tokenizer.json (kind bpe, or pretrained from a tokenizer.json),
    or tokenizer.attnlab.json  the attnlab formats (byte, char, tiktoken encodings)

`load_exported(folder)` rebuilds (model, tokenizer) from those files alone: it parses JSON and
reads safetensors, it runs no code from the folder and needs no checkpoint or data config.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.tokenizers import Tokenizer, tokenizer_from_record, tokenizer_record
from eval import common
from models.gpt import GPT

log = logging.getLogger("attnlab.eval.export")

EXPORT_FORMAT = "attnlab-gpt-export-v1"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HF_TOKENIZER_FILE = "tokenizer.json"
ATTNLAB_TOKENIZER_FILE = "tokenizer.attnlab.json"
EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE, HF_TOKENIZER_FILE, ATTNLAB_TOKENIZER_FILE)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_out_dir(cfg: DictConfig) -> Path:
    if OmegaConf.is_missing(cfg, "out") or not cfg.out:
        raise ValueError("out=... is required: the folder to write the export to")
    out, overwrite = cfg.out, cfg.overwrite
    if not isinstance(overwrite, bool):
        raise ValueError(f"overwrite must be true or false, got {overwrite!r}")
    path = Path(os.path.expanduser(str(out)))
    if path.exists() and not path.is_dir():
        raise ValueError(f"out={out} is a file, not a folder")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ValueError(f"out={out} is not empty; pass overwrite=true to replace the export in it")
    return path


def write_export(model: GPT, tokenizer: Tokenizer, out: Path, source: dict | None = None) -> Path:
    """Write model and tokenizer into the folder `out` (created); returns the config file."""
    from safetensors.torch import save_model

    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocabulary "
                         f"({model.cfg.vocab_size})")
    record = tokenizer_record(tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    for name in EXPORT_FILES:  # an earlier export's files (overwrite=true) never mix with this one's
        (out / name).unlink(missing_ok=True)
    tokenizer_file = HF_TOKENIZER_FILE if record["format"] == "hf-tokenizers" else ATTNLAB_TOKENIZER_FILE
    (out / tokenizer_file).write_text(record["content"], encoding="utf-8")
    if next(model.parameters()).device.type != "cpu":
        model = copy.deepcopy(model).cpu()
    save_model(model, str(out / WEIGHTS_FILE), metadata={"format": EXPORT_FORMAT})
    config = {
        "format": EXPORT_FORMAT,
        "model": asdict(model.cfg),
        "weights": {"file": WEIGHTS_FILE, "sha256": _sha256_file(out / WEIGHTS_FILE)},
        "tokenizer": {
            "file": tokenizer_file,
            "sha256": _sha256_file(out / tokenizer_file),
            **{key: record[key] for key in ("format", "kind", "vocab_size", "hash")},
        },
        "source": source or {},
    }
    common.write_json(out / CONFIG_FILE, config)
    return out / CONFIG_FILE


def _file_in(folder: Path, entry: dict, what: str, where: str) -> Path:
    """The file `entry` names, checked: a plain name inside the folder, with the recorded sha256."""
    name = entry.get("file") if isinstance(entry, dict) else None
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise ValueError(f"{where}: {what}.file must be a file name inside the export folder, got {name!r}")
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"{where} names {what} file {name}, which is not in {folder}")
    if _sha256_file(path) != entry.get("sha256"):
        raise ValueError(f"{path} is not the file the export wrote (its sha256 differs from {what}.sha256 in {where})")
    return path


def load_exported(folder: str | os.PathLike, device: str | torch.device = "cpu",
                  backend: str | None = None) -> tuple[GPT, Tokenizer]:
    """(model in eval mode, tokenizer) from an export folder written by write_export. `backend`
    overrides the attention backend recorded in the config (auto, triton, reference)."""
    from safetensors.torch import load_model

    folder = Path(os.path.expanduser(str(folder)))
    where = str(folder / CONFIG_FILE)
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"not an attnlab export folder: {where} does not exist")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from e
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"{where}: format must be {EXPORT_FORMAT!r}, got {found!r}")
    if not isinstance(config.get("model"), dict):
        raise ValueError(f"{where} has no 'model' config dict")
    model, _ = common.build_model_from_config(config["model"], where, backend)
    weights = _file_in(folder, config.get("weights"), "weights", where)
    try:
        missing, unexpected = load_model(model, str(weights), strict=False, device="cpu")
    except Exception as e:  # shapes that do not fit, a truncated file
        raise ValueError(f"{weights}: weights do not fit the model {where} describes: {e}") from e
    if missing or unexpected:
        raise ValueError(f"{weights} does not match the model {where} describes: missing weights "
                         f"{sorted(missing)[:8]}, unexpected weights {sorted(unexpected)[:8]}")
    entry = config.get("tokenizer")
    path = _file_in(folder, entry, "tokenizer", where)
    record = {key: entry.get(key) for key in ("kind", "vocab_size", "hash", "format")}
    tokenizer = tokenizer_from_record({**record, "content": path.read_text(encoding="utf-8")}, str(path))
    return model.eval().to(device), tokenizer


def run_export(cfg: DictConfig) -> Path:
    """Export the one checkpoint named by cfg.ckpt into cfg.out; returns the folder."""
    common.require_ckpt(cfg)
    out = _check_out_dir(cfg)
    paths = common.resolve_checkpoints(cfg.ckpt, cfg.which)
    if len(paths) != 1:
        raise ValueError(f"eval.export exports one checkpoint; ckpt={cfg.ckpt} gives {len(paths)}")
    run = common.load_run(paths[0], device="cpu", backend=cfg.backend)
    tokenizer, _ = common.tokenizer_for_run(run, cfg)
    write_export(run.model, tokenizer, out, source={**run.describe(), "versions": common.versions()})
    log.info("exported %s (%s, %d parameters, tokenizer %s) to %s", run.checkpoint_path, run.variant,
             run.model.num_params(), tokenizer.kind, out)
    return out


@hydra.main(version_base="1.3", config_path=common.CONFIG_DIR, config_name="eval/export")
def main(cfg: DictConfig) -> None:
    with common.clean_errors():
        run_export(cfg)


if __name__ == "__main__":
    main()
