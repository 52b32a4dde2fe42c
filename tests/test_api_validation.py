"""Public API `attn.attention(...)` and the registry refuse bad inputs with a ValueError
that names the argument (DESIGN.md §5), and accept good ones with the reference's values."""

from __future__ import annotations

import logging

import pytest
import torch

import attn
import attn.ops
from attn.caps import apply_cap
from attn.families import family_of
from attn.masks import MaskSpec
from attn.reference import reference_attention
from attn.registry import get_variant, variant_names
from attn.specs import SoftmaxFamilySpec, ThresholdFamilySpec

B, N, H, H_KV, D = 2, 6, 4, 2, 8
ALL_VARIANTS = ["softmax", "softcap_tanh", "softcap_softsign", "alsc", "threshold", "diff_threshold", "sigmoid"]


def inputs(dtype=torch.float32, d=D, h_kv=H_KV, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, H, d, generator=gen).to(dtype)
    k = torch.randn(B, N, h_kv, d, generator=gen).to(dtype)
    v = torch.randn(B, N, h_kv, d, generator=gen).to(dtype)
    return q, k, v


def diff_extras(q, k):
    return dict(q2=torch.randn_like(q), k2=torch.randn_like(k), lam=torch.full((q.shape[2],), 0.5, dtype=q.dtype))


SOFTMAX = get_variant("softmax").make_spec()
THRESHOLD = get_variant("threshold").make_spec()
DIFF = get_variant("diff_threshold").make_spec()
SIGMOID = get_variant("sigmoid").make_spec()


def call(q, k, v, spec=SOFTMAX, **kw):
    kw.setdefault("backend", "reference")
    return attn.attention(q, k, v, spec, **kw)


# ----------------------------------------------------------------------------------------
# Good inputs: the API returns the reference's values
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_VARIANTS)
def test_reference_backend_returns_reference_values(name):
    q, k, v = inputs(torch.float64, seed=3)
    spec = get_variant(name).make_spec()
    seg = torch.tensor([[1, 1, 1, -1, -1, 0], [0, 1, 1, 1, -1, -1]])
    kw = dict(segment_ids=seg, window=4)
    extra = diff_extras(q, k) if name == "diff_threshold" else {}
    temperature = torch.rand(B, N, dtype=torch.float64) + 0.5 if family_of(spec).name == "softmax" else None
    out = call(q, k, v, spec, temperature=temperature, extra=extra, **kw)
    want = reference_attention(q, k, v, spec, MaskSpec(causal=True, window=4), seg, temperature, extra=extra)
    assert out.shape == (B, N, H, D) and out.dtype == torch.float64
    assert torch.equal(out, want)
    assert torch.all(out[seg == 0] == 0)
    # the mask arguments are passed through: without them the answer changes
    assert not torch.allclose(out, call(q, k, v, spec, temperature=temperature, extra=extra))


def test_auto_backend_on_cpu_is_reference_and_says_so_once(caplog, monkeypatch):
    monkeypatch.setattr(attn.ops, "_announced", set())
    q, k, v = inputs()
    with caplog.at_level(logging.INFO, logger="attn.ops"):
        a = call(q, k, v, backend="auto")
        b = call(q, k, v, backend="auto")
    assert torch.equal(a, call(q, k, v, backend="reference")) and torch.equal(a, b)
    lines = [r.getMessage() for r in caplog.records if r.name == "attn.ops"]
    assert lines == ["attention backend=auto on cpu -> reference"]


def test_resolve_backend_values(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert attn.resolve_backend("reference", torch.device("cpu")) == "reference"
    assert attn.resolve_backend("auto", torch.device("cpu")) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attn.resolve_backend("triton", torch.device("cpu")) == "triton"
    assert attn.resolve_backend("auto", torch.device("cpu")) == "reference"  # auto picks triton only on CUDA


# ----------------------------------------------------------------------------------------
# attn.attention: every ValueError names its argument
# ----------------------------------------------------------------------------------------

def test_q_not_a_4d_tensor():
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"q must be a \(B, N, H, D\) tensor"):
        call(q[0], k, v)
    with pytest.raises(ValueError, match=r"q must be a \(B, N, H, D\) tensor"):
        call(q.tolist(), k, v)


def test_q_integer_dtype():
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"q\.dtype must be one of"):
        call(q.to(torch.int32), k.to(torch.int32), v.to(torch.int32))


