"""Attention families, one module each: `family_of(spec)` is the unit that serves a spec.

Every family implements `Family` (attn/families/base.py): spec type, spec-level validation,
reference weights, the scores and logits statistics read, `has_max_logit`, its extra per-call
tensors and its lazily imported fused kernel. Code outside `attn/families/` asks the family
instead of branching on it.
"""

from __future__ import annotations

from attn.families import sigmoid, softmax, threshold
from attn.families.base import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (softmax.FAMILY, threshold.FAMILY, sigmoid.FAMILY)}
_BY_SPEC_TYPE: dict[type, Family] = {f.spec_type: f for f in FAMILIES.values()}


def family_of(spec) -> Family:
    """The family serving `spec` (a frozen spec of attn/specs.py); a ValueError for anything else."""
    family = _BY_SPEC_TYPE.get(type(spec))
    if family is None:
        types = [f.spec_type.__name__ for f in FAMILIES.values()]
        names = ", ".join(types[:-1]) + " or " + types[-1]
        raise ValueError(f"spec must be a {names}, got {type(spec).__name__}")
    return family


__all__ = ["FAMILIES", "Family", "family_of"]
