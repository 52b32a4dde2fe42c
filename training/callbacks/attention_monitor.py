"""Whether attention rows open as training goes: per-layer attention statistics at each validation.

AttentionRowMonitor (train.attention_stats_sequences: N, 0 turns it off)
    At the first batch of each validation (not the sanity check), the first N sequences run once
    more, eagerly, with a pre-hook on every attention layer that recomputes the layer's float-exact
    weights (models/attention_diagnostics.py). Logged per layer, each the mean over heads:
    `val/attn/zero_fraction/layer{i}` (exact-zero share of visible weights), `val/attn/empty_rows/layer{i}`
    (share of query rows with no nonzero weight: such a row gives its query and every key no
    gradient), `val/attn/surviving_keys/layer{i}` (nonzero keys per row), `val/attn/sink_mass/layer{i}`
    (the first token's share of |w|); the same without `/layer{i}`, averaged over layers; and the
    learned per-head values of each layer's family module (`LayerExtras.per_head_values`), the
    differential variants' lambda as `val/lambda/layer{i}/head{h}`. Cost: one eager forward of N
    sequences and, per layer, a few float64 (N, heads, context, context) tensors.
"""

from __future__ import annotations

import lightning as L
import torch

from models.attention_diagnostics import HeadStats, layer_weights
from training.sharding import call_with_whole_params

LOGGED_METRICS = ("zero_fraction", "empty_rows", "surviving_keys", "sink_mass")


class AttentionRowMonitor(L.Callback):
    def __init__(self, sequences: int = 4):
        if not isinstance(sequences, int) or isinstance(sequences, bool) or sequences < 0:
            raise ValueError(f"train.attention_stats_sequences must be an int >= 0, got {sequences!r}")
        self.sequences = sequences
        self.enabled = sequences > 0  # false: configs/callbacks/ leaves the monitor out
        self._per_layer: list[dict] = []
        self._per_head_values: list[dict[str, list[float]]] = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx != 0 or trainer.sanity_checking or not self.sequences:
            return
        x, y = (t[: self.sequences] for t in batch)
        layers = [block.attn for block in pl_module.model.blocks]
        stats = [HeadStats(layer.n_head) for layer in layers]

        def hook(acc):
            return lambda module, args: acc.add(*layer_weights(module, args[0]))

        handles = [layer.register_forward_pre_hook(hook(acc)) for layer, acc in zip(layers, stats)]
        try:
            # eager (hooks do not fire inside compiled graphs), under the step's precision context;
            # a collective under FSDP, so every rank runs it (batch 0 of each)
            with torch.no_grad(), trainer.precision_plugin.forward_context():
                call_with_whole_params(trainer, pl_module, "_loss", (x, y), eager=True)
        finally:
            for h in handles:
                h.remove()
        self._per_layer = [acc.result() for acc in stats]
        self._per_head_values = [{name: values.detach().float().cpu().tolist()
                                  for name, values in layer.extras.per_head_values().items()} for layer in layers]

    def on_validation_epoch_end(self, trainer, pl_module):
        for name in LOGGED_METRICS:
            layer_means = []
            for i, result in enumerate(self._per_layer):
                values = [v for v in result[name] if v is not None]
                if values:
                    layer_means.append(sum(values) / len(values))
                    pl_module.log(f"val/attn/{name}/layer{i}", layer_means[-1], sync_dist=True)
            if layer_means:
                pl_module.log(f"val/attn/{name}", sum(layer_means) / len(layer_means), sync_dist=True)
        for i, per_head in enumerate(self._per_head_values):
            for name, values in per_head.items():
                for h, value in enumerate(values):
                    pl_module.log(f"val/{name}/layer{i}/head{h}", value)
        self._per_layer, self._per_head_values = [], []
