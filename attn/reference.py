"""Float-exact PyTorch implementations of both families (DESIGN.md §4).

Dense O(N^2) and deliberately plain: this is the ground truth every kernel is tested
against (in float64) and the backend used off-GPU. It computes in the inputs' dtype, so
the same code in bf16/fp16 gives the "same-dtype PyTorch error" of the tolerance rule.
"""

from __future__ import annotations

import torch

from attn.caps import apply_cap
from attn.dropout import apply_dropout, reference_keep_mask
from attn.masks import MaskSpec, dense_mask, length_mask, visible_key_counts
from attn.specs import SoftmaxFamilySpec, ThresholdFamilySpec


def _per_query_head_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q (B,N,H,D), k (B,KV,Hkv,D) -> q.k (B,H,N,KV); GQA by repeating kv heads."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    return torch.einsum("bihd,bjhd->bhij", q, k)


def threshold_tau(beta: float, head_dim: int, counts: torch.Tensor) -> torch.Tensor:
    """tau_i = beta * sqrt(2 ln(n_i) / D); rows with n_i = 0 see nothing, tau is then 0."""
    return beta * torch.sqrt(2.0 * torch.log(counts.clamp_min(1.0)) / head_dim)


def _visibility(q, k, mask: MaskSpec, segment_ids, key_lengths, counts: bool = False):
    """(visible (B or 1, 1, N, KV) bool, n_i (B or 1, N) float or None unless `counts`): the mask of
    `dense_mask`, or with per-row `key_lengths` that of `length_mask` (n_i then counts its keys)."""
    n = q.shape[1]
    if key_lengths is not None:
        visible = length_mask(mask, n, key_lengths, k.shape[1])
        return visible[:, None], visible.sum(dim=-1).float() if counts else None
    visible = dense_mask(mask, n, segment_ids, device=q.device, kv_len=k.shape[1])
    n_i = visible_key_counts(mask, n, segment_ids, device=q.device, kv_len=k.shape[1]) if counts else None
    return visible[:, None], n_i


def softmax_family_weights(
    q, k, spec: SoftmaxFamilySpec, mask: MaskSpec, segment_ids=None, temperature=None, key_lengths=None
) -> torch.Tensor:
    """Attention weights (B, H, N, KV); fully masked rows are all zero."""
    d = q.shape[3]
    z = apply_cap(_per_query_head_scores(q, k) * spec.scale(d), spec.cap, spec.cap_value, spec.knee)
    if temperature is not None:
        z = z * temperature[:, None, :, None].to(z.dtype)
    visible, _ = _visibility(q, k, mask, segment_ids, key_lengths)
    z = z.masked_fill(~visible, float("-inf"))
    row_max = z.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(z - row_max)  # exactly 0 where masked
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


def _rectified_power(x: torch.Tensor, power: float) -> torch.Tensor:
    """relu(x)^p; a NaN score stays NaN (as relu's does), so non-finite inputs reach the output."""
    positive = x > 0
    # where() on the base keeps the gradient finite at 0 for p < 1
    base = torch.where(positive, x, torch.ones_like(x))
    if power == 1.0:
        w = torch.where(positive, x, torch.zeros_like(x))
    else:
        w = torch.where(positive, base**power, torch.zeros_like(x))
    return torch.where(torch.isnan(x), x, w)


def threshold_family_weights(
    q, k, spec: ThresholdFamilySpec, mask: MaskSpec, segment_ids=None, q2=None, k2=None, lam=None, key_lengths=None
) -> torch.Tensor:
    """Signed weights (B, H, N, KV) of threshold(-differential) attention; masked entries are 0."""
    d = q.shape[3]
    visible, counts = _visibility(q, k, mask, segment_ids, key_lengths, counts=True)
    tau = threshold_tau(spec.beta, d, counts.to(q.dtype))[:, None, :, None]

    def view(qv, kv):
        w = _rectified_power(_per_query_head_scores(qv, kv) - tau, spec.power)
        return w.masked_fill(~visible, 0.0)

    w = view(q, k)
    if spec.differential:
        w = w - lam.to(w.dtype)[None, :, None, None] * view(q2, k2)
    return w


def attention_weights(q, k, spec, mask: MaskSpec, segment_ids=None, temperature=None, q2=None, k2=None, lam=None,
                      key_lengths=None):
    """Weights (B, H, N, KV) of any registered variant: what diagnostics read."""
    if isinstance(spec, SoftmaxFamilySpec):
        return softmax_family_weights(q, k, spec, mask, segment_ids, temperature, key_lengths)
    return threshold_family_weights(q, k, spec, mask, segment_ids, q2, k2, lam, key_lengths)


def reference_attention(
    q, k, v, spec, mask: MaskSpec, segment_ids=None, temperature=None, q2=None, k2=None, lam=None,
    *, dropout_p: float = 0.0, dropout_mask=None, dropout_seed=None, key_lengths=None,
) -> torch.Tensor:
    """out (B, N, H, D) = weights @ v, GQA by repeating kv heads; k/v may hold more rows than q
    (KV >= N, bottom-right aligned: attn/masks.py). `key_lengths` (B,): only keys [0, L_b) of row b
    exist (`attn.masks.length_mask`); the slots beyond are zeroed before use, so whatever they hold
    (an unwritten cache, NaN) never reaches the output, and on CPU those past the longest row are
    not computed at all.

    dropout_p > 0 drops the weights (attn/dropout.py): with the keep mask `dropout_mask` (bool,
    broadcastable to (B, H, N, N); tests pass the kernels' own), else one drawn with torch (from
    `dropout_seed` when given, else torch's generator)."""
    if key_lengths is not None:
        if k.device.type == "cpu" and not torch.compiler.is_compiling():
            # the slots past the longest row are invisible to every row: dropped where reading the
            # lengths costs nothing (a CPU cache of capacity C would otherwise cost C per step)
            longest = max(1, min(int(key_lengths.max()), k.shape[1]))
            k, v = k[:, :longest], v[:, :longest]
            k2 = k2[:, :longest] if k2 is not None else None
        filled = (torch.arange(k.shape[1], device=k.device)[None, :]
                  < key_lengths.to(torch.int64)[:, None])[:, :, None, None]
        k, v = k.masked_fill(~filled, 0.0), v.masked_fill(~filled, 0.0)
        if k2 is not None:
            k2 = k2.masked_fill(~filled, 0.0)
    w = attention_weights(q, k, spec, mask, segment_ids, temperature, q2, k2, lam, key_lengths)
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
    "softmax_family_weights",
    "threshold_family_weights",
    "threshold_tau",
    "exact_zero_fraction",
]
