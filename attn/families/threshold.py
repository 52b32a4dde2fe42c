"""The threshold family: threshold and diff_threshold (DESIGN.md §4).

w = relu(q.k - tau_i)^p [- lambda_h relu(q2.k2 - tau_i)^p], no softmax, no row normalization; one
fused kernel serves both (the second view is a compile-time switch, attn/kernels/threshold_family.py).
The differential form's model side (second q/k view, lambda parametrizations) is attn/families/differential.py.
"""

from __future__ import annotations

import torch

from attn.families.base import Family, check_tensor, per_query_head_scores, visibility
from attn.families.differential import LAMBDA_MODES, LAMBDA_PARAMETRIZATIONS
from attn.families.layer_extras import LayerExtras
from attn.masks import MaskSpec
from attn.specs import ThresholdFamilySpec


def threshold_tau(beta: float, head_dim: int, counts: torch.Tensor) -> torch.Tensor:
    """tau_i = beta * sqrt(2 ln(n_i) / D); rows with n_i = 0 see nothing, tau is then 0."""
    return beta * torch.sqrt(2.0 * torch.log(counts.clamp_min(1.0)) / head_dim)


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
    visible, counts = visibility(q, k, mask, segment_ids, key_lengths, counts=True)
    tau = threshold_tau(spec.beta, d, counts.to(q.dtype))[:, None, :, None]

    def view(qv, kv):
        w = _rectified_power(per_query_head_scores(qv, kv) - tau, spec.power)
        return w.masked_fill(~visible, 0.0)

    w = view(q, k)
    if spec.differential:
        w = w - lam.to(w.dtype)[None, :, None, None] * view(q2, k2)
    return w


class ThresholdFamily(Family):
    name = "threshold"
    spec_type = ThresholdFamilySpec
    kernel_path = "attn.kernels.threshold_family:fused_attention"
    has_max_logit = False  # no softmax: no pre-softmax logit

    def extra_inputs(self, spec) -> tuple[str, ...]:
        # the second view's queries and keys and the per-head lambda (H,)
        return ("q2", "k2", "lam") if spec.differential else ()

    def key_aligned_inputs(self, spec) -> tuple[str, ...]:
        return ("k2",) if spec.differential else ()

    def layer_options(self, spec):
        return {"lambda_mode": LAMBDA_MODES} if spec.differential else {}

    def layer_extras(self, spec, shape, options):
        # the differential form: the second view and lambda, by lambda_mode (attn/families/differential.py)
        if not spec.differential:
            return LayerExtras()
        mode = options.get("lambda_mode")
        if mode not in LAMBDA_PARAMETRIZATIONS:
            raise ValueError(f"attn.lambda_mode must be one of {LAMBDA_MODES}, got {mode!r}")
        return LAMBDA_PARAMETRIZATIONS[mode](shape)

    def validate(self, spec, q, k, *, temperature, extra) -> None:
        extra = self.checked_extra(spec, extra)
        h = q.shape[2]
        if temperature is not None:
            raise ValueError("temperature is only defined for the softmax family; got one for a threshold variant")
        if spec.differential:
            q2, k2, lam = extra["q2"], extra["k2"], extra["lam"]
            check_tensor("q2", q2, 4, q.dtype, q.device)
            check_tensor("k2", k2, 4, q.dtype, q.device)
            if q2.shape != q.shape or k2.shape != k.shape:
                raise ValueError(
                    f"q2/k2 must match q/k shapes {tuple(q.shape)}/{tuple(k.shape)}, "
                    f"got {tuple(q2.shape)}/{tuple(k2.shape)}"
                )
            if not isinstance(lam, torch.Tensor) or tuple(lam.shape) != (h,):
                raise ValueError(f"lam must be a tensor of shape (H,) = ({h},), got {getattr(lam, 'shape', lam)}")

    def reference_weights(self, q, k, spec, mask, segment_ids=None, key_lengths=None, *, temperature=None,
                          extra=None):
        extra = self.checked_extra(spec, extra)
        return threshold_family_weights(q, k, spec, mask, segment_ids, extra.get("q2"), extra.get("k2"),
                                        extra.get("lam"), key_lengths)

    def scores(self, spec, qk, head_dim):
        return qk  # no sm_scale: x = q.k, compared with tau

    def logits(self, spec, qk, head_dim, n_visible=None):
        return qk


FAMILY = ThresholdFamily()
