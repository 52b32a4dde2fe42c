"""The interface every attention family implements, and the pieces its references share.

A family is one unit (DESIGN.md §1): its spec type, the spec-level input checks, the float-exact
reference weights, the quantities statistics read (raw scores and the logits the weights are a
function of), whether it has a max logit, the extra per-call tensors it takes, the module a model
layer holds to form them (attn/families/layer_extras.py) with the model options that module reads,
and its fused kernel, imported lazily so that the reference path never imports Triton.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from attn.families.layer_extras import LayerExtras, LayerShape
from attn.masks import MaskSpec, dense_mask, length_mask, visible_key_counts


def check_tensor(name: str, t, ndim: int, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have the dtype of q ({dtype}), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}), got {t.device}")


def per_query_head_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q (B,N,H,D), k (B,KV,Hkv,D) -> q.k (B,H,N,KV); GQA by repeating kv heads."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    return torch.einsum("bihd,bjhd->bhij", q, k)


def visibility(q, k, mask: MaskSpec, segment_ids, key_lengths, counts: bool = False):
    """(visible (B or 1, 1, N, KV) bool, n_i (B or 1, N) float or None unless `counts`): the mask of
    `dense_mask`, or with per-row `key_lengths` that of `length_mask` (n_i then counts its keys)."""
    n = q.shape[1]
    if key_lengths is not None:
        visible = length_mask(mask, n, key_lengths, k.shape[1])
        return visible[:, None], visible.sum(dim=-1).float() if counts else None
    visible = dense_mask(mask, n, segment_ids, device=q.device, kv_len=k.shape[1])
    n_i = visible_key_counts(mask, n, segment_ids, device=q.device, kv_len=k.shape[1]) if counts else None
    return visible[:, None], n_i


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(repr(n) for n in names) if names else "none (this spec takes no extra tensors)"


class Family:
    """One attention family. Subclasses set the class attributes and implement the methods."""

    name: ClassVar[str]
    spec_type: ClassVar[type]
    kernel_path: ClassVar[str]  # "module:function" of the fused implementation
    has_max_logit: ClassVar[bool]  # a pre-softmax logit exists (what the max-logit monitor logs)

    def extra_inputs(self, spec) -> tuple[str, ...]:
        """Names of the per-call tensors `spec` takes beyond q, k, v: the keys of the `extra` mapping."""
        raise NotImplementedError

    def key_aligned_inputs(self, spec) -> tuple[str, ...]:
        """The names among `extra_inputs(spec)` of tensors laid out like k (B, KV, H_kv, D): a static
        KV cache holds them, and `key_lengths` hides their unfilled slots as it hides k's."""
        return ()

    def layer_options(self, spec) -> Mapping[str, tuple]:
        """The model options (AttnConfig's fields, by name) that `layer_extras` reads for `spec`, each
        with its allowed values; `attn.check_layer_options` checks a model config against them."""
        return {}

    def layer_extras(self, spec, shape: LayerShape, options: Mapping[str, Any]) -> LayerExtras:
        """The module one model layer holds for `spec`: its family's per-layer parameters, and the
        extra per-call tensors (the keys `extra_inputs(spec)`) it forms from the layer's q/k views.
        `options` maps model options to values (at least the names of `layer_options(spec)`). The
        base: no parameters, no tensors (a family whose spec takes none)."""
        return LayerExtras()

    def checked_extra(self, spec, extra: Mapping[str, Any] | None) -> Mapping[str, Any]:
        """`extra` (None means empty) with exactly the keys `extra_inputs(spec)`; a ValueError naming
        the unexpected or missing key and the allowed names otherwise. The values are checked by
        `validate`."""
        allowed = self.extra_inputs(spec)
        if not allowed and (extra is None or (type(extra) is dict and not extra)):
            return {}  # the common call: a family without extra tensors, given none
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ValueError(f"extra must be a mapping of name to tensor with the keys {_names(allowed)} "
                             f"for {spec!r}, got {type(extra).__name__}")
        for key in extra:
            if key not in allowed:
                raise ValueError(f"extra has an unexpected key {key!r}: the allowed keys for {spec!r} are "
                                 f"{_names(allowed)}")
        for key in allowed:
            if key not in extra:
                raise ValueError(f"extra is missing the key {key!r}: {spec!r} needs the keys {_names(allowed)}")
        return extra

    def validate(self, spec, q, k, *, temperature, extra: Mapping[str, Any]) -> None:
        """The spec-level checks of `attn.attention`'s inputs (the generic ones ran before): the
        temperature, and the `extra` mapping's keys (`checked_extra`) and tensors."""
        raise NotImplementedError

    def reference_weights(self, q, k, spec, mask: MaskSpec, segment_ids=None, key_lengths=None, *,
                          temperature=None, extra: Mapping[str, Any] | None = None) -> torch.Tensor:
        """Float-exact weights (B, H, N, KV); `extra` maps the `extra_inputs(spec)` names to tensors."""
        raise NotImplementedError

    def scores(self, spec, qk: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The raw score of the statistics from q.k: before any cap, after the family's scale."""
        raise NotImplementedError

    def logits(self, spec, qk: torch.Tensor, head_dim: int, n_visible: torch.Tensor | None = None) -> torch.Tensor:
        """The quantity a row's weights are a function of, from q.k (what `max_logit` reads).

        `n_visible`: the number of keys each query sees (`attn.visible_key_counts`), shaped like qk
        without its last (key) axis or broadcastable to that, e.g. (B, 1, N) for qk (B, H, N, KV).
        A family whose logits depend on it (sigmoid with a null bias: b_i = -ln(n_i)) raises a
        ValueError without it; the others ignore it."""
        raise NotImplementedError

    def serves_sdpa(self, spec) -> bool:
        """Whether torch's scaled_dot_product_attention computes `spec` (backend='sdpa')."""
        return False

    def kernel(self) -> Callable:
        """The fused implementation (imports Triton on first use)."""
        module, fn = self.kernel_path.split(":")
        # sys.modules first: torch.compile traces a dict lookup, but not importlib (graph break)
        loaded = sys.modules.get(module)
        if loaded is None:
            loaded = importlib.import_module(module)
        return getattr(loaded, fn)
