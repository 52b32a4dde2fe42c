"""Attention diagnostics per layer and head, for every registered variant.

    python -m eval.attention_stats ckpt=RUN_DIR [split=val] [num_tokens=16384] [seq_len=...]

On a fixed set of tokens (num_tokens, as evenly spaced windows of the training context
over the split) the model runs forward; at each layer the attention input is captured and
the float-exact weights are recomputed with `attn.attention_weights` (the registry's
reference path, which serves every variant, so there is no per-variant code here). Per
layer and head:

  zero_fraction    share of visible (query, key) pairs whose weight is exactly 0
  empty_rows       share of query rows whose weights are all 0 (possible without softmax)
  surviving_keys   mean number of keys with nonzero weight per query row
  surviving_share  the same divided by the number of visible keys, averaged over rows
  sink_mass        mean over rows i >= 1 of |w_i0| / sum_j |w_ij|: the weight on the first
                   token (for the softmax family exactly w_i0, for threshold variants its
                   share of |w|); rows with all-zero weights are left out
  entropy          mean over rows i >= 1 of the entropy (nats) of |w_i.| / sum |w_i.|,
                   for the softmax family the softmax entropy
  max_logit        largest pre-softmax logit z (after the cap) for the softmax family; for
                   sigmoid the largest argument s q.k + b_i of the sigmoid; for the threshold
                   family the largest score q.k (compared with tau)
  max_score        largest raw score before any cap: s q.k (softmax family), q.k (threshold)

Output: <run>/eval/<checkpoint stem>.attention-<split>.json (runs.run.eval_result_path), PNG heatmaps
(layer x head) per metric next to it, and wandb logging in the run's group.
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig

from eval import command_line, common
from runs.model import LoadedRun
from runs.run import eval_result_path
from data.progress import tracked
from models.attention_diagnostics import METRICS, attention_statistics, plot_heatmaps, window_starts

log = logging.getLogger("attnlab.eval.attention_stats")

# the settings that change the statistics (a JSON per combination: common.settings_tag)
RESULT_SETTINGS = ("num_tokens", "seq_len", "precision", "backend")


def token_batches(tokens: np.ndarray, seq_len: int, num_tokens: int, batch_size: int, device):
    starts = window_starts(len(tokens), seq_len, num_tokens)
    for i in range(0, len(starts), batch_size):
        chunk = np.stack([tokens[s : s + seq_len] for s in starts[i : i + batch_size]]).astype(np.int64)
        yield torch.from_numpy(chunk).to(device)


def evaluate_run(run: LoadedRun, cfg: DictConfig, datamodule, device: torch.device, data_cfg=None) -> dict:
    seq_len = cfg.seq_len or run.model_config.context
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2 or null, got {seq_len!r}")
    if not isinstance(cfg.num_tokens, int) or cfg.num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive int, got {cfg.num_tokens!r}")
    if not isinstance(cfg.batch_size, int) or cfg.batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {cfg.batch_size!r}")
    tokens = np.asarray(datamodule.token_ids(cfg.split))
    batches = token_batches(tokens, seq_len, cfg.num_tokens, cfg.batch_size, device)
    total = -(-len(window_starts(len(tokens), seq_len, cfg.num_tokens)) // cfg.batch_size)
    with common.autocast(device, cfg.precision):
        stats = attention_statistics(run.model, tracked(batches, f"attention statistics {cfg.split}", total))
    return {
        "kind": "attention_stats",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": run.describe(),
        "split": cfg.split,
        "seq_len": seq_len,
        **stats,
        "definitions": {name: title for name, (_, title, _) in METRICS.items()},
        "eval": common.eval_config_record(cfg, data_cfg),
        "versions": common.versions(),
    }


def print_summary(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = result["model"]
    table = Table(title=f"attention stats ({result['tokens']} {result['split']} tokens): {m['variant']} seed {m['seed']}")
    table.add_column("layer", justify="right")
    names = list(METRICS)
    for name in names:
        table.add_column(METRICS[name][2], justify="right")

    def fmt(values, how):
        values = [v for v in values if v is not None]
        if not values:
            return "-"
        return f"{(np.mean(values) if how == 'mean' else np.max(values)):.4g}"

    for i in range(len(result["metrics"][names[0]])):
        table.add_row(str(i), *(fmt(result["metrics"][n][i], METRICS[n][0]) for n in names))
    table.add_row("all", *(fmt([result["summary"][n]], "mean") for n in names))
    Console().print(table)


def log_to_wandb(run: LoadedRun, cfg: DictConfig, result: dict, images: list[Path]) -> None:
    wb = common.start_wandb(run, cfg, "attention_stats", result["eval"]["config"])
    if wb is None:
        return
    import wandb

    for name, value in result["summary"].items():
        wb.summary[f"attention/{name}"] = value
    rows = []
    for name in METRICS:
        for layer, values in enumerate(result["metrics"][name]):
            for head, value in enumerate(values):
                rows.append([name, layer, head, value])
    wb.log({
        "attention/per_head": wandb.Table(columns=["metric", "layer", "head", "value"], data=rows),
        **{f"attention/heatmap/{p.name.split('.')[-2]}": wandb.Image(str(p)) for p in images},
    })
    common.finish_wandb(wb)


def run_attention_stats(cfg: DictConfig) -> list[dict]:
    command_line.require_ckpt(cfg)
    if cfg.split not in ("train", "val", "test"):
        raise ValueError(f"split must be one of train, val, test; got {cfg.split!r}")
    device = common.pick_device(cfg.device)
    datamodules = common.DataModuleCache()
    results = []
    for run in common.iter_runs(cfg, device):
        data_cfg = common.data_config_for(run, cfg)
        datamodule = datamodules.for_run(run, data_cfg, cfg)
        result = evaluate_run(run, cfg, datamodule, device, data_cfg)
        path = eval_result_path(run.checkpoint_path, "attention", cfg.split, cfg.out,
                                settings=common.settings_tag(cfg, "attention_stats", RESULT_SETTINGS))
        label = f"{result['model']['variant']} s{result['model']['seed']}"
        images = plot_heatmaps(result["metrics"], label, path.with_suffix("")) if cfg.plot else []
        result["path"] = str(path)
        result["heatmaps"] = [str(p) for p in images]
        common.write_json(path, result)
        print_summary(result)
        log.info("wrote %s and %d heatmaps", path, len(images))
        log_to_wandb(run, cfg, result, images)
        results.append(result)
    return results


@hydra.main(version_base="1.3", config_path=common.CONFIG_DIR, config_name="eval/attention_stats")
def main(cfg: DictConfig) -> None:
    with command_line.clean_errors():
        run_attention_stats(cfg)


if __name__ == "__main__":
    command_line.run(main)
