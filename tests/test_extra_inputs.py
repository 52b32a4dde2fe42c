"""A family's extra per-call tensors travel as one mapping, `extra`, whose keys are exactly
`Family.extra_inputs(spec)`: every entry point refuses an unexpected key, a missing key and a
non-mapping with a ValueError naming `extra` and the allowed keys, and the mapping reaches the
fused kernels (the Triton interpreter on CPU) and the reference alike."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import attn
from attn.families import family_of
from attn.kernels import threshold_family as tf
from attn.masks import MaskSpec
from attn.reference import attention_weights, reference_attention
from attn.testing import outputs_and_grads
from tolerance import assert_within_reference_error

B, N, H, H_KV, D = 2, 19, 2, 1, 16
DIFF = attn.get_variant("diff_threshold").make_spec(beta=0.3)
WITHOUT_EXTRAS = ["softmax", "alsc", "threshold", "sigmoid"]
CAUSAL = MaskSpec(causal=True)
# the kernels run natively where CUDA is (the interpreter otherwise): inputs live there
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def qkv(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def unit(heads):
        return F.normalize(torch.randn(B, N, heads, D, generator=gen, dtype=torch.float64), dim=-1).to(DEVICE, dtype)

    return unit(H), unit(H_KV), torch.randn(B, N, H_KV, D, generator=gen, dtype=torch.float64).to(DEVICE, dtype)


def second_view(q, k, seed=1):
    """The differential threshold's extra mapping for q, k: the second view and the per-head lambda."""
    gen = torch.Generator().manual_seed(seed)

    def unit(like):
        return F.normalize(torch.randn(like.shape, generator=gen, dtype=torch.float64), dim=-1).to(like.device, like.dtype)

    return {"q2": unit(q), "k2": unit(k), "lam": torch.tensor([0.3, 0.7], dtype=q.dtype, device=q.device)}


def entry_points(spec) -> dict:
    """name -> call(q, k, v, extra) of every entry point that takes the `extra` mapping."""
    family = family_of(spec)
    kernel = family.kernel()
    calls = {backend: attn.AttentionCall(spec, causal=True, backend=backend) for backend in ("reference", "triton")}
    return {
        "attention-reference": lambda q, k, v, extra: attn.attention(q, k, v, spec, backend="reference", extra=extra),
        "attention-triton": lambda q, k, v, extra: attn.attention(q, k, v, spec, backend="triton", extra=extra),
        "AttentionCall-reference": lambda q, k, v, extra: calls["reference"](q, k, v, extra=extra),
        "AttentionCall-triton": lambda q, k, v, extra: calls["triton"](q, k, v, extra=extra),
        "reference_attention": lambda q, k, v, extra: reference_attention(q, k, v, spec, CAUSAL, extra=extra),
        "attention_weights": lambda q, k, v, extra: attention_weights(q, k, spec, CAUSAL, extra=extra),
        "fused_attention": lambda q, k, v, extra: kernel(q, k, v, spec, CAUSAL, extra=extra),
        "Family.validate": lambda q, k, v, extra: family.validate(spec, q, k, temperature=None, extra=extra),
        "Family.reference_weights": lambda q, k, v, extra: family.reference_weights(q, k, spec, CAUSAL, extra=extra),
    }


ENTRY_POINTS = list(entry_points(DIFF))
DIFF_KEYS = r"'q2', 'k2', 'lam'"


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_unexpected_key_is_named_with_the_allowed_keys(entry):
    q, k, v = qkv()
    extra = {**second_view(q, k), "q3": q}
    with pytest.raises(ValueError, match=rf"extra has an unexpected key 'q3': the allowed keys for "
                                         rf"ThresholdFamilySpec\(.*differential=True\) are {DIFF_KEYS}$"):
        entry_points(DIFF)[entry](q, k, v, extra)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("missing", ["q2", "k2", "lam"])
def test_a_missing_key_is_named_with_the_allowed_keys(entry, missing):
    q, k, v = qkv()
    extra = second_view(q, k)
    del extra[missing]
    with pytest.raises(ValueError, match=rf"extra is missing the key '{missing}': ThresholdFamilySpec\(.*"
                                         rf"differential=True\) needs the keys {DIFF_KEYS}$"):
        entry_points(DIFF)[entry](q, k, v, extra)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("name", WITHOUT_EXTRAS)
def test_extras_for_a_family_that_takes_none_are_named(entry, name):
    spec = attn.get_variant(name).make_spec()
    q, k, v = qkv()
    for key in ("q2", "lam"):
        with pytest.raises(ValueError, match=rf"extra has an unexpected key '{key}': the allowed keys for "
                                             rf"{type(spec).__name__}\(.*\) are none \(this spec takes no extra "
                                             r"tensors\)$"):
            entry_points(spec)[entry](q, k, v, {key: second_view(q, k)[key]})


