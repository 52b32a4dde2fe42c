"""Sample text from a trained run.

    python -m eval.generate ckpt=RUN_DIR prompt="To be, or not" [max_new_tokens=200]
        [temperature=0.8] [top_k=50] [num_samples=1] [seed=0] [stop_at_end_of_text=true] [cuda_graph=null]

The prompt is encoded with the checkpoint's own tokenizer (checked against data=<option> when
given; a checkpoint that does not record its tokenizer takes its run's data config or data=);
the context is cropped to the training length as the model generates (GPT.generate), which
decodes against a KV cache (kv_cache=false re-encodes the whole window for every token), on CUDA
with its decode step captured as one CUDA graph and replayed per token (cuda_graph=false: eager
steps, the same tokens).
A sample ends where the model writes the tokenizer's end-of-text token (the end of a document;
data/tokenizers.py says which tokenizers have one): the text stops before it and the sample is
marked as ended. `stop_at_end_of_text=false` generates all max_new_tokens tokens and shows the
token as `<|endoftext|>` where it occurs.
"""

from __future__ import annotations

import logging

import hydra
import torch
from omegaconf import DictConfig

from eval import command_line, common
from runs.model import LoadedRun, load_run
from runs.run import eval_result_path, resolve_checkpoints

log = logging.getLogger("attnlab.eval.generate")


def check_options(cfg: DictConfig) -> None:
    if not isinstance(cfg.max_new_tokens, int) or cfg.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {cfg.max_new_tokens!r}")
    if not isinstance(cfg.temperature, (int, float)) or cfg.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {cfg.temperature!r}")
    if cfg.top_k is not None and (not isinstance(cfg.top_k, int) or cfg.top_k < 1):
        raise ValueError(f"top_k must be a positive int or null, got {cfg.top_k!r}")
    if not isinstance(cfg.num_samples, int) or cfg.num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {cfg.num_samples!r}")
    if not isinstance(cfg.kv_cache, bool):
        raise ValueError(f"kv_cache must be true or false, got {cfg.kv_cache!r}")
    if cfg.cuda_graph is not None and not isinstance(cfg.cuda_graph, bool):
        raise ValueError(f"cuda_graph must be true, false or null (auto: on CUDA), got {cfg.cuda_graph!r}")
    if not isinstance(cfg.stop_at_end_of_text, bool):
        raise ValueError(f"stop_at_end_of_text must be true or false, got {cfg.stop_at_end_of_text!r}")
    if not isinstance(cfg.prompt, str) or cfg.prompt == "":
        raise ValueError('prompt must be a non-empty string, e.g. prompt="ROMEO:"')


def sample(run: LoadedRun, tokenizer, cfg: DictConfig, device: torch.device) -> list[tuple[str, bool]]:
    """num_samples continuations of the prompt (prompt text included), each with whether it ended at
    the end-of-text token (with stop_at_end_of_text; the text then stops before that token)."""
    ids = tokenizer.encode(cfg.prompt)
    if not ids:
        raise ValueError(f"prompt {cfg.prompt!r} encodes to no tokens with this tokenizer")
    vocab = run.model_config.vocab_size
    if max(ids) >= vocab:
        raise ValueError(f"the prompt encodes to token ids up to {max(ids)}, beyond the model's vocabulary ({vocab})")
    generator_seed = int(cfg.seed)
    torch.manual_seed(generator_seed)
    idx = torch.tensor([ids] * cfg.num_samples, dtype=torch.long, device=device)
    stop = tokenizer.end_of_text_id if cfg.stop_at_end_of_text else None
    with common.autocast(device, cfg.precision):
        out = run.model.generate(idx, cfg.max_new_tokens, temperature=float(cfg.temperature), top_k=cfg.top_k,
                                 kv_cache=cfg.kv_cache, stop_token=stop, graph=cfg.cuda_graph)
    samples = []
    for row in out.tolist():
        continuation = row[len(ids):]
        ended = stop is not None and stop in continuation
        if ended:
            continuation = continuation[: continuation.index(stop)]
        samples.append((tokenizer.decode(ids + continuation), ended))
    return samples


def run_generate(cfg: DictConfig) -> list[str]:
    command_line.require_ckpt(cfg)
    check_options(cfg)
    device = common.pick_device(cfg.device)
    paths = resolve_checkpoints(cfg.ckpt, cfg.which)
    if len(paths) != 1:
        raise ValueError(f"eval.generate samples from one checkpoint; ckpt={cfg.ckpt} gives {len(paths)}")
    run = load_run(paths[0], device=device, backend=cfg.backend)
    tokenizer, data_cfg = common.tokenizer_for_run(run, cfg)
    samples = sample(run, tokenizer, cfg, device)
    texts = [text for text, _ in samples]

    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    console = Console()
    for i, (text, ended) in enumerate(samples):
        body = Text(cfg.prompt, style="bold")
        body.append(text[len(cfg.prompt):] if text.startswith(cfg.prompt) else text)
        console.print(Panel(body, title=f"{run.variant} seed {run.seed} sample {i}", expand=False,
                            subtitle="ended: end of text" if ended else None))
    if cfg.out:
        common.write_json(
            eval_result_path(paths[0], "samples", "prompt", cfg.out),
            {"model": run.describe(), "samples": texts, "ended_at_end_of_text": [ended for _, ended in samples],
             "eval": common.eval_config_record(cfg, data_cfg)},
        )
    return texts


@hydra.main(version_base="1.3", config_path=common.CONFIG_DIR, config_name="eval/generate")
def main(cfg: DictConfig) -> None:
    with command_line.clean_errors():
        run_generate(cfg)


if __name__ == "__main__":
    command_line.run(main)
