"""The sigmoid family: sigmoid attention (Ramapuram et al. 2024, FlashSigmoid; DESIGN.md §4).

w_ij = sigmoid(s q_i.k_j + b_i) over visible keys, no row normalization; s = sm_scale (default
D^-1/2), b_i = the configured bias or, when null, -ln(n_i) with n_i the keys query i sees (so a
row's weights sum to about 1 while the scores are small). Rows that see nothing output 0. One
fused kernel (attn/kernels/sigmoid_family.py).
"""

from __future__ import annotations

import torch

from attn.families.base import Family, per_query_head_scores, visibility
from attn.masks import MaskSpec
from attn.specs import SigmoidFamilySpec


def sigmoid_bias(counts: torch.Tensor) -> torch.Tensor:
    """b_i = -ln(n_i); rows with n_i = 0 see nothing, b is then 0."""
    return -torch.log(counts.clamp_min(1.0))


def sigmoid_family_weights(q, k, spec: SigmoidFamilySpec, mask: MaskSpec, segment_ids=None,
                           key_lengths=None) -> torch.Tensor:
    """Weights (B, H, N, KV) of sigmoid attention; masked entries are 0."""
    visible, counts = visibility(q, k, mask, segment_ids, key_lengths, counts=spec.bias is None)
    z = per_query_head_scores(q, k) * spec.scale(q.shape[3])
    if spec.bias is None:
        z = z + sigmoid_bias(counts.to(q.dtype))[:, None, :, None]
    else:
        z = z + spec.bias
    return torch.sigmoid(z).masked_fill(~visible, 0.0)


class SigmoidFamily(Family):
    name = "sigmoid"
    spec_type = SigmoidFamilySpec
    kernel_path = "attn.kernels.sigmoid_family:fused_attention"
    # the logit s q.k + b_i exists and grows like softmax's (the paper's instability): monitored
    has_max_logit = True

    def extra_inputs(self, spec) -> tuple[str, ...]:
        return ()

    def validate(self, spec, q, k, *, temperature, extra) -> None:
        self.checked_extra(spec, extra)
        if temperature is not None:
            raise ValueError("temperature is only defined for the softmax family; got one for attn=sigmoid")

    def reference_weights(self, q, k, spec, mask, segment_ids=None, key_lengths=None, *, temperature=None,
                          extra=None):
        self.checked_extra(spec, extra)
        return sigmoid_family_weights(q, k, spec, mask, segment_ids, key_lengths)

    def scores(self, spec, qk, head_dim):
        return qk * spec.scale(head_dim)

    def logits(self, spec, qk, head_dim, n_visible=None):
        # y + b_i with y = s q.k: the argument of the sigmoid, as `sigmoid_family_weights` forms it
        z = qk * spec.scale(head_dim)
        if spec.bias is not None:
            return z + spec.bias
        if n_visible is None:
            raise ValueError("n_visible (the keys each query sees, attn.visible_key_counts) is required for the "
                             "logits of attn=sigmoid with bias null: b_i = -ln(n_i)")
        return z + sigmoid_bias(n_visible.to(z.dtype))[..., None]


FAMILY = SigmoidFamily()
