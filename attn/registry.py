"""Variant registry: name -> the family's spec type, the spec fields the variant fixes, its config
keys and its model-side defaults. Parameter defaults are declared once, in the spec dataclasses.

Adding a variant touches this table, its family's unit (attn/families/<family>.py: reference,
validation, statistics, the layer module that forms its extra per-call tensors, lazy kernel), its
family's kernel module, one `configs/attn/<name>.yaml` and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from attn.families import family_of
from attn.specs import AttentionSpec, SigmoidFamilySpec, SoftmaxFamilySpec, ThresholdFamilySpec


@dataclass(frozen=True)
class Variant:
    """A named variant: its family's spec type, the spec fields the variant fixes, the config keys
    it takes (spec fields, some under a config name), and its model-side defaults. Parameter
    defaults live in the spec dataclass only (attn/specs.py); `default(key)` reads them."""

    name: str
    spec_type: type
    params: tuple[str, ...]  # config keys accepted by `make_spec`
    fixed: Mapping[str, Any] = field(default_factory=dict)  # spec fields the variant sets (cap method, ...)
    renamed: Mapping[str, str] = field(default_factory=dict)  # config key -> spec field, where they differ
    qk_norm: str = "none"  # model default for q and k: none | l2 (unit vectors) | rms (a learned RMSNorm)
    out_norm: bool = False  # model default: per-head RMSNorm of the attention output
    views: int = 1  # 2 for differential variants (second q/k projection, learnable lambda)
    summary: str = ""

    @property
    def family(self) -> str:
        """The name of the family serving the variant (attn/families/)."""
        return family_of(self.make_spec()).name

    def spec_field(self, key: str) -> str:
        return self.renamed.get(key, key)

    def default(self, key: str) -> Any:
        """The spec's default of config key `key` (what `make_spec` uses when the key is not given)."""
        if key not in self.params:
            raise ValueError(f"attn={self.name} does not take {key!r}; allowed parameters: {list(self.params)}")
        return next(f.default for f in fields(self.spec_type) if f.name == self.spec_field(key))

    def make_spec(self, **params) -> AttentionSpec:
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            raise ValueError(
                f"attn={self.name} does not take {unknown}; allowed parameters: {list(self.params)}"
            )
        return self.spec_type(**self.fixed, **{self.spec_field(k): v for k, v in params.items()})


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("softmax", SoftmaxFamilySpec, ("sm_scale",), fixed={"cap": "none"}, summary="z = t * s q.k"),
        Variant("softcap_tanh", SoftmaxFamilySpec, ("cap", "sm_scale"), fixed={"cap": "tanh"},
                renamed={"cap": "cap_value"}, summary="z = t * c tanh(s q.k / c)"),
        Variant("softcap_softsign", SoftmaxFamilySpec, ("cap", "sm_scale"), fixed={"cap": "soft_sign"},
                renamed={"cap": "cap_value"}, summary="z = t * y / (1 + |y|/c), y = s q.k"),
        Variant("alsc", SoftmaxFamilySpec, ("cap", "knee", "sm_scale"), fixed={"cap": "alsc"},
                renamed={"cap": "cap_value"}, summary="identity on [-kc, kc], tanh-shaped to the cap c beyond"),
        Variant("threshold", ThresholdFamilySpec, ("beta", "power"), fixed={"differential": False},
                qk_norm="l2", out_norm=True, summary="w = relu(q.k - tau_i)^p, no softmax"),
        Variant("diff_threshold", ThresholdFamilySpec, ("beta", "power"), fixed={"differential": True},
                qk_norm="l2", out_norm=True, views=2, summary="w = relu(x1 - tau)^p - lambda_h relu(x2 - tau)^p"),
        # the paper's stabilizers: a learned QK-norm (rms: l2 would bound s q.k by s) and a normalized
        # output (its hybrid-norm; here the per-head output RMSNorm)
        Variant("sigmoid", SigmoidFamilySpec, ("bias", "sm_scale"), qk_norm="rms", out_norm=True,
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


def _layer_options(variant: Variant) -> Mapping[str, tuple]:
    spec = variant.make_spec()
    return family_of(spec).layer_options(spec)


def layer_option_values() -> dict[str, tuple]:
    """Every model option that some variant's layer module reads (`Family.layer_options`), with its
    allowed values."""
    values: dict[str, tuple] = {}
    for variant in VARIANTS.values():
        for option, allowed in _layer_options(variant).items():
            values[option] = tuple(dict.fromkeys(values.get(option, ()) + tuple(allowed)))
    return values


def check_layer_options(name: str, options: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """The model options of attn=`name` (`options`: AttnConfig's fields by name, `defaults` theirs):
    each option a layer module reads holds one of its allowed values; an option that this variant's
    layer does not read stays at its default (otherwise the run would train without it, silently).
    A ValueError names the option, its value and what is allowed."""
    read = _layer_options(get_variant(name))
    for option, allowed in layer_option_values().items():
        if option not in options:
            if option in read:
                raise ValueError(f"attn={name} reads the model option attn.{option}, which the model config lacks")
            continue
        value = options[option]
        if value not in allowed:
            raise ValueError(f"attn.{option} must be one of {allowed}, got {value!r}")
        if option not in read and value != defaults.get(option):
            readers = [v.name for v in VARIANTS.values() if option in _layer_options(v)]
            raise ValueError(f"attn.{option}={value} applies to the variants {readers} only: attn={name} does not "
                             f"read it (leave attn.{option} out)")


def family_kernel(spec: AttentionSpec) -> Callable:
    """The fused implementation serving `spec`'s family (imports Triton lazily)."""
    return family_of(spec).kernel()
