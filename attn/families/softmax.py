"""The softmax family: softmax, softcap (tanh, soft_sign) and alsc (DESIGN.md §4).

z = t_i * cap(sm_scale * q.k), weights = softmax over visible keys; one fused kernel serves every
cap (attn/kernels/softmax_family.py).
"""

from __future__ import annotations

import torch

from attn.caps import apply_cap
from attn.families.base import Family, check_tensor, per_query_head_scores, visibility
from attn.masks import MaskSpec
from attn.specs import SoftmaxFamilySpec


def softmax_family_weights(
    q, k, spec: SoftmaxFamilySpec, mask: MaskSpec, segment_ids=None, temperature=None, key_lengths=None
) -> torch.Tensor:
    """Attention weights (B, H, N, KV); fully masked rows are all zero."""
    d = q.shape[3]
    z = apply_cap(per_query_head_scores(q, k) * spec.scale(d), spec.cap, spec.cap_value, spec.knee)
    if temperature is not None:
        z = z * temperature[:, None, :, None].to(z.dtype)
    visible, _ = visibility(q, k, mask, segment_ids, key_lengths)
    z = z.masked_fill(~visible, float("-inf"))
    row_max = z.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(z - row_max)  # exactly 0 where masked
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


class SoftmaxFamily(Family):
    name = "softmax"
    spec_type = SoftmaxFamilySpec
    kernel_path = "attn.kernels.softmax_family:fused_attention"
    has_max_logit = True

    def extra_inputs(self, spec) -> tuple[str, ...]:
        return ()  # the per-query temperature is `attn.attention`'s own argument

    def validate(self, spec, q, k, *, temperature, extra) -> None:
        self.checked_extra(spec, extra)
        b, n = q.shape[:2]
        if temperature is not None:
            if not isinstance(temperature, torch.Tensor):
                raise ValueError(f"temperature must be a torch.Tensor, got {type(temperature).__name__}")
            if not temperature.dtype.is_floating_point:
                raise ValueError(f"temperature must be a floating tensor, got dtype {temperature.dtype}")
            check_tensor("temperature", temperature, 2, temperature.dtype, q.device)
            if tuple(temperature.shape) != (b, n):
                raise ValueError(f"temperature must have shape (B, N) = ({b}, {n}), got {tuple(temperature.shape)}")

    def reference_weights(self, q, k, spec, mask, segment_ids=None, key_lengths=None, *, temperature=None,
                          extra=None):
        self.checked_extra(spec, extra)
        return softmax_family_weights(q, k, spec, mask, segment_ids, temperature, key_lengths)

    def scores(self, spec, qk, head_dim):
        return qk * spec.scale(head_dim)

    def logits(self, spec, qk, head_dim, n_visible=None):
        return apply_cap(qk * spec.scale(head_dim), spec.cap, spec.cap_value, spec.knee)

    def serves_sdpa(self, spec) -> bool:
        return spec.cap == "none"


FAMILY = SoftmaxFamily()
