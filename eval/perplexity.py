"""Token-weighted perplexity, nats/token and bits per byte over a whole split, at several context lengths.

    python -m eval.perplexity ckpt=RUN_DIR_OR_CKPT [split=test] [data=<option>]
        [context=512] [context_multipliers=[1,2,4]] [contexts=[512,1024]] [stride=256] [max_tokens=...]

Windowing (each target token is scored exactly once):
  - the first window covers tokens[0 : L+1] and scores all of its L targets;
  - every later window has the full length L and scores only its last `stride` targets,
    the rest of the window being left context. The last window may score fewer.
So with stride = L the windows do not overlap (each token sees between 0 and L-1 tokens of
context); with stride < L every token after the first window sees at least L - stride
tokens of context, at the cost of L / stride times more compute.

Metrics: nats/token = total negative log-likelihood / scored tokens; perplexity = exp of
that; bits per byte = nats/token x tokens / bytes / ln 2 with the UTF-8 bytes of the
evaluated text (tokenizer-independent, comparable across vocabularies).

Extrapolation: contexts beyond the training length are evaluated with the same RoPE model
(positions never seen in training); by default 1x, 2x and 4x the training context.
The result goes to <run>/eval/<checkpoint stem>.perplexity-<split>.json (runs.run.eval_result_path), with
the exact eval config, is printed as a table, and is logged to wandb in the run's group when
the run used wandb (offline unless configured otherwise).
"""

from __future__ import annotations

import datetime
import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import hydra
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from eval import command_line, common
from runs.model import LoadedRun
from runs.run import eval_result_path
from data.progress import progress_bar

log = logging.getLogger("attnlab.eval.perplexity")

LN2 = math.log(2.0)


@dataclass(frozen=True)
class Window:
    start: int  # inputs tokens[start : start + length], targets tokens[start + 1 : start + length + 1]
    length: int
    scored: int  # the last `scored` targets of the window count


def scoring_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """Windows that score each of the num_tokens - 1 targets exactly once (see the module docstring)."""
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score one prediction, got {num_tokens}")
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive int, got {context!r}")
    if not isinstance(stride, int) or not 1 <= stride <= context:
        raise ValueError(f"stride must be an int in [1, context={context}], got {stride!r}")
    targets = num_tokens - 1
    first = min(context, targets)
    windows = [Window(0, first, first)]
    scored_until = first  # targets 1..scored_until are done
    while scored_until < targets:
        n = min(stride, targets - scored_until)
        end = scored_until + n  # last target index scored by this window
        windows.append(Window(end - context, context, n))
        scored_until = end
    return windows


def bits_per_byte(nats_per_token: float, tokens: int, num_bytes: int) -> float:
    """bpb = nats/token x tokens / bytes / ln 2."""
    if num_bytes <= 0:
        raise ValueError(f"num_bytes must be > 0, got {num_bytes}")
    return nats_per_token * tokens / num_bytes / LN2


# the settings that change perplexity numbers (a JSON per combination: common.settings_tag)
RESULT_SETTINGS = ("context", "context_multipliers", "contexts", "stride", "max_tokens", "precision", "backend")


