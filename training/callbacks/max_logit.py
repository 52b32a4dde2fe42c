"""The largest attention logit per layer at each validation.

MaxLogitMonitor (train.log_max_logit: true)
    At the first validation batch, the largest scaled score s*q.k (before any cap) over the
    visible (causal, windowed) positions of each layer whose family has a max logit
    (`attn.family_of(spec).has_max_logit`: the softmax family), as
    `val/max_logit/layer{i}`. Computed in fp32 from the layer's own q/k projection in a forward
    pre-hook: one extra QK^T per layer per validation, nothing during training.
"""

from __future__ import annotations

import math

import lightning as L
import torch

import attn
from models.attention_diagnostics import per_head_scores
from training.sharding import call_with_whole_params


class MaxLogitMonitor(L.Callback):
    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)  # false: configs/callbacks/ leaves the monitor out
        self._max: dict[int, float] = {}

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx != 0 or trainer.sanity_checking:
            return
        handles = [
            block.attn.register_forward_pre_hook(self._hook(i))
            for i, block in enumerate(pl_module.model.blocks) if attn.family_of(block.attn.spec).has_max_logit
        ]
        if not handles:
            return
        try:
            # eager: hooks do not fire inside compiled graphs. The precision plugin's context
            # (autocast), as in the training step: under FSDP mixed precision the weights are bf16
            # and a plain fp32 forward would fail. Every rank runs this (batch 0 of each).
            with trainer.precision_plugin.forward_context():
                call_with_whole_params(trainer, pl_module, "_loss", batch, eager=True)
        finally:
            for h in handles:
                h.remove()

    def _hook(self, index: int):
        def pre_hook(layer, args):
            x = args[0]
            with torch.autocast(device_type=x.device.type, enabled=False):
                # the projection runs in its weights' dtype (bf16 under FSDP mixed precision,
                # fp32 otherwise); the scores in fp32
                qs, ks, _ = layer.split_heads(x.to(layer.qkv.weight.dtype))
                qs, ks = [q.float() for q in qs], [k.float() for k in ks]
                family = attn.family_of(layer.spec)
                scores = family.scores(layer.spec, per_head_scores(qs[0], ks[0]), qs[0].shape[-1])
                visible = attn.dense_mask(attn.MaskSpec(causal=True, window=layer.window), x.shape[1], device=x.device)
                self._max[index] = scores.masked_fill(~visible[:, None], -math.inf).amax().item()

        return pre_hook

    def on_validation_epoch_end(self, trainer, pl_module):
        for i, value in sorted(self._max.items()):
            pl_module.log(f"val/max_logit/layer{i}", value, sync_dist=True, reduce_fx="max")
        self._max = {}