@pytest.mark.parametrize("name", ["k", "v"])
def test_k_v_wrong_dtype(name):
    q, k, v = inputs()
    args = dict(k=k, v=v)
    args[name] = args[name].double()
    with pytest.raises(ValueError, match=rf"{name} must have the dtype of q \(torch\.float32\), got torch\.float64"):
        call(q, args["k"], args["v"])


@pytest.mark.parametrize("name", ["k", "v"])
def test_k_v_not_tensor_wrong_ndim_wrong_device(name):
    q, k, v = inputs()
    for bad, message in [
        (None, rf"{name} must be a torch\.Tensor, got NoneType"),
        (k[0], rf"{name} must have 4 dims, got shape \({N}, {H_KV}, {D}\)"),
        (k.to("meta"), rf"{name} must be on the device of q \(cpu\), got meta"),
    ]:
        args = dict(k=k, v=v)
        args[name] = bad
        with pytest.raises(ValueError, match=message):
            call(q, args["k"], args["v"])


def test_k_v_shape_mismatch():
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        call(q, k, v[:, :, :1])
    for bad in (k[:1], k[:, :5], k[..., :4]):  # B of k differs from q's, fewer keys than queries, D differs
        with pytest.raises(ValueError, match=r"k must have shape \(B, KV, H_kv, D\)"):
            call(q, bad, bad.clone())


def test_heads_not_divisible_by_kv_heads():
    q, k, v = inputs(h_kv=3)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be divisible by k's heads H_kv \(3\)"):
        call(q, k, v)


def test_zero_kv_heads_is_a_value_error():
    q, k, v = inputs(h_kv=0)
    with pytest.raises(ValueError, match=r"H_kv"):
        call(q, k, v)


@pytest.mark.parametrize("window", [0, -3, 2.5, "4"])
def test_bad_window(window):
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"window must be a positive int or None"):
        call(q, k, v, window=window)


def test_segment_ids_errors():
    q, k, v = inputs()
    good = torch.tensor([[1, 1, -1, -1, 0, 0], [1, 1, 1, -1, -1, -1]])
    call(q, k, v, segment_ids=good)  # accepted
    with pytest.raises(ValueError, match=r"segment_ids must have shape \(B, N\) = \(2, 6\), got \(2, 5\)"):
        call(q, k, v, segment_ids=good[:, :5])
    with pytest.raises(ValueError, match=r"segment_ids must be an integer tensor"):
        call(q, k, v, segment_ids=good.float())
    with pytest.raises(ValueError, match=r"segment_ids must be an integer tensor"):
        call(q, k, v, segment_ids=good > 0)
    for value in (2, -2, 5):
        bad = good.clone()
        bad[1, 2] = value
        with pytest.raises(ValueError, match=r"segment_ids values must be in \{1 \(history\), -1 \(candidate\), 0 \(padding\)\}"):
            call(q, k, v, segment_ids=bad)
    with pytest.raises(ValueError, match=r"segment_ids: the history \(1\) positions must form one contiguous range"):
        call(q, k, v, segment_ids=torch.tensor([[1, 1, -1, -1, 0, 0], [1, 0, 1, -1, -1, -1]]))
    with pytest.raises(ValueError, match=r"segment_ids: the history \(1\) positions must form one contiguous range"):
        call(q, k, v, segment_ids=torch.tensor([[1, -1, 1, -1, 0, 0], [1, 1, 1, -1, -1, -1]]))
    with pytest.raises(ValueError, match=r"segment_ids: the candidate \(-1\) positions must form one contiguous range"):
        call(q, k, v, segment_ids=torch.tensor([[1, 1, -1, 0, -1, 0], [1, 1, 1, -1, -1, -1]]))


def test_temperature_errors():
    q, k, v = inputs()
    call(q, k, v, temperature=torch.ones(B, N))  # accepted
    with pytest.raises(ValueError, match=r"temperature must have shape \(B, N\) = \(2, 6\), got \(2, 5\)"):
        call(q, k, v, temperature=torch.ones(B, N - 1))
    with pytest.raises(ValueError, match=r"temperature must have shape \(B, N\) = \(2, 6\), got \(6, 2\)"):
        call(q, k, v, temperature=torch.ones(N, B))
    with pytest.raises(ValueError, match=r"temperature must have 2 dims"):
        call(q, k, v, temperature=torch.ones(B, N, 1))
    with pytest.raises(ValueError, match=r"temperature must be on the device of q"):
        call(q, k, v, temperature=torch.ones(B, N, device="meta"))


def test_temperature_not_a_tensor():
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"temperature must be a torch\.Tensor, got float"):
        call(q, k, v, temperature=2.0)


