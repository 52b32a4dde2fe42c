"""Each variant's spec is served by the family module the registry names (attn/families/)."""

from __future__ import annotations

import pytest
import torch

import attn
from attn.caps import apply_cap
from attn.families import FAMILIES, family_of


@pytest.mark.parametrize("name", attn.variant_names())
def test_every_variant_spec_has_its_registry_family(name):
    variant = attn.get_variant(name)
    family = family_of(variant.make_spec())
    assert family is FAMILIES[variant.family]
    assert family.name == variant.family
    assert family.has_max_logit == (variant.family in ("softmax", "sigmoid"))  # a logit s q.k (+ b) exists
    # a second score view is the differential threshold's extra tensors; the temperature is an argument of its own
    want = ("q2", "k2", "lam") if variant.views == 2 else ()
    assert family.extra_inputs(variant.make_spec()) == want
    assert family.key_aligned_inputs(variant.make_spec()) == (("k2",) if variant.views == 2 else ())


def test_family_of_refuses_what_no_family_serves():
    with pytest.raises(ValueError, match="spec must be a SoftmaxFamilySpec, ThresholdFamilySpec or SigmoidFamilySpec, got dict"):
        family_of({})


def test_statistics_logits_and_scores_per_family():
    qk = torch.linspace(-40, 40, 33, dtype=torch.float64)
    d = 16
    spec = attn.get_variant("alsc").make_spec(cap=5.0)
    fam = family_of(spec)
    assert torch.equal(fam.scores(spec, qk, d), qk * d**-0.5)
    assert torch.equal(fam.logits(spec, qk, d), apply_cap(qk * d**-0.5, "alsc", 5.0, 0.5))
    assert fam.logits(spec, qk, d).abs().max() < 5.0  # the cap binds
    assert fam.serves_sdpa(spec) is False and fam.serves_sdpa(attn.get_variant("softmax").make_spec()) is True
    tspec = attn.get_variant("threshold").make_spec()
    assert torch.equal(family_of(tspec).scores(tspec, qk, d), qk)
    assert torch.equal(family_of(tspec).logits(tspec, qk, d), qk)
    sspec = attn.get_variant("sigmoid").make_spec(bias=-2.0, sm_scale=0.5)
    assert torch.equal(family_of(sspec).scores(sspec, qk, d), qk * 0.5)
    assert torch.equal(family_of(sspec).logits(sspec, qk, d), qk * 0.5 - 2.0)
    # n_visible (the keys a query sees) changes nothing where the logits do not depend on it
    four = torch.tensor(4.0, dtype=torch.float64)
    for s in (spec, tspec, sspec):
        assert torch.equal(family_of(s).logits(s, qk, d, n_visible=four), family_of(s).logits(s, qk, d))
    sspec = attn.get_variant("sigmoid").make_spec()  # bias null: b_i = -ln(n_i), from the keys query i sees
    assert torch.equal(family_of(sspec).logits(sspec, qk, d, n_visible=four), qk * d**-0.5 - torch.log(four))
    with pytest.raises(ValueError, match=r"n_visible .* is required for the logits of attn=sigmoid with bias null"):
        family_of(sspec).logits(sspec, qk, d)


@pytest.mark.parametrize("name", attn.variant_names())
def test_reference_weights_match_the_public_attention_weights(name):
    gen = torch.Generator().manual_seed(0)
    q, k, q2, k2 = (torch.randn(1, 7, 2, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    spec = attn.get_variant(name).make_spec()
    lam = torch.tensor([0.3, 0.7], dtype=torch.float64)
    extra = {"q2": q2, "k2": k2, "lam": lam} if attn.get_variant(name).views == 2 else {}
    want = attn.attention_weights(q, k, spec, attn.MaskSpec(), extra=extra)
    got = family_of(spec).reference_weights(q, k, spec, attn.MaskSpec(), extra=extra)
    assert torch.equal(got, want) and want.abs().sum() > 0


def test_kernel_entry_is_the_family_kernel_modules():
    for family in FAMILIES.values():
        module = family.kernel_path.split(":")[0]
        assert module == f"attn.kernels.{family.name}_family"
