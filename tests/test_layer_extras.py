"""A family's layer module (attn/families/layer_extras.py) owns its per-layer parameters and forms
its extra per-call tensors: a family registered here, with a learned per-head gate and a second q/k
view, trains inside the GPT without a change to models/; state dicts whose attention layers held
the differential lambda themselves (tests/fixtures/diff_threshold_before_family_extras.pt, written
by that code) load into `attn.extras` with their logits, parameter order included."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import attn
from attn import families, registry
from attn.families.base import Family, per_query_head_scores
from attn.families.softmax import softmax_family_weights
from attn.specs import SoftmaxFamilySpec
from models.gpt import GPT, AttnConfig, GPTConfig
from runs.model import build_model_from_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "diff_threshold_before_family_extras.pt"


@dataclass(frozen=True)
class GatedPairSpec:
    """w = gate_h * (softmax(s q1.k1) + softmax(s q2.k2)) / 2, gate_h = sigmoid of a learned per-head value."""


class GatedPairExtras(attn.LayerExtras):
    def __init__(self, shape: attn.LayerShape):
        super().__init__()
        self.gate_logits = nn.Parameter(torch.zeros(shape.n_head))

    def forward(self, qs, ks):
        return {"q2": qs[1], "k2": ks[1], "gate": torch.sigmoid(self.gate_logits).to(qs[0].dtype)}

    def per_head_values(self):
        return {"gate": torch.sigmoid(self.gate_logits.float())}


class GatedPairFamily(Family):
    name = "gated_pair"
    spec_type = GatedPairSpec
    kernel_path = "attn.kernels.softmax_family:fused_attention"  # never called: backend=reference
    has_max_logit = True

    def extra_inputs(self, spec):
        return ("q2", "k2", "gate")

    def key_aligned_inputs(self, spec):
        return ("k2",)

    def layer_extras(self, spec, shape, options):
        return GatedPairExtras(shape)

    def validate(self, spec, q, k, *, temperature, extra):
        self.checked_extra(spec, extra)

    def reference_weights(self, q, k, spec, mask, segment_ids=None, key_lengths=None, *, temperature=None,
                          extra=None):
        extra = self.checked_extra(spec, extra)
        softmax = SoftmaxFamilySpec()
        w1 = softmax_family_weights(q, k, softmax, mask, segment_ids, key_lengths=key_lengths)
        w2 = softmax_family_weights(extra["q2"], extra["k2"], softmax, mask, segment_ids, key_lengths=key_lengths)
        return extra["gate"].to(w1.dtype)[None, :, None, None] * (w1 + w2) / 2

    def scores(self, spec, qk, head_dim):
        return qk * head_dim**-0.5

    def logits(self, spec, qk, head_dim, n_visible=None):
        return qk * head_dim**-0.5


@pytest.fixture
def gated_pair(monkeypatch):
    """The family and its variant `gated_pair` registered for one test."""
    family = GatedPairFamily()
    monkeypatch.setitem(families.FAMILIES, family.name, family)
    monkeypatch.setitem(families._BY_SPEC_TYPE, GatedPairSpec, family)
    monkeypatch.setitem(registry.VARIANTS, "gated_pair", registry.Variant("gated_pair", GatedPairSpec, (), views=2))
    return family


def tiny(name, **attn_kw):
    return GPTConfig(vocab_size=23, context=12, n_layer=2, n_head=2, n_kv_head=1, d_model=16,
                     attn=AttnConfig(name=name, backend="reference", **attn_kw))


def test_a_family_with_extra_tensors_runs_in_the_model_unchanged(gated_pair):
    torch.manual_seed(0)
    model = GPT(tiny("gated_pair"))
    layer = model.blocks[0].attn
    assert isinstance(layer.extras, GatedPairExtras) and layer.views == 2
    assert "blocks.1.attn.extras.gate_logits" in model.state_dict()
    x = torch.randn(2, 12, 16)
    # the layer's attention is the family's: gate 1/2, both views averaged (reference weights by hand)
    qs, ks, v = layer.split_heads(x)
    w1, w2 = (torch.softmax((per_query_head_scores(q, k.repeat_interleave(2, dim=2)) * 8**-0.5)
                            .masked_fill(~torch.ones(12, 12).tril().bool(), float("-inf")), dim=-1)
              for q, k in zip(qs, ks))
    y = torch.einsum("bhij,bjhd->bihd", 0.5 * (w1 + w2) / 2, v.repeat_interleave(2, dim=2))
    want = layer.proj(y.reshape(2, 12, -1))
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        layer.extras.gate_logits.fill_(-float("inf"))  # gate 0: no attention output
    assert torch.equal(layer(x), torch.zeros_like(x))
    # the gate learns, and the second view's projection rows get a gradient
    torch.manual_seed(0)
    model = GPT(tiny("gated_pair"))
    ids = torch.randint(0, 23, (2, 12))
    model(ids[:, :-1], targets=ids[:, 1:]).backward()
    layer = model.blocks[1].attn
    assert layer.extras.gate_logits.grad.abs().min() > 0
    second_view = layer.qkv.weight.grad[2 * 16 + 8: 2 * (16 + 8)]  # [q1 | k1 | q2 | k2 | v] rows
    assert second_view.abs().sum() > 0
    # per-head values reach the validation monitor by name (val/gate/layer{i}/head{h})
    assert layer.extras.per_head_values()["gate"].tolist() == [0.5, 0.5]
    # a state dict with the layer holding the gate itself loads into extras
    state = {name.replace("attn.extras.", "attn."): t for name, t in model.state_dict().items()}
    assert "blocks.1.attn.gate_logits" in state
    fresh = GPT(tiny("gated_pair"))
    fresh.load_state_dict(state)  # strict
    assert torch.equal(fresh.blocks[1].attn.extras.gate_logits, model.blocks[1].attn.extras.gate_logits)


def test_families_without_extra_tensors_get_the_empty_layer_module():
    model = GPT(tiny("softmax"))
    extras = model.blocks[0].attn.extras
    assert type(extras) is attn.LayerExtras and list(extras.parameters()) == []
    qs = [torch.randn(1, 3, 2, 8)]
    assert extras(qs, qs) == {} and extras.per_head_values() == {} and extras.output_scale == 1.0
    assert not any(".extras." in name for name in model.state_dict())


def fixture_config(mode: str) -> GPTConfig:
    """The configuration tests/fixtures/diff_threshold_before_family_extras.pt was written with."""
    return GPTConfig(vocab_size=7, context=6, n_layer=2, n_head=2, n_kv_head=1, d_model=8, mlp_ratio=1.0,
                     attn=AttnConfig(name="diff_threshold", backend="reference", lambda_mode=mode))


@pytest.mark.parametrize("mode", ["reparam", "clamp", "scalar_clamp"])
def test_state_dicts_with_the_lambda_in_the_layer_load_into_the_family_module(mode):
    saved = torch.load(FIXTURE, weights_only=True)[mode]
    old_state = saved["state_dict"]
    own = {"reparam": "lambda_vectors", "clamp": "lambda_raw", "scalar_clamp": "lambda_scalar"}[mode]
    assert f"blocks.1.attn.{own}" in old_state and not any(".extras." in name for name in old_state)
    model = GPT(fixture_config(mode))
    model.load_state_dict(old_state)  # strict: every key placed, none left over
    assert torch.equal(model.blocks[1].attn.extras.get_parameter(own), old_state[f"blocks.1.attn.{own}"])
    # the fixture's logits to fp32 rounding: the model's fused norms may round their last bits
    # differently from the kernels that computed the fixture; a misplaced or missing lambda moves the
    # logits by orders of magnitude more
    with torch.no_grad():
        torch.testing.assert_close(model(saved["tokens"]), saved["logits"], rtol=1e-5, atol=1e-5)
    # the parameters keep their order (optimizer states list them by position)
    moved = [name.replace(f"attn.{own}", f"attn.extras.{own}") for name in saved["parameter_names"]]
    assert [name for name, _ in model.named_parameters()] == moved
    # the checkpoint loaders (eval, export, resume) go through load_state_dict: an eval load of a training checkpoint
    ckpt = {"hyper_parameters": {"model": {"vocab_size": 7, "context": 6, "n_layer": 2, "n_head": 2, "n_kv_head": 1,
                                           "d_model": 8, "mlp_ratio": 1.0,
                                           "attn": {"name": "diff_threshold", "backend": "reference",
                                                    "lambda_mode": mode}}},
            "state_dict": {f"model.{name}": t for name, t in old_state.items()}}
    loaded, _ = build_model_from_checkpoint(ckpt, Path("old.ckpt"))
    with torch.no_grad():
        assert torch.equal(loaded(saved["tokens"]), model(saved["tokens"]))


def test_lambda_mode_is_checked_through_the_families_layer_options(gated_pair):
    assert attn.layer_option_values() == {"lambda_mode": ("reparam", "clamp", "scalar_clamp")}
    with pytest.raises(ValueError, match=r"attn.lambda_mode must be one of \('reparam', 'clamp', 'scalar_clamp'\), "
                                         r"got 'nope'"):
        GPT(tiny("diff_threshold", lambda_mode="nope"))
    with pytest.raises(ValueError, match=r"attn.lambda_mode=clamp applies to the variants \['diff_threshold'\] only: "
                                         r"attn=gated_pair does not read it \(leave attn.lambda_mode out\)"):
        GPT(tiny("gated_pair", lambda_mode="clamp"))