@pytest.mark.parametrize("spec", [THRESHOLD, DIFF, SIGMOID], ids=["threshold", "diff_threshold", "sigmoid"])
def test_temperature_refused_outside_the_softmax_family(spec):
    q, k, v = inputs()
    extra = diff_extras(q, k) if getattr(spec, "differential", False) else {}
    with pytest.raises(ValueError, match=r"temperature is only defined for the softmax family"):
        call(q, k, v, spec, temperature=torch.ones(B, N), extra=extra)


@pytest.mark.parametrize("spec", [SOFTMAX, THRESHOLD, SIGMOID], ids=["softmax", "threshold", "sigmoid"])
@pytest.mark.parametrize("given", ["q2", "k2", "lam"])
def test_second_view_refused_for_non_differential_variants(spec, given):
    q, k, v = inputs()
    extra = {given: diff_extras(q, k)[given]}
    with pytest.raises(ValueError, match=rf"extra has an unexpected key '{given}': the allowed keys for "
                                         rf"{type(spec).__name__}\(.*\) are none \(this spec takes no extra tensors\)"):
        call(q, k, v, spec, extra=extra)


@pytest.mark.parametrize("missing", ["q2", "k2", "lam"])
def test_diff_threshold_needs_q2_k2_lam(missing):
    q, k, v = inputs()
    extra = diff_extras(q, k)
    call(q, k, v, DIFF, extra=extra)  # accepted when complete
    del extra[missing]
    with pytest.raises(ValueError, match=rf"extra is missing the key '{missing}': ThresholdFamilySpec\(.*"
                                         r"differential=True\) needs the keys 'q2', 'k2', 'lam'"):
        call(q, k, v, DIFF, extra=extra)