@torch.inference_mode()
def score_tokens(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    tokens: Sequence[int] | np.ndarray,
    context: int,
    stride: int,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    on_windows: Callable[[int], None] | None = None,
) -> dict:
    """Sum of next-token negative log-likelihoods over `tokens` with the given windowing.

    logits_fn maps int64 ids (B, L) to logits (B, L, V); position p predicts token p + 1.
    Returns {"nats", "tokens", "windows", "nats_per_token"} with tokens = len(tokens) - 1.
    `on_windows(n)` is called after each batch of n windows (a progress bar).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tokens = np.asarray(tokens)
    windows = scoring_windows(len(tokens), context, stride)
    total = torch.zeros((), dtype=torch.float64, device=device)
    counted = 0
    # all windows but possibly the first (when the text is shorter than context) share one length
    by_length: dict[int, list[Window]] = {}
    for w in windows:
        by_length.setdefault(w.length, []).append(w)
    for length, group in by_length.items():
        positions = torch.arange(length, device=device)
        for i in range(0, len(group), batch_size):
            batch = group[i : i + batch_size]
            ids = torch.from_numpy(np.stack([tokens[w.start : w.start + length + 1] for w in batch]).astype(np.int64))
            ids = ids.to(device)
            logits = logits_fn(ids[:, :-1])
            # at least fp32 for the log-softmax (bf16 logits under autocast); fp64 stays fp64
            logits = logits if logits.dtype == torch.float64 else logits.float()
            nll = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            ).view(len(batch), length)
            first_scored = torch.tensor([length - w.scored for w in batch], device=device)
            keep = positions[None, :] >= first_scored[:, None]
            total += (nll.double() * keep).sum()
            counted += int(keep.sum())
            if on_windows is not None:
                on_windows(len(batch))
    expected = len(tokens) - 1
    if counted != expected:  # the windowing invariant; a failure here is a bug, not bad input
        raise RuntimeError(f"scored {counted} targets, expected each of {expected} exactly once")
    nats = float(total)
    return {"nats": nats, "tokens": counted, "windows": len(windows), "nats_per_token": nats / counted}


def context_lengths(cfg: DictConfig, training_context: int) -> list[int]:
    if cfg.contexts is not None:
        lengths = list(cfg.contexts)
    else:
        base = cfg.context or training_context
        lengths = [int(round(m * base)) for m in cfg.context_multipliers]
    for length in lengths:
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"context lengths must be positive ints, got {lengths}")
    return lengths


def stride_for(cfg: DictConfig, length: int) -> int:
    if cfg.stride is None:
        return max(1, length // 2)
    if not isinstance(cfg.stride, int) or not 1 <= cfg.stride <= length:
        raise ValueError(f"stride must be an int in [1, context] for every context; got stride={cfg.stride} with context {length}")
    return cfg.stride


def _evaluated_bytes(datamodule, split: str, tokens: np.ndarray, truncated: bool) -> tuple[int, int]:
    """(tokens, UTF-8 bytes) of the evaluated text: the split's counts, or of the decoded prefix."""
    if not truncated:
        stats = datamodule.split_stats(split)
        return stats["tokens"], stats["bytes"]
    text = datamodule.tokenizer.decode([int(t) for t in tokens])
    return len(tokens), len(text.encode("utf-8"))


def evaluate_run(run: LoadedRun, cfg: DictConfig, datamodule, device: torch.device, data_cfg=None) -> dict:
    """Perplexity of one loaded run at every requested context length."""
    split = cfg.split
    tokens = np.asarray(datamodule.token_ids(split))
    truncated = cfg.max_tokens is not None and cfg.max_tokens < len(tokens)
    if truncated:
        tokens = tokens[: cfg.max_tokens]
    split_tokens, split_bytes = _evaluated_bytes(datamodule, split, tokens, truncated)
    bytes_per_token = split_bytes / split_tokens
    model = run.model

    def logits_fn(ids):
        with common.autocast(device, cfg.precision):
            return model(ids)

    training_context = run.model_config.context
    rows = []
    for length in context_lengths(cfg, training_context):
        stride = stride_for(cfg, length)
        windows = len(scoring_windows(len(tokens), length, stride))
        with progress_bar(f"perplexity {split} @ {length}", windows) as advance:
            scored = score_tokens(logits_fn, tokens, length, stride, cfg.batch_size, device, on_windows=advance)
        nats = scored["nats_per_token"]
        # bytes of the scored targets: the text's bytes per token x scored tokens
        scored_bytes = bytes_per_token * scored["tokens"]
        rows.append({
            "context": length,
            "context_multiple": length / training_context,
            "stride": stride,
            "windows": scored["windows"],
            "tokens": scored["tokens"],
            "nats_per_token": nats,
            "ppl": math.exp(min(nats, 700.0)),
            "bits_per_token": nats / LN2,
            "bpb": bits_per_byte(nats, scored["tokens"], scored_bytes),
            "beyond_training_context": length > training_context,
        })
    return {
        "kind": "perplexity",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": run.describe(),
        "split": split,
        "data": {
            "tokens": split_tokens,
            "bytes": split_bytes,
            "bytes_per_token": bytes_per_token,
            "truncated_to_max_tokens": bool(truncated),
            "unigram_bpb": _unigram_bpb(datamodule, split, truncated),
        },
        "results": rows,
        "eval": common.eval_config_record(cfg, data_cfg),
        "versions": common.versions(),
    }


