"""Float-exact PyTorch reference of every variant (DESIGN.md §4); each family's weights live in
its module (attn/families/), this module applies them to v.

Dense O(N^2) and deliberately plain: this is the ground truth every kernel is tested
against (in float64) and the backend used off-GPU. It computes in the inputs' dtype, so
the same code in bf16/fp16 gives the "same-dtype PyTorch error" of the tolerance rule.
"""

from __future__ import annotations

import torch

from attn.dropout import apply_dropout, reference_keep_mask
from attn.families import family_of
from attn.families.sigmoid import sigmoid_family_weights
from attn.families.softmax import softmax_family_weights
from attn.families.threshold import threshold_family_weights, threshold_tau
from attn.masks import MaskSpec


def attention_weights(q, k, spec, mask: MaskSpec, segment_ids=None, temperature=None, *, extra=None,
                      key_lengths=None):
    """Weights (B, H, N, KV) of any registered variant: what diagnostics read. `extra` maps the
    names of the family's `extra_inputs(spec)` to tensors."""
    return family_of(spec).reference_weights(q, k, spec, mask, segment_ids, key_lengths, temperature=temperature,
                                             extra=extra)


def reference_attention(
    q, k, v, spec, mask: MaskSpec, segment_ids=None, temperature=None, *, extra=None,
    dropout_p: float = 0.0, dropout_mask=None, dropout_seed=None, key_lengths=None,
) -> torch.Tensor:
    """out (B, N, H, D) = weights @ v, GQA by repeating kv heads; k/v may hold more rows than q
    (KV >= N, bottom-right aligned: attn/masks.py). `extra` maps the names of the family's
    `extra_inputs(spec)` to tensors (the differential threshold's second view and lambda).
    `key_lengths` (B,): only keys [0, L_b) of row b exist (`attn.masks.length_mask`); the slots
    beyond (of k, v and the family's key-aligned extra tensors) are zeroed before use, so whatever
    they hold (an unwritten cache, NaN) never reaches the output, and on CPU those past the
    longest row are not computed at all.

    dropout_p > 0 drops the weights (attn/dropout.py): with the keep mask `dropout_mask` (bool,
    broadcastable to (B, H, N, N); tests pass the kernels' own), else one drawn with torch (from
    `dropout_seed` when given, else torch's generator)."""
    family = family_of(spec)
    extra = family.checked_extra(spec, extra)
    if key_lengths is not None:
        key_aligned = family.key_aligned_inputs(spec)
        keys = {"k": k, "v": v, **{name: extra[name] for name in key_aligned}}
        if k.device.type == "cpu" and not torch.compiler.is_compiling():
            # the slots past the longest row are invisible to every row: dropped where reading the
            # lengths costs nothing (a CPU cache of capacity C would otherwise cost C per step)
            longest = max(1, min(int(key_lengths.max()), k.shape[1]))
            keys = {name: t[:, :longest] for name, t in keys.items()}
        filled = (torch.arange(keys["k"].shape[1], device=k.device)[None, :]
                  < key_lengths.to(torch.int64)[:, None])[:, :, None, None]
        keys = {name: t.masked_fill(~filled, 0.0) for name, t in keys.items()}
        k, v = keys.pop("k"), keys.pop("v")
        extra = {**extra, **keys}
    w = attention_weights(q, k, spec, mask, segment_ids, temperature, extra=extra, key_lengths=key_lengths)
    if dropout_p > 0.0:
        if dropout_mask is None:
            dropout_mask = reference_keep_mask(w.shape, dropout_p, w.device, dropout_seed)
        w = apply_dropout(w, dropout_p, dropout_mask)
    group = q.shape[2] // v.shape[2]
    return torch.einsum("bhij,bjhd->bihd", w, v.repeat_interleave(group, dim=2))


def exact_zero_fraction(weights: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Per head fraction of visible (i, j) whose weight is exactly 0: (H,)."""
    visible = visible.expand_as(weights)
    zeros = ((weights == 0) & visible).sum(dim=(0, 2, 3)).double()
    return zeros / visible.sum(dim=(0, 2, 3)).double().clamp_min(1)


__all__ = [
    "attention_weights",
    "reference_attention",
    "sigmoid_family_weights",
    "softmax_family_weights",
    "threshold_family_weights",
    "threshold_tau",
    "exact_zero_fraction",
]