def test_diff_threshold_second_view_errors():
    q, k, v = inputs()
    ok = diff_extras(q, k)
    cases = [
        (dict(q2=ok["q2"].double()), r"q2 must have the dtype of q"),
        (dict(k2=ok["k2"].double()), r"k2 must have the dtype of q"),
        (dict(q2=ok["q2"][0]), r"q2 must have 4 dims"),
        (dict(k2=ok["k2"].to("meta")), r"k2 must be on the device of q"),
        (dict(q2=ok["q2"][:, :, :2]), r"q2/k2 must match q/k shapes"),
        (dict(k2=torch.randn(B, N, 1, D)), r"q2/k2 must match q/k shapes"),
        (dict(lam=torch.ones(H + 1)), r"lam must be a tensor of shape \(H,\) = \(4,\)"),
        (dict(lam=torch.ones(1, H)), r"lam must be a tensor of shape \(H,\) = \(4,\)"),
        (dict(lam=[0.5] * H), r"lam must be a tensor of shape \(H,\) = \(4,\)"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            call(q, k, v, DIFF, extra={**ok, **change})


def test_spec_of_wrong_type():
    q, k, v = inputs()
    for bad in ("softmax", get_variant("softmax"), None):
        with pytest.raises(ValueError, match=r"spec must be a SoftmaxFamilySpec, ThresholdFamilySpec or SigmoidFamilySpec"):
            call(q, k, v, bad)


def test_unknown_backend():
    q, k, v = inputs()
    for bad in ("cuda", "Triton", "", None):
        with pytest.raises(ValueError, match=r"attn\.backend must be one of \('auto', 'triton', 'reference', 'sdpa'\)"):
            call(q, k, v, backend=bad)


def test_triton_backend_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"backend='triton' needs a CUDA device \(or TRITON_INTERPRET=1 on CPU\); inputs are on cpu"):
        call(q, k, v, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # only "1" enables the interpreter
    with pytest.raises(ValueError, match=r"backend='triton' needs a CUDA device"):
        call(q, k, v, backend="triton")


def test_triton_backend_kernel_limits_under_interpreter(monkeypatch):
    """The kernel limits are checked before any kernel module is imported."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = inputs(d=24)
    with pytest.raises(ValueError, match=r"head dim D must be one of \(16, 32, 64, 128\) for backend='triton', got 24"):
        call(q, k, v, backend="triton")
    q, k, v = inputs(torch.float64, d=16)
    with pytest.raises(ValueError, match=r"q\.dtype must be float16, bfloat16 or float32 for backend='triton', got torch\.float64"):
        call(q, k, v, backend="triton")


# ----------------------------------------------------------------------------------------
# Registry and spec validation
# ----------------------------------------------------------------------------------------

def test_registry_lists_the_variants_with_their_families():
    assert variant_names() == ALL_VARIANTS
    families = {name: get_variant(name).family for name in ALL_VARIANTS}
    assert families == {"softmax": "softmax", "softcap_tanh": "softmax", "softcap_softsign": "softmax",
                        "alsc": "softmax", "threshold": "threshold", "diff_threshold": "threshold",
                        "sigmoid": "sigmoid"}
    for name in ALL_VARIANTS:
        spec = get_variant(name).make_spec()
        assert family_of(spec).name == get_variant(name).family
        hash(spec)  # frozen: usable as a kernel specialization key
    assert get_variant("diff_threshold").views == 2 and get_variant("threshold").views == 1
    assert get_variant("threshold").qk_norm == "l2" and get_variant("softmax").qk_norm == "none"
    assert get_variant("sigmoid").qk_norm == "rms" and get_variant("sigmoid").out_norm


def test_make_spec_defaults_follow_the_design():
    alsc = get_variant("alsc").make_spec()
    assert (alsc.cap, alsc.cap_value, alsc.knee) == ("alsc", 30.0, 0.5)
    assert get_variant("softcap_tanh").make_spec(cap=5.0).cap == "tanh"
    assert get_variant("softcap_softsign").make_spec(cap=5.0).cap == "soft_sign"
    assert get_variant("softmax").make_spec().cap == "none"
    assert get_variant("softmax").make_spec().scale(64) == pytest.approx(1 / 8)
    assert get_variant("softmax").make_spec(sm_scale=0.3).scale(64) == 0.3
    t = get_variant("threshold").make_spec()
    assert (t.beta, t.power, t.differential) == (1.0, 2.0, False)
    assert get_variant("diff_threshold").make_spec(beta=0.5, power=1.0) == ThresholdFamilySpec(0.5, 1.0, True)
    sigmoid = get_variant("sigmoid").make_spec()
    assert (sigmoid.bias, sigmoid.sm_scale, sigmoid.scale(64)) == (None, None, pytest.approx(1 / 8))
    assert get_variant("sigmoid").make_spec(bias=-3.0, sm_scale=0.2).scale(64) == 0.2


@pytest.mark.parametrize("bad", ["nope", "Softmax", "soft_cap", ""])
def test_get_variant_unknown_lists_allowed_names(bad):
    with pytest.raises(ValueError, match=r"attn\.name must be one of") as info:
        get_variant(bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in ALL_VARIANTS:
        assert repr(name) in message


def test_make_spec_unknown_parameter():
    with pytest.raises(ValueError, match=r"attn=softmax does not take \['cap'\]; allowed parameters: \['sm_scale'\]"):
        get_variant("softmax").make_spec(cap=5.0)
    with pytest.raises(ValueError, match=r"attn=threshold does not take \['cap', 'knee'\]; allowed parameters: \['beta', 'power'\]"):
        get_variant("threshold").make_spec(knee=0.5, cap=3.0)
    with pytest.raises(ValueError, match=r"attn=softcap_tanh does not take \['knee'\]"):
        get_variant("softcap_tanh").make_spec(knee=0.5)


@pytest.mark.parametrize("name", ["softcap_tanh", "softcap_softsign", "alsc"])
@pytest.mark.parametrize("cap", [0, 0.0, -1.0, float("nan"), "30"])
def test_cap_must_be_positive(name, cap):
    # the config key is `cap` (the value c); the message must name it, not an internal field
    with pytest.raises(ValueError, match=r"attn\.cap\b.*must be > 0"):
        get_variant(name).make_spec(cap=cap)


@pytest.mark.parametrize("name,params", [("softcap_tanh", {}), ("softcap_softsign", {}), ("alsc", {"knee": 0.0})])
def test_infinite_cap_is_refused(name, params):
    """c = inf would silently be no cap at all (and 0 * inf in the kernels' scalars): refused."""
    with pytest.raises(ValueError, match=r"attn\.cap\b.*must be > 0 and finite"):
        get_variant(name).make_spec(cap=float("inf"), **params)


@pytest.mark.parametrize("knee", [1.0, 1.5, -0.1, -1e-12])
def test_kappa_outside_unit_interval(knee):
    with pytest.raises(ValueError, match=r"attn\.knee \(kappa\) must be in \[0, 1\)"):
        get_variant("alsc").make_spec(knee=knee)


@pytest.mark.parametrize("knee", [0.0, 0.5, 0.999])
def test_kappa_inside_unit_interval_accepted(knee):
    assert get_variant("alsc").make_spec(knee=knee).knee == knee


@pytest.mark.parametrize("name", ["threshold", "diff_threshold"])
@pytest.mark.parametrize("power", [0, 0.0, -1.0, -2.0, float("inf"), float("nan"), "2"])
def test_power_must_be_finite_positive(name, power):
    with pytest.raises(ValueError, match=r"attn\.power \(p\) must be a finite float > 0"):
        get_variant(name).make_spec(power=power)


@pytest.mark.parametrize("beta", [float("inf"), float("nan"), "1"])
def test_beta_must_be_finite(beta):
    with pytest.raises(ValueError, match=r"attn\.beta must be a finite float"):
        get_variant("threshold").make_spec(beta=beta)


@pytest.mark.parametrize("name", ["softmax", "alsc", "sigmoid"])
@pytest.mark.parametrize("sm_scale", [0.0, -0.125, float("inf"), float("nan"), "abc", True])
def test_sm_scale_must_be_positive_and_finite(name, sm_scale):
    """sm_scale must be a finite number > 0: inf, NaN, zero, negatives, strings and bools are named."""
    with pytest.raises(ValueError, match=r"attn\.sm_scale must be > 0 and finite, or null \(D\^-1/2\), got "):
        get_variant(name).make_spec(sm_scale=sm_scale)


@pytest.mark.parametrize("knee", ["abc", None, float("nan")])
def test_kappa_that_is_no_number_is_named(knee):
    with pytest.raises(ValueError, match=r"attn\.knee \(kappa\) must be in \[0, 1\)"):
        get_variant("alsc").make_spec(knee=knee)


def test_bf16_under_the_triton_interpreter_is_refused(monkeypatch):
    """The interpreter mishandles bf16 (outputs of 1e8 instead of the reference's values): refused by name."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = inputs(torch.bfloat16, d=16)
    with pytest.raises(ValueError, match=r"q\.dtype bfloat16 cannot run on the Triton interpreter"):
        call(q, k, v, backend="triton")


def test_unknown_cap_method():
    with pytest.raises(ValueError, match=r"attn\.cap must be one of \('none', 'tanh', 'soft_sign', 'alsc'\), got 'relu'"):
        SoftmaxFamilySpec(cap="relu")
    with pytest.raises(ValueError, match=r"cap method must be one of \('none', 'tanh', 'soft_sign', 'alsc'\), got 'relu'"):
        apply_cap(torch.zeros(3), "relu", 1.0, 0.5)


@pytest.mark.parametrize("window", [0, -1, 1.5, True])
def test_mask_spec_bad_window(window):
    with pytest.raises(ValueError, match=r"window must be a positive int or None"):
        MaskSpec(window=window)


def test_mask_spec_kinds():
    assert MaskSpec(causal=False).kind == "full" and not MaskSpec(causal=False).is_causal
    assert MaskSpec().kind == "causal" and MaskSpec().is_causal
    assert MaskSpec(causal=False, window=3).kind == "window" and MaskSpec(causal=False, window=3).is_causal


def test_the_small_input_holes_are_named_errors():
    """Empty shapes, segment ids that are not a signed integer tensor, and a causal flag that is
    not a bool each give one ValueError naming the argument (they crashed or ran silently)."""
    spec = get_variant("softmax").make_spec()
    q, k, v = inputs(torch.float64)
    empty = q[:, :0]
    with pytest.raises(ValueError, match=r"q must have B, N, H, D >= 1"):
        attn.attention(empty, k[:, :0], v[:, :0], spec, backend="reference")
    with pytest.raises(ValueError, match=r"q must have B, N, H, D >= 1"):
        attn.attention(q[..., :0], k[..., :0], v[..., :0], spec, backend="reference")
    b, n = q.shape[:2]
    with pytest.raises(ValueError,
                       match=r"segment_ids must be a \(B, N\) integer tensor or an attn.SegmentMask, got list"):
        attn.attention(q, k, v, spec, causal=False, segment_ids=[[1] * n] * b, backend="reference")
    unsigned = torch.ones(b, n, dtype=torch.uint8)
    unsigned[:, -1] = 255
    with pytest.raises(ValueError, match=r"segment_ids must be an integer tensor, signed"):
        attn.attention(q, k, v, spec, causal=False, segment_ids=unsigned, backend="reference")
    for bad in (None, 1, "yes"):
        with pytest.raises(ValueError, match=r"causal must be True or False"):
            attn.attention(q, k, v, spec, causal=bad, backend="reference")
        with pytest.raises(ValueError, match=r"causal must be True or False"):
            attn.AttentionCall(spec, causal=bad)