def _unigram_bpb(datamodule, split, truncated):
    if truncated or not hasattr(datamodule, "unigram_bpb"):
        return None
    return datamodule.unigram_bpb(split)


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = result["model"]
    table = Table(title=f"perplexity on {result['split']}: {m['variant']} seed {m['seed']} ({m['checkpoint']})")
    for column in ("context", "x train", "stride", "windows", "tokens", "nats/tok", "ppl", "bpb"):
        table.add_column(column, justify="right")
    for r in result["results"]:
        table.add_row(
            str(r["context"]), f"{r['context_multiple']:g}", str(r["stride"]), str(r["windows"]), str(r["tokens"]),
            f"{r['nats_per_token']:.4f}", f"{r['ppl']:.3f}", f"{r['bpb']:.4f}",
        )
    Console().print(table)
    if result["data"].get("unigram_bpb") is not None:
        Console().print(f"unigram baseline on {result['split']}: {result['data']['unigram_bpb']:.4f} bits/byte")


def log_to_wandb(run: LoadedRun, cfg: DictConfig, result: dict) -> None:
    wb = common.start_wandb(run, cfg, "perplexity", result["eval"]["config"])
    if wb is None:
        return
    import wandb

    split = result["split"]
    columns = ["context", "context_multiple", "stride", "tokens", "nats_per_token", "ppl", "bpb"]
    wb.log({f"eval/{split}/perplexity": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in result["results"]])})
    for r in result["results"]:
        for key in ("nats_per_token", "ppl", "bpb"):
            wb.summary[f"eval/{split}/{key}@{r['context']}"] = r[key]
    common.finish_wandb(wb)


def run_perplexity(cfg: DictConfig) -> list[dict]:
    """Evaluate every checkpoint named by cfg.ckpt; returns the results (also written as JSON)."""
    command_line.require_ckpt(cfg)
    if cfg.split not in ("train", "val", "test"):
        raise ValueError(f"split must be one of train, val, test; got {cfg.split!r}")
    if cfg.max_tokens is not None and (not isinstance(cfg.max_tokens, int) or cfg.max_tokens < 2):
        raise ValueError(f"max_tokens must be an int >= 2 or null, got {cfg.max_tokens!r}")
    device = common.pick_device(cfg.device)
    results = []
    datamodules = common.DataModuleCache()
    for run in common.iter_runs(cfg, device):
        context_lengths(cfg, run.model_config.context)  # fail on a bad list before loading data
        data_cfg = common.data_config_for(run, cfg)
        datamodule = datamodules.for_run(run, data_cfg, cfg)
        result = evaluate_run(run, cfg, datamodule, device, data_cfg)
        path = eval_result_path(run.checkpoint_path, "perplexity", cfg.split, cfg.out,
                                settings=common.settings_tag(cfg, "perplexity", RESULT_SETTINGS))
        result["path"] = str(path)
        common.write_json(path, result)
        print_table(result)
        log.info("wrote %s", path)
        log_to_wandb(run, cfg, result)
        results.append(result)
    return results


@hydra.main(version_base="1.3", config_path=common.CONFIG_DIR, config_name="eval/perplexity")
def main(cfg: DictConfig) -> None:
    with command_line.clean_errors():
        run_perplexity(cfg)


if __name__ == "__main__":
    command_line.run(main)
