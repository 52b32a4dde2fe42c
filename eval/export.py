"""Export a trained checkpoint as a Hugging Face model folder (transformers loads it) that attnlab
reads back exactly.

    python -m eval.export ckpt=RUN_DIR out=DIR [which=best] [overwrite=true]

The folder holds
    config.json             transformers' config: model_type attnlab_gpt, architectures, auto_map
                            (naming modeling_attnlab.py's classes), the GPT config's fields
                            (models.gpt.GPTConfig) at the top level, the end-of-text id as
                            bos/eos, and under "attnlab" the export format, the weights' and the
                            tokenizer's file names and sha256s, the tokenizer's kind, vocab and
                            hash, and where it came from (checkpoint, variant, step, versions)
    modeling_attnlab.py     the transformers model (models/modeling_attnlab.py; it imports the
                            installed attnlab), run by transformers only with trust_remote_code=True
    model.safetensors       the weights as model.<GPT name> (the tied head stored once)
    tokenizer.json          a Hugging Face tokenizer (every kind converted: data.tokenizers'
    tokenizer_config.json   Tokenizer.hf_tokenizer), with the config AutoTokenizer reads
    tokenizer.attnlab.json  the attnlab record of byte, char and tiktoken tokenizers (bpe and
                            pretrained tokenizer.json ones are tokenizer.json itself)
    generation_config.json  end-of-text id, greedy by default

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
    AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)  # transformers 5 reads config.json first

`load_exported(folder)` rebuilds (model, tokenizer) for attnlab from config.json, the weights and
the tokenizer record alone: it parses JSON and reads safetensors, runs no code from the folder
(modeling_attnlab.py is not imported) and needs no checkpoint or data config. It also reads the
folders of the earlier format (attnlab-gpt-export-v1: the GPT config under "model").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.tokenizers import END_OF_TEXT, Tokenizer, tokenizer_from_record, tokenizer_record
from eval import command_line, common
from runs.model import build_model_from_config, load_run
from runs.run import resolve_checkpoints
from models.gpt import GPT, GPTConfig

MODELING_SOURCE = Path(__file__).resolve().parents[1] / "models" / "modeling_attnlab.py"

log = logging.getLogger("attnlab.eval.export")

EXPORT_FORMAT = "attnlab-gpt-export-v2"
EXPORT_FORMAT_V1 = "attnlab-gpt-export-v1"  # read by load_exported: the GPT config under "model", unprefixed weights
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_PREFIX = "model."  # AttnlabForCausalLM keeps the GPT as .model
MODELING_FILE = "modeling_attnlab.py"
HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
ATTNLAB_TOKENIZER_FILE = "tokenizer.attnlab.json"
EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE, MODELING_FILE, HF_TOKENIZER_FILE, HF_TOKENIZER_CONFIG_FILE,
                GENERATION_CONFIG_FILE, ATTNLAB_TOKENIZER_FILE)


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
    import shutil

    from safetensors.torch import save_file

    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocabulary "
                         f"({model.cfg.vocab_size})")
    record = tokenizer_record(tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    for name in EXPORT_FILES:  # an earlier export's files (overwrite=true) never mix with this one's
        (out / name).unlink(missing_ok=True)
    if record["format"] == "hf-tokenizers":
        tokenizer_file = HF_TOKENIZER_FILE
        (out / HF_TOKENIZER_FILE).write_text(record["content"], encoding="utf-8")
    else:
        tokenizer_file = ATTNLAB_TOKENIZER_FILE
        (out / ATTNLAB_TOKENIZER_FILE).write_text(record["content"], encoding="utf-8")
        (out / HF_TOKENIZER_FILE).write_text(tokenizer.hf_tokenizer().to_str(), encoding="utf-8")
    end_of_text = tokenizer.end_of_text_id
    common.write_json(out / HF_TOKENIZER_CONFIG_FILE, {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.cfg.context,
        "clean_up_tokenization_spaces": False,
        **({"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT} if end_of_text is not None else {}),
    })
    common.write_json(out / GENERATION_CONFIG_FILE, {
        "bos_token_id": end_of_text, "eos_token_id": end_of_text, "do_sample": False,
        "max_length": model.cfg.context,
    })
    shutil.copyfile(MODELING_SOURCE, out / MODELING_FILE)
    state = {WEIGHTS_PREFIX + name: tensor.detach().cpu().contiguous()
             for name, tensor in model.state_dict().items() if name != "head.weight"}  # the head is the embedding
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt", "attnlab_format": EXPORT_FORMAT})
    config = {
        "model_type": "attnlab_gpt",
        "architectures": ["AttnlabForCausalLM"],
        "auto_map": {"AutoConfig": "modeling_attnlab.AttnlabConfig",
                     "AutoModelForCausalLM": "modeling_attnlab.AttnlabForCausalLM"},
        **dataclasses.asdict(model.cfg),
        "tie_word_embeddings": True,
        "bos_token_id": end_of_text,
        "eos_token_id": end_of_text,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "attnlab": {
            "format": EXPORT_FORMAT,
            "weights": {"file": WEIGHTS_FILE, "sha256": _sha256_file(out / WEIGHTS_FILE)},
            "tokenizer": {
                "file": tokenizer_file,
                "sha256": _sha256_file(out / tokenizer_file),
                **{key: record[key] for key in ("format", "kind", "vocab_size", "hash")},
            },
            "source": source or {},
        },
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
    from safetensors.torch import load_file

    folder = Path(os.path.expanduser(str(folder)))
    where = str(folder / CONFIG_FILE)
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"not an attnlab export folder: {where} does not exist")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from e
    if isinstance(config, dict) and config.get("format") == EXPORT_FORMAT_V1:
        record, model_dict, prefix = config, config.get("model"), ""
    else:
        record = config.get("attnlab") if isinstance(config, dict) else None
        model_dict, prefix = (config, WEIGHTS_PREFIX) if isinstance(record, dict) else (None, "")
    if not isinstance(record, dict) or record.get("format") not in (EXPORT_FORMAT, EXPORT_FORMAT_V1):
        found = record.get("format") if isinstance(record, dict) else None
        raise ValueError(f"{where}: attnlab.format must be {EXPORT_FORMAT!r}, got {found!r} (not an attnlab export?)")
    if not isinstance(model_dict, dict):
        raise ValueError(f"{where} has no 'model' config dict")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    model, _ = build_model_from_config({k: v for k, v in model_dict.items() if k in fields}, where, backend)
    weights = _file_in(folder, record.get("weights"), "weights", where)
    try:
        state = {name.removeprefix(prefix): tensor for name, tensor in load_file(str(weights)).items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
    except Exception as e:  # shapes that do not fit, a truncated file
        raise ValueError(f"{weights}: weights do not fit the model {where} describes: {e}") from e
    missing = [name for name in missing if name != "head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise ValueError(f"{weights} does not match the model {where} describes: missing weights "
                         f"{sorted(missing)[:8]}, unexpected weights {sorted(unexpected)[:8]}")
    entry = record.get("tokenizer")
    path = _file_in(folder, entry, "tokenizer", where)
    record = {key: entry.get(key) for key in ("kind", "vocab_size", "hash", "format")}
    tokenizer = tokenizer_from_record({**record, "content": path.read_text(encoding="utf-8")}, str(path))
    return model.eval().to(device), tokenizer


def run_export(cfg: DictConfig) -> Path:
    """Export the one checkpoint named by cfg.ckpt into cfg.out; returns the folder."""
    command_line.require_ckpt(cfg)
    out = _check_out_dir(cfg)
    paths = resolve_checkpoints(cfg.ckpt, cfg.which)
    if len(paths) != 1:
        raise ValueError(f"eval.export exports one checkpoint; ckpt={cfg.ckpt} gives {len(paths)}")
    run = load_run(paths[0], device="cpu", backend=cfg.backend)
    tokenizer, _ = common.tokenizer_for_run(run, cfg)
    write_export(run.model, tokenizer, out, source={**run.describe(), "versions": common.versions()})
    log.info("exported %s (%s, %d parameters, tokenizer %s) to %s", run.checkpoint_path, run.variant,
             run.model.num_params(), tokenizer.kind, out)
    return out


@hydra.main(version_base="1.3", config_path=common.CONFIG_DIR, config_name="eval/export")
def main(cfg: DictConfig) -> None:
    with command_line.clean_errors():
        run_export(cfg)


if __name__ == "__main__":
    command_line.run(main)
