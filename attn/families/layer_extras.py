"""A family's part of a model's attention layer: the module that holds the family's per-layer
parameters and forms the extra per-call tensors (`attn.attention`'s `extra` mapping, with the keys
`Family.extra_inputs(spec)`) from the layer's q/k views.

A model builds one per layer with `Family.layer_extras(spec, shape, options)` and calls it on the
views it projected (`Variant.views` of them); the families without extra tensors get `LayerExtras`
itself, which holds nothing and forms nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class LayerShape:
    """An attention layer as its family's layer module sees it."""

    layer_index: int  # 0 for the first layer
    n_head: int  # query heads
    n_kv_head: int  # key/value heads
    head_dim: int
    views: int  # q/k views the layer projects (`Variant.views`); view 0 is attention's own q and k


class LayerExtras(nn.Module):
    """The base: no parameters, no extra tensors, the output as it is. A family whose spec takes
    extra tensors returns a subclass from `Family.layer_extras`.

    `output_scale`: a constant the model multiplies the attention output by, after the per-head output
    norm and before the projection (a number, so that the model folds it into the norm's kernel
    instead of a multiply and its backward per layer)."""

    output_scale: float = 1.0

    def forward(self, qs: list[torch.Tensor], ks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The extra mapping from the layer's q views `qs` (B, N, H, D) and k views `ks`
        (B, KV, H_kv, D), after RoPE and QK-norm, in attention's dtype."""
        return {}

    def per_head_values(self) -> dict[str, torch.Tensor]:
        """Learned per-head quantities by name, each (H,) in fp32: what the validation monitor logs
        as `val/<name>/layer{i}/head{h}`."""
        return {}
