"""Variant registry: name -> spec builder, model-side defaults and kernel location.

Adding a variant touches this table, its family's unit (attn/families/<family>.py: reference,
validation, statistics, lazy kernel), its family's kernel module, one `configs/attn/<name>.yaml` and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from attn.families import family_of
from attn.specs import AttentionSpec, SigmoidFamilySpec, SoftmaxFamilySpec, ThresholdFamilySpec


@dataclass(frozen=True)
class Variant:
    name: str
    family: str  # a key of attn.families.FAMILIES: "softmax" | "threshold" | "sigmoid"
    build: Callable[..., AttentionSpec]
    params: tuple[str, ...]  # config keys accepted by `build`
    qk_norm: bool = False  # model default: L2-normalize q and k
    out_norm: bool = False  # model default: per-head RMSNorm of the attention output
    views: int = 1  # 2 for differential variants (second q/k projection, learnable lambda)
    summary: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)

    def make_spec(self, **params) -> AttentionSpec:
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            raise ValueError(
                f"attn={self.name} does not take {unknown}; allowed parameters: {list(self.params)}"
            )
        return self.build(**{**self.defaults, **params})


def _softmax_family(method: str):
    def build(cap: float = 30.0, knee: float = 0.5, sm_scale: float | None = None):
        return SoftmaxFamilySpec(cap=method, cap_value=cap, knee=knee, sm_scale=sm_scale)

    return build


def _threshold_family(differential: bool):
    def build(beta: float = 1.0, power: float = 2.0):
        return ThresholdFamilySpec(beta=beta, power=power, differential=differential)

    return build


def _sigmoid_family(bias: float | None = None, sm_scale: float | None = None):
    return SigmoidFamilySpec(bias=bias, sm_scale=sm_scale)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("softmax", "softmax", _softmax_family("none"), ("sm_scale",),
                summary="z = t * s q.k"),
        Variant("softcap_tanh", "softmax", _softmax_family("tanh"), ("cap", "sm_scale"),
                summary="z = t * c tanh(s q.k / c)"),
        Variant("softcap_softsign", "softmax", _softmax_family("soft_sign"), ("cap", "sm_scale"), summary="z = t * y / (1 + |y|/c), y = s q.k"),
        Variant("alsc", "softmax", _softmax_family("alsc"), ("cap", "knee", "sm_scale"),
                summary="identity on [-kc, kc], tanh-shaped to the cap c beyond"),
        Variant("threshold", "threshold", _threshold_family(False), ("beta", "power"),
                qk_norm=True, out_norm=True, summary="w = relu(q.k - tau_i)^p, no softmax"),
        Variant("diff_threshold", "threshold", _threshold_family(True), ("beta", "power"), qk_norm=True, out_norm=True, views=2,
                summary="w = relu(x1 - tau)^p - lambda_h relu(x2 - tau)^p"),
        # out_norm: the paper stabilizes the output norm (hybrid-norm); its QK-norm is learned (yaml: rms), not l2
        Variant("sigmoid", "sigmoid", _sigmoid_family, ("bias", "sm_scale"), out_norm=True,
                summary="w = sigmoid(s q.k + b_i), b_i = bias or -ln(n_i), no normalization"),
    )
}


def variant_names() -> list[str]:
    return list(VARIANTS)


def get_variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"attn.name must be one of {variant_names()}, got {name!r}") from None


def family_kernel(spec: AttentionSpec) -> Callable:
    """The fused implementation serving `spec`'s family (imports Triton lazily)."""
    return family_of(spec).kernel()
