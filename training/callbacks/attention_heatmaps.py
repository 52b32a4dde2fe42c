"""Attention heatmaps at the end of a run: each layer and head's attention statistics after training.

AttentionHeatmapsAtEnd (configs/callbacks/default.yaml `attention_heatmaps`; `windows: 0` or
`callbacks.attention_heatmaps=null` turns it off)
    When training ends (after the last validation, while the model is still on its device and the
    loggers are open; a finished run that is resumed has nothing to train and writes none), on
    global rank 0: `windows` windows of the
    training context, evenly spaced over the validation split (the fixed sample eval.attention_stats
    takes, so the same run gives the same batch), run once, eagerly and one window at a time, through
    models/attention_diagnostics.attention_statistics. Written to <run>/attention_heatmaps/:
    step<N>.<metric>.png for every metric of METRICS (layers down, heads across) and step<N>.json
    (the per layer x head values, the step and the windows); logged as the images
    `attention/heatmap/<metric>` to wandb and tensorboard when those loggers are on.
    Never stops a run: any failure is a warning. Left out under sharded strategies (FSDP: no rank
    holds whole weights outside the wrapper), as validation samples are.
    Cost: one eager forward of `windows` x context tokens and, per layer and window, a few float64
    (heads, context, context) tensors; plotting takes about half a second on a CPU.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning as L
import numpy as np
import torch

from models.attention_diagnostics import METRICS, attention_statistics, plot_heatmaps, window_starts
from training.sharding import shards_gradients
from models.lit import eager_mode

log = logging.getLogger(__name__)


class AttentionHeatmapsAtEnd(L.Callback):
    def __init__(self, run_dir: str | Path, windows: int = 4):
        if not isinstance(windows, int) or isinstance(windows, bool) or windows < 0:
            raise ValueError(f"callbacks.attention_heatmaps.windows must be an int >= 0, got {windows!r}")
        self.directory = Path(run_dir) / "attention_heatmaps"
        self.windows = windows
        self.written: list[Path] = []  # the files of the last call (PNGs, then the JSON)

    def on_train_end(self, trainer, pl_module):
        self.written = []
        if not self.windows or not trainer.is_global_zero or shards_gradients(trainer):
            return
        try:
            self.written = self._write(trainer, pl_module)
        except Exception as error:  # heatmaps are a report, never a reason to lose a finished run
            log.warning("attention heatmaps skipped at step %d: %s: %s", trainer.global_step, type(error).__name__, error)
            return
        self._log_images(trainer, [p for p in self.written if p.suffix == ".png"])
        log.info("attention heatmaps: %s (%d windows)", self.directory, self.windows)

    def _write(self, trainer, pl_module) -> list[Path]:
        tokens = np.asarray(trainer.datamodule.token_ids("val"))
        context = pl_module.model.cfg.context
        starts = window_starts(len(tokens), context, self.windows * context)
        device = pl_module.device
        batches = (torch.from_numpy(tokens[s:s + context].astype(np.int64))[None].to(device) for s in starts)
        model = pl_module.model
        was_training = model.training
        model.eval()
        try:
            # eager: the statistics come from forward hooks, which do not fire inside compiled graphs
            with torch.no_grad(), eager_mode(), trainer.precision_plugin.forward_context():
                stats = attention_statistics(model, batches)
        finally:
            model.train(was_training)
        values = [v for name in METRICS for layer in stats["metrics"][name] for v in layer if v is not None]
        if not np.isfinite(values).all():
            raise ValueError("the statistics are not finite (non-finite weights or activations)")
        self.directory.mkdir(parents=True, exist_ok=True)
        step = int(trainer.global_step)
        prefix = self.directory / f"step{step}"
        seed = getattr(trainer.datamodule, "seed", None)
        label = f"{model.cfg.attn.name} s{seed} step {step}"
        images = plot_heatmaps(stats["metrics"], label, prefix)
        record = prefix.with_suffix(".json")
        record.write_text(json.dumps({"step": step, "variant": model.cfg.attn.name, "split": "val",
                                      "window_starts": starts, "seq_len": context, **stats}, indent=1))
        return [*images, record]

    @staticmethod
    def _log_images(trainer, images: list[Path]) -> None:
        step = int(trainer.global_step)
        for logger in trainer.loggers:
            kind = logger.__class__.__name__
            try:
                if kind == "WandbLogger":
                    for path in images:
                        logger.log_image(key=f"attention/heatmap/{metric_of(path)}", images=[str(path)], step=step)
                elif kind == "TensorBoardLogger":
                    import matplotlib.image

                    for path in images:
                        rgb = matplotlib.image.imread(path)[..., :3]  # float in [0, 1], alpha dropped
                        logger.experiment.add_image(f"attention/heatmap/{metric_of(path)}", rgb, global_step=step,
                                                    dataformats="HWC")
            except Exception as error:  # the PNGs are written; a logger that refuses them costs only its copy
                log.warning("attention heatmaps not logged to %s: %s: %s", kind, type(error).__name__, error)


def metric_of(path: Path) -> str:
    """The metric of a heatmap file step<N>.<metric>.png."""
    return path.name.split(".")[-2]
