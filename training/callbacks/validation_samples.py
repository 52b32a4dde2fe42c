"""Text samples at each validation, to read what the model writes as it trains.

ValidationSamples (train.log_samples: N prompts, 0 turns it off; train.sample_tokens: new tokens)
    After each validation (not the sanity check), on rank 0: the first `prompt_tokens` tokens of
    the first N validation sequences are continued with the KV cache (GPT.generate, temperature
    0.8, top-k 50, from a generator seeded by the step, so training's random state is untouched).
    Each sample is appended to <run>/samples.jsonl ({"step", "prompt", "sample"}) and, with a
    wandb logger, logged as the table `val/samples` (step, prompt, continuation). The samples run all
    `sample_tokens` tokens: an end-of-text token the model writes shows as <|endoftext|> in the text.
    Left out under sharded strategies (FSDP: no rank holds whole weights outside the wrapper), and
    with a warning when the weights or the logits are not finite: samples never stop a run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning as L
import torch

from training.sharding import shards_gradients
from models.lit import eager_mode

TEMPERATURE, TOP_K = 0.8, 50
log = logging.getLogger(__name__)


class ValidationSamples(L.Callback):
    def __init__(self, num_samples: int, max_new_tokens: int, run_dir: str | Path, prompt_tokens: int = 16):
        for name, value in (("train.log_samples", num_samples), ("train.sample_tokens", max_new_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.num_samples, self.max_new_tokens, self.prompt_tokens = num_samples, max_new_tokens, prompt_tokens
        self.enabled = bool(num_samples and max_new_tokens)  # false: configs/callbacks/ leaves it out
        self.path = Path(run_dir) / "samples.jsonl"
        self._prompts: torch.Tensor | None = None

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and not trainer.sanity_checking:
            x = batch[0]
            self._prompts = x[: self.num_samples, : min(self.prompt_tokens, x.shape[1] - 1)].detach().clone()

    def on_validation_epoch_end(self, trainer, pl_module):
        prompts, self._prompts = self._prompts, None
        if (prompts is None or not self.num_samples or not self.max_new_tokens or not trainer.is_global_zero
                or shards_gradients(trainer)):
            return
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if tokenizer is None:
            return
        generator = torch.Generator(device=prompts.device).manual_seed(int(trainer.global_step))
        model = pl_module.model
        finite = torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all()
        if not bool(finite):  # one host sync; non-finite weights happen in train.nonfinite=off runs
            log.warning("validation samples skipped at step %d: the model has non-finite weights", trainer.global_step)
            return
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), eager_mode(), trainer.precision_plugin.forward_context():
                # eager decode steps: a CUDA-graph capture (which synchronizes and empties the
                # allocator's cache) does not pay for a few samples inside a training run
                out = model.generate(prompts, self.max_new_tokens, temperature=TEMPERATURE, top_k=TOP_K,
                                     generator=generator, graph=False)
        except RuntimeError as error:  # finite weights, non-finite logits (an overflow): samples are optional
            if "probability tensor contains" not in str(error):
                raise
            log.warning("validation samples skipped at step %d: non-finite logits", trainer.global_step)
            return
        finally:
            model.train(was_training)
        rows = [{"step": int(trainer.global_step), "prompt": tokenizer.decode(p.tolist()),
                 "sample": tokenizer.decode(o[prompts.shape[1]:].tolist())} for p, o in zip(prompts.cpu(), out.cpu())]
        with self.path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        for logger in trainer.loggers:
            if logger.__class__.__name__ == "WandbLogger":
                logger.log_text(key="val/samples", columns=["step", "prompt", "sample"],
                                data=[[r["step"], r["prompt"], r["sample"]] for r in rows], step=trainer.global_step)