def test_extras_are_refused_on_the_sdpa_backend_too():
    spec = attn.get_variant("softmax").make_spec()
    q, k, v = qkv()
    call = attn.AttentionCall(spec, backend="sdpa")
    assert torch.equal(call(q, k, v, extra={}), attn.attention(q, k, v, spec, backend="sdpa"))
    with pytest.raises(ValueError, match=r"extra has an unexpected key 'lam': .* are none"):
        call(q, k, v, extra={"lam": torch.ones(H, device=DEVICE)})
    with pytest.raises(ValueError, match=r"extra has an unexpected key 'lam': .* are none"):
        attn.attention(q, k, v, spec, backend="sdpa", extra={"lam": torch.ones(H, device=DEVICE)})


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_extra_must_be_a_mapping(entry):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=rf"extra must be a mapping of name to tensor with the keys {DIFF_KEYS} "
                                         r"for ThresholdFamilySpec\(.*\), got list$"):
        entry_points(DIFF)[entry](q, k, v, list(second_view(q, k).values()))


def test_zero_fraction_takes_the_mapping():
    q, k, _ = qkv()
    extra = second_view(q, k)
    got = tf.zero_fraction(q, k, DIFF, CAUSAL, extra=extra)
    plain = tf.zero_fraction(q, k, attn.get_variant("threshold").make_spec(beta=0.3), CAUSAL)
    assert got.shape == (H,) and not torch.equal(got, plain)  # the second view changes which weights vanish
    with pytest.raises(ValueError, match=r"extra is missing the key 'lam'"):
        tf.zero_fraction(q, k, DIFF, CAUSAL, extra={"q2": extra["q2"], "k2": extra["k2"]})
    with pytest.raises(ValueError, match=r"extra has an unexpected key 'q2'"):
        tf.zero_fraction(q, k, attn.get_variant("threshold").make_spec(), CAUSAL, extra={"q2": q})


@pytest.mark.parametrize("name", WITHOUT_EXTRAS)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_no_extras_is_none_or_an_empty_mapping(name, backend):
    spec = attn.get_variant(name).make_spec()
    q, k, v = qkv()
    default = attn.attention(q, k, v, spec, backend=backend)
    assert default.abs().sum() > 0
    for extra in (None, {}, types.MappingProxyType({})):
        assert torch.equal(attn.attention(q, k, v, spec, backend=backend, extra=extra), default)


def test_the_mapping_reaches_the_kernels_and_the_reference_with_equal_results(nan_poison):
    """Out and the gradients of q, k, v and every extra tensor: the kernels (fp32, interpreter) within
    the DESIGN.md rule of the float64 reference, each entry point's kernel path bitwise the same, the
    order of the keys irrelevant (the kernels unpack by name), and the values used (lambda matters)."""
    q, k, v = qkv(torch.float64, seed=3)
    x = {"q": q, "k": k, "v": v, **second_view(q, k, seed=4)}
    dout = torch.randn(B, N, H, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(DEVICE)

    def leaves(dtype):
        return {name: t.detach().to(dtype).requires_grad_() for name, t in x.items()}

    def through(entry):
        fn = entry_points(DIFF)[entry]
        return lambda q, k, v, **extra: fn(q, k, v, extra)

    ref64 = outputs_and_grads(through("attention-reference"), leaves(torch.float64), dout)
    same = outputs_and_grads(through("attention-reference"), leaves(torch.float32), dout)
    fused = outputs_and_grads(through("attention-triton"), leaves(torch.float32), dout)
    assert set(fused) == {"out", "dq", "dk", "dv", "dq2", "dk2", "dlam"}
    for name in ref64:
        assert ref64[name].abs().sum() > 0, name
        assert_within_reference_error(name, fused[name], same[name], ref64[name], floor=1e-5)
    for entry in ("AttentionCall-triton", "fused_attention"):
        got = outputs_and_grads(through(entry), leaves(torch.float32), dout)
        assert all(torch.equal(got[name], fused[name]) for name in fused), entry
    for entry in ("AttentionCall-reference", "reference_attention"):
        got = outputs_and_grads(through(entry), leaves(torch.float32), dout)
        assert all(torch.equal(got[name], same[name]) for name in same), entry

    t = leaves(torch.float32)
    reordered = types.MappingProxyType({"lam": t["lam"], "k2": t["k2"], "q2": t["q2"]})
    for backend in ("triton", "reference"):
        want = (fused if backend == "triton" else same)["out"]
        out = attn.attention(t["q"], t["k"], t["v"], DIFF, backend=backend, extra=reordered)
        assert torch.equal(out, want), backend
        other_lambda = {**reordered, "lam": t["lam"] + 0.5}
        changed = attn.attention(t["q"], t["k"], t["v"], DIFF, backend=backend, extra=other_lambda)
        assert (changed - want).abs().max() > 1e-3, backend
