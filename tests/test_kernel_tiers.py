"""The tier choice between the portable kernels and the Gluon sm_90 ones (attn/kernels/tiers.py), on the
CPU: the ATTNLAB_GLUON switch, the timed choice per tuning key, and that nothing picks Gluon where it
cannot run. tests/test_gluon_gpu.py runs the Gluon tier itself on a Hopper GPU."""

from __future__ import annotations

import pytest
import torch
from attn.kernels import runtime, tiers


def _impls(log):
    return (lambda *args: log.append(("portable", args)) or "portable-result",
            lambda *args: log.append(("gluon", args)) or "gluon-result")


@pytest.fixture
def fake_timer(monkeypatch):
    """Timing that reports a fixed time per implementation (by the name its call logs)."""
    times = {}

    def median_ms(fn):
        before = len(calls)
        fn()
        return times[calls[before][0]]

    calls = []
    monkeypatch.setattr(runtime, "median_ms", median_ms)
    return times, calls


def test_switch_values(monkeypatch):
    monkeypatch.delenv(tiers.GLUON_ENV, raising=False)
    assert tiers.gluon_mode() == tiers.GLUON_DEFAULT
    for value in tiers.GLUON_MODES:
        monkeypatch.setenv(tiers.GLUON_ENV, value)
        assert tiers.gluon_mode() == value
    monkeypatch.setenv(tiers.GLUON_ENV, "yes")
    with pytest.raises(ValueError, match="ATTNLAB_GLUON must be one of"):
        tiers.gluon_mode()


@pytest.mark.parametrize("mode,expected", [("0", "portable-result"), ("1", "gluon-result")])
def test_forced_tier_runs_without_timing(mode, expected, monkeypatch, fake_timer):
    monkeypatch.setenv(tiers.GLUON_ENV, mode)
    _, calls = fake_timer
    portable, gluon = _impls(calls)
    choice = tiers.TierChoice("kernel")
    assert choice.pick(("key",), portable, gluon, (1,))(1) == expected
    assert choice.timings == {} and len(calls) == 1


@pytest.mark.parametrize("portable_ms,gluon_ms,winner", [(1.0, 0.8, "gluon"), (0.5, 0.9, "portable")])
def test_auto_times_each_key_once_and_keeps_the_faster(portable_ms, gluon_ms, winner, monkeypatch, fake_timer):
    monkeypatch.setenv(tiers.GLUON_ENV, "auto")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    times, calls = fake_timer
    times.update(portable=portable_ms, gluon=gluon_ms)
    portable, gluon = _impls(calls)
    choice = tiers.TierChoice("kernel")
    assert choice.pick(("a",), portable, gluon, (7,))(7) == f"{winner}-result"
    assert choice.timings[("a",)] == {"portable": portable_ms, "gluon": gluon_ms}
    assert choice.chosen == {("a",): winner}
    timed_calls = len(calls)
    assert all(args == (7,) for _, args in calls)  # timed on the call's own arguments
    choice.pick(("a",), portable, gluon, (7,))(7)
    assert len(calls) == timed_calls + 1 and len(choice.timings) == 1  # remembered, not timed again
    choice.pick(("b",), portable, gluon, (8,))
    assert set(choice.timings) == {("a",), ("b",)}
    assert winner in next(iter(choice.report().values()))


def test_pinned_configs_keep_the_portable_tier_untimed(monkeypatch, fake_timer):
    monkeypatch.setenv(tiers.GLUON_ENV, "auto")
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "0")
    _, calls = fake_timer
    portable, gluon = _impls(calls)
    choice = tiers.TierChoice("kernel")
    assert choice.pick(("a",), portable, gluon, ())() == "portable-result"
    assert choice.chosen == {} and choice.timings == {}


def test_a_timed_choice_keeps_the_fastest_of_several_and_serves_the_untimed_one_while_pinned(monkeypatch, fake_timer):
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    times, calls = fake_timer
    times.update(a=3.0, b=1.0, c=2.0)
    impls = {name: (lambda name: lambda *args: calls.append((name, args)) or name)(name) for name in "abc"}
    choice = tiers.TimedChoice("launch")
    assert choice.choose(("k",), impls, (1,), "a")(1) == "b"
    assert choice.timings[("k",)] == {"a": 3.0, "b": 1.0, "c": 2.0} and choice.chosen == {("k",): "b"}
    assert choice.report() == {"launch, ('k',)": "b (a 3.0000 ms, b 1.0000 ms, c 2.0000 ms)"}
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "0")
    assert choice.choose(("k",), impls, (1,), "a")(1) == "b"  # a key chosen before stays chosen
    timed_calls = len(calls)
    assert choice.choose(("new",), impls, (1,), "a")(1) == "a"  # pinned: the untimed one, not remembered
    assert len(calls) == timed_calls + 1 and ("new",) not in choice.chosen


@pytest.mark.parametrize("separate_ms,one_pass_ms,winner", [(2.0, 1.0, "one_pass"), (1.0, 1.5, "separate")])
def test_the_gluon_dq_form_is_timed_per_key_under_auto(separate_ms, one_pass_ms, winner, gluon_offered,
                                                      monkeypatch):
    """ATTNLAB_GLUON_DQ=auto (the default): the softmax backward plan's Gluon tier times the separate and the
    one-pass forms on the call's own arguments at a key's first call and keeps the faster; under
    torch.use_deterministic_algorithms, or with d-temperature asked for (only the separate form's dQ
    kernel sums it), the separate form, untimed."""
    import attn
    from attn.kernels import gluon_softmax_bwd, softmax_family

    monkeypatch.delenv(tiers.GLUON_DQ_ENV, raising=False)
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    monkeypatch.setattr(gluon_softmax_bwd, "serves", lambda q, k, v: True)
    monkeypatch.setattr(softmax_family, "_GLUON_DQ_FORMS", tiers.TimedChoice("dq form"))
    log = []

    def fake(q, k, v, *args, form=None, **named):
        log.append(form)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def fake_with_dt(q, k, v, *args, temperature, **named):
        log.append("with_dt")
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(temperature)

    monkeypatch.setattr(gluon_softmax_bwd, "launch_backward", fake)
    monkeypatch.setattr(gluon_softmax_bwd, "launch_backward_with_dt", fake_with_dt)

    def median_ms(fn):
        before = len(log)
        fn()
        return {"separate": separate_ms, "one_pass": one_pass_ms}[log[before]]

    monkeypatch.setattr(runtime, "median_ms", median_ms)
    spec = attn.get_variant("softcap_tanh").make_spec(cap=30.0)

    def backward(**kwargs):
        q, k, v = (torch.randn(1, 24, 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
        attn.attention(q, k, v, spec, causal=True, backend="triton", **kwargs).sum().backward()

    backward()
    # each form once to compile and tune, once timed; then the winner serves the call
    assert log == ["separate", "separate", "one_pass", "one_pass", winner]
    assert list(softmax_family._GLUON_DQ_FORMS.chosen.values()) == [winner]
    del log[:]
    backward()
    assert log == [winner]  # remembered
    del log[:]
    torch.use_deterministic_algorithms(True)
    try:
        backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert log == ["separate"]
    del log[:]
    backward(temperature=(torch.rand(1, 24) + 0.5).requires_grad_())
    assert log == ["with_dt"]


def test_gluon_never_usable_off_a_cuda_device_or_under_the_interpreter(monkeypatch):
    assert not tiers.gluon_usable(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not tiers.gluon_usable(torch.device("cuda", 0))  # decided before any CUDA query


@pytest.mark.parametrize("value,form", [(None, "auto"), ("auto", "auto"), ("separate", "separate"),
                                        ("one_pass", "one_pass")])
def test_gluon_dq_form_switch_values(value, form, monkeypatch):
    """ATTNLAB_GLUON_DQ picks the Gluon softmax backward's dq form (auto by default: timed per key); anything
    else is a ValueError naming the variable."""
    from attn.kernels import gluon_softmax_bwd

    if value is None:
        monkeypatch.delenv(gluon_softmax_bwd.DQ_FORM_ENV, raising=False)
    else:
        monkeypatch.setenv(gluon_softmax_bwd.DQ_FORM_ENV, value)
    assert gluon_softmax_bwd.dq_form() == form
    monkeypatch.setenv(gluon_softmax_bwd.DQ_FORM_ENV, "one-pass")
    with pytest.raises(ValueError, match="ATTNLAB_GLUON_DQ must be one of"):
        gluon_softmax_bwd.dq_form()


@pytest.mark.parametrize("value,bf16,fp16", [(None, 0, 0), ("mufu", 0, 0), ("poly", 3, 4), ("half", -3, -4)])
def test_exp2_switch_values(value, bf16, fp16, monkeypatch):
    if value is None:
        monkeypatch.delenv(tiers.GLUON_EXP2_ENV, raising=False)
    else:
        monkeypatch.setenv(tiers.GLUON_EXP2_ENV, value)
    assert (tiers.gluon_exp2_degree(torch.bfloat16), tiers.gluon_exp2_degree(torch.float16)) == (bf16, fp16)
    monkeypatch.setenv(tiers.GLUON_EXP2_ENV, "fast")
    with pytest.raises(ValueError, match="ATTNLAB_GLUON_EXP2 must be one of"):
        tiers.gluon_exp2_degree(torch.bfloat16)


def test_softmax_plans_read_the_switch(monkeypatch):
    """A changed ATTNLAB_GLUON takes effect at the next call: the forward's plans key on it."""
    from attn.kernels import softmax_family as sf

    assert tiers.GLUON_ENV in sf._FWD_PLANS.settings and tiers.GLUON_EXP2_ENV in sf._FWD_PLANS.settings


@pytest.mark.parametrize("value,pingpong", [(None, False), ("unordered", False), ("pingpong", True)])
def test_schedule_switch_values(value, pingpong, monkeypatch):
    if value is None:
        monkeypatch.delenv(tiers.GLUON_SCHEDULE_ENV, raising=False)
    else:
        monkeypatch.setenv(tiers.GLUON_SCHEDULE_ENV, value)
    assert tiers.gluon_pingpong() is pingpong
    monkeypatch.setenv(tiers.GLUON_SCHEDULE_ENV, "ping-pong")
    with pytest.raises(ValueError, match="ATTNLAB_GLUON_SCHEDULE must be one of"):
        tiers.gluon_pingpong()


def test_every_gluon_forward_plan_reads_the_schedule_switch():
    """A changed ATTNLAB_GLUON_SCHEDULE takes effect at the next call of every family with a Gluon forward."""
    from attn.kernels import sigmoid_family, softmax_family, threshold_family

    for family in (softmax_family, threshold_family, sigmoid_family):
        assert tiers.GLUON_SCHEDULE_ENV in family._FWD_PLANS.settings, family.__name__


def _fake_gluon(monkeypatch, module, name, log, result):
    """Replaces a Gluon launcher by one that logs its arguments and returns `result(q)`."""
    def launch(q, k, v, *args, **kwargs):
        log.append((name, args, kwargs))
        return result(q)
    monkeypatch.setattr(module, name, launch)


@pytest.fixture
def gluon_offered(monkeypatch):
    """Every family's plans offer the Gluon tier on the CPU (ATTNLAB_GLUON=1; the softmax backward's dq form,
    the grids and the differential backward's forms fixed, untimed: ATTNLAB_GLUON_DQ=separate,
    ATTNLAB_GLUON_PERSISTENT=0, ATTNLAB_GLUON_DIFF_DKDV=key_halves, ATTNLAB_GLUON_DIFF_DQ=rows), its launchers
    logged."""
    from attn.kernels import (gluon_diff_fwd, gluon_softmax_fwd, gluon_weighted_fwd, sigmoid_family, softmax_family,
                              threshold_family)

    monkeypatch.setenv(tiers.GLUON_ENV, "1")
    monkeypatch.setenv(tiers.GLUON_DQ_ENV, "separate")
    monkeypatch.setenv(tiers.GLUON_PERSISTENT_ENV, "0")
    monkeypatch.setenv(tiers.GLUON_DIFF_DKDV_ENV, "key_halves")
    monkeypatch.setenv(tiers.GLUON_DIFF_DQ_ENV, "rows")
    for family in (softmax_family, threshold_family, sigmoid_family):
        monkeypatch.setattr(family, "gluon_candidate", lambda device: True)
    log = []
    _fake_gluon(monkeypatch, gluon_softmax_fwd, "launch_forward", log,
                lambda q: (torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])))
    _fake_gluon(monkeypatch, gluon_weighted_fwd, "launch_threshold", log, torch.zeros_like)
    _fake_gluon(monkeypatch, gluon_weighted_fwd, "launch_sigmoid", log, torch.zeros_like)
    _fake_gluon(monkeypatch, gluon_diff_fwd, "launch_diff_threshold", log, torch.zeros_like)
    return log


def _second_view(q, k, heads, requires_grad=False, lam_dtype=torch.float32):
    """The differential threshold's `extra`: q2, k2 like q, k and per-head lambdas of both signs."""
    return {"q2": torch.randn_like(q).requires_grad_(requires_grad),
            "k2": torch.randn_like(k).requires_grad_(requires_grad),
            "lam": torch.linspace(-0.5, 1.0, heads, dtype=lam_dtype).requires_grad_(requires_grad)}


SERVED = [  # (variant, params, call options, the Gluon launcher expected or None)
    ("softmax", {}, {}, "launch_forward"),
    ("softcap_tanh", {"cap": 5.0}, {"temperature": True}, "launch_forward"),
    ("alsc", {}, {"causal": False}, "launch_forward"),
    ("softmax", {}, {"window": 4}, None),
    ("softmax", {}, {"segments": True}, None),
    ("threshold", {"beta": 0.5, "power": 1.5}, {}, "launch_threshold"),
    ("threshold", {}, {"window": 4}, None),
    ("diff_threshold", {"beta": 0.5, "power": 1.5}, {}, "launch_diff_threshold"),
    ("diff_threshold", {}, {"causal": False}, "launch_diff_threshold"),
    ("diff_threshold", {}, {"window": 4}, None),
    ("diff_threshold", {}, {"segments": True}, None),
    ("diff_threshold", {}, {"dropout": True}, None),
    ("sigmoid", {"bias": -1.0}, {"causal": False}, "launch_sigmoid"),
    ("sigmoid", {}, {"segments": True}, None),
]


@pytest.mark.parametrize("variant,params,options,launcher", SERVED,
                         ids=[f"{v}-{sorted(o)}" for v, _, o, _ in SERVED])
def test_plans_offer_the_gluon_tier_to_the_calls_it_serves(variant, params, options, launcher, gluon_offered):
    """Segments, a window and dropout stay portable; the rest reach their Gluon launcher with the call's
    mask and the variant's parameters (the differential threshold: its second view and lambdas too)."""
    import attn

    spec = attn.get_variant(variant).make_spec(**params)
    b, n, h, d = 1, 24, 2, 64
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.float16) for _ in range(3))
    causal = options.get("causal", True)
    kwargs = dict(causal=causal, window=options.get("window"), backend="triton")
    if options.get("temperature"):
        kwargs["temperature"] = torch.rand(b, n) + 0.5
    if options.get("segments"):
        kwargs["segment_ids"] = torch.tensor([[1] * 16 + [-1] * 8], dtype=torch.int32)
    if options.get("dropout"):
        kwargs.update(dropout_p=0.25, dropout_seed=3)
    if variant == "diff_threshold":
        kwargs["extra"] = _second_view(q, k, h)
    with torch.no_grad():
        attn.attention(q, k, v, spec, **kwargs)
    if launcher is None:
        assert gluon_offered == []
        return
    (name, args, named), = gluon_offered
    if variant == "diff_threshold":
        extra = kwargs["extra"]
        q2, k2, lam, got_causal, *variant_args = args
        assert q2 is extra["q2"] and k2 is extra["k2"] and lam is extra["lam"]  # fp32 lambda: read as it is
        assert name == launcher and got_causal is causal and variant_args == [spec.beta, spec.power]
        return
    assert name == launcher and args[0] is causal
    if variant == "threshold":
        assert args[1:] == (0.5, 1.5)
    if variant == "sigmoid":
        assert args[2] == -1.0
    if variant == "softcap_tanh":
        assert named["cap"] == 1 and named["temperature"] is not None and named["shift"] is None  # fp16: online
    if launcher == "launch_forward":
        assert named["exp2_poly"] == 0  # MUFU.EX2 unless ATTNLAB_GLUON_EXP2 says otherwise
    assert named["persistent"] is False  # ATTNLAB_GLUON_PERSISTENT=0
    assert named["pingpong"] is False  # consumers unordered unless ATTNLAB_GLUON_SCHEDULE says otherwise


# (variable, its values, its reader, a value it refuses): the persistent grid's and the differential backward's
# key-block form's switches, "auto" when unset
TIMED_SWITCHES = [(tiers.GLUON_PERSISTENT_ENV, tiers.GLUON_PERSISTENT_MODES, tiers.gluon_persistent_mode, "yes"),
                  (tiers.GLUON_DIFF_DKDV_ENV, tiers.GLUON_DIFF_DKDV_FORMS, tiers.gluon_diff_dkdv_form, "views"),
                  (tiers.GLUON_DIFF_DQ_ENV, tiers.GLUON_DIFF_DQ_FORMS, tiers.gluon_diff_dq_form, "views")]


@pytest.mark.parametrize("env,values,read,refused", TIMED_SWITCHES, ids=[s[0] for s in TIMED_SWITCHES])
def test_gluon_timed_switch_values(env, values, read, refused, monkeypatch):
    for value in values:
        monkeypatch.setenv(env, value)
        assert read() == value
    monkeypatch.delenv(env)
    assert read() == "auto"
    monkeypatch.setenv(env, refused)
    with pytest.raises(ValueError, match=f"{env} must be one of"):
        read()


GRID_FAMILIES = [("softcap_tanh", {"cap": 30.0}, "softmax_family", "_GLUON_GRIDS"),
                 ("threshold", {}, "threshold_family", "_GLUON_GRIDS"),
                 ("diff_threshold", {}, "threshold_family", "_DIFF_GLUON_GRIDS"),
                 ("sigmoid", {}, "sigmoid_family", "_GLUON_GRIDS")]


@pytest.mark.parametrize("variant,params,family,choice", GRID_FAMILIES, ids=[v for v, *_ in GRID_FAMILIES])
@pytest.mark.parametrize("per_item_ms,persistent_ms,winner", [(2.0, 1.0, True), (1.0, 1.5, False)])
def test_the_gluon_forward_grid_is_timed_per_key_under_auto(per_item_ms, persistent_ms, winner, variant, params,
                                                           family, choice, gluon_offered, monkeypatch):
    """ATTNLAB_GLUON_PERSISTENT=auto (the default): a forward plan's Gluon tier (softmax family, threshold,
    differential threshold, sigmoid) times the per-item and the persistent grid on the call's own arguments at
    a key's first call and keeps the faster, keyed by the work items too; "0" / "1" pin a grid; the ping-pong
    schedule runs per item, untimed (the differential forward has none)."""
    import importlib

    import attn

    plans = importlib.import_module(f"attn.kernels.{family}")
    monkeypatch.setenv(tiers.GLUON_PERSISTENT_ENV, "auto")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    monkeypatch.setattr(plans, choice, tiers.TimedChoice("grid"))

    def median_ms(fn):
        before = len(gluon_offered)
        fn()
        return persistent_ms if gluon_offered[before][2]["persistent"] else per_item_ms

    monkeypatch.setattr(runtime, "median_ms", median_ms)
    spec = attn.get_variant(variant).make_spec(**params)

    def forward(batch=1):
        q, k, v = (torch.randn(batch, 24, 2, 64, dtype=torch.float16) for _ in range(3))
        extra = _second_view(q, k, 2) if variant == "diff_threshold" else None
        with torch.no_grad():
            attn.attention(q, k, v, spec, causal=True, backend="triton", extra=extra)
        grids = [named["persistent"] for _, _, named in gluon_offered]
        del gluon_offered[:]
        return grids

    # each grid once to compile, once timed; then the winner serves the call
    assert forward() == [False, False, True, True, winner]
    assert list(getattr(plans, choice).chosen.values()) == ["persistent" if winner else "per_item"]
    assert forward() == [winner]  # remembered
    assert forward(batch=64) == [False, False, True, True, winner]  # more work items: a key of its own
    for value, persistent in (("0", False), ("1", True)):
        monkeypatch.setenv(tiers.GLUON_PERSISTENT_ENV, value)
        assert forward() == [persistent]
    monkeypatch.setenv(tiers.GLUON_PERSISTENT_ENV, "auto")
    monkeypatch.setenv(tiers.GLUON_SCHEDULE_ENV, "pingpong")
    # (the differential forward has no ping-pong schedule: its timed grid stays)
    assert forward(batch=2) == ([winner] if variant == "diff_threshold" else [False])


def test_the_exp2_switch_reaches_the_gluon_launcher(gluon_offered, monkeypatch):
    import attn

    monkeypatch.setenv(tiers.GLUON_EXP2_ENV, "half")
    q, k, v = (torch.randn(1, 24, 2, 64, dtype=torch.float16) for _ in range(3))
    with torch.no_grad():
        attn.attention(q, k, v, attn.get_variant("softcap_tanh").make_spec(cap=5.0), causal=True, backend="triton")
    (_, _, named), = gluon_offered
    assert named["exp2_poly"] == -4  # fp16 P: degree 4, half the scores


@pytest.mark.parametrize("variant,params,launcher", [("softcap_tanh", {"cap": 5.0}, "launch_forward"),
                                                     ("threshold", {}, "launch_threshold"),
                                                     ("sigmoid", {}, "launch_sigmoid")])
def test_the_schedule_switch_reaches_every_gluon_forward_launcher(variant, params, launcher, gluon_offered,
                                                                  monkeypatch):
    import attn

    monkeypatch.setenv(tiers.GLUON_SCHEDULE_ENV, "pingpong")
    q, k, v = (torch.randn(1, 24, 2, 64, dtype=torch.float16) for _ in range(3))
    with torch.no_grad():
        attn.attention(q, k, v, attn.get_variant(variant).make_spec(**params), causal=True, backend="triton")
    (name, _, named), = gluon_offered
    assert name == launcher and named["pingpong"] is True


BACKWARD_SERVED = [  # (variant, params, call options, the Gluon backward launcher expected or None)
    ("softmax", {}, {}, "launch_backward"),
    ("softmax", {}, {"causal": False}, "launch_backward"),
    ("softcap_tanh", {"cap": 5.0}, {}, "launch_backward"),
    ("alsc", {"cap": 3.0, "knee": 0.25}, {"temperature": True}, "launch_backward"),
    ("softmax", {}, {"temperature": "grad"}, "launch_backward_with_dt"),
    ("softmax", {}, {"window": 4}, None),
    ("softmax", {}, {"segments": True}, None),
    ("threshold", {"beta": 0.5, "power": 1.5}, {}, "launch_threshold_backward"),
    ("threshold", {}, {"window": 4}, None),
    ("diff_threshold", {"beta": 0.5, "power": 1.5}, {}, "launch_diff_threshold_backward"),
    ("diff_threshold", {"power": 1.0}, {"causal": False}, "launch_diff_threshold_backward"),
    ("diff_threshold", {}, {"window": 4}, None),
    ("diff_threshold", {}, {"segments": True}, None),
    ("diff_threshold", {}, {"dropout": True}, None),
    ("sigmoid", {"bias": -1.0}, {"causal": False}, "launch_sigmoid_backward"),
    ("sigmoid", {}, {}, "launch_sigmoid_backward"),
    ("sigmoid", {}, {"segments": True}, None),
]


@pytest.mark.parametrize("variant,params,options,launcher", BACKWARD_SERVED,
                         ids=[f"{v}-{sorted(o)}" for v, _, o, _ in BACKWARD_SERVED])
def test_backward_plans_offer_the_gluon_tier_to_the_calls_it_serves(variant, params, options, launcher,
                                                                   gluon_offered, monkeypatch):
    """Each family's backward plan hands exactly the calls the Gluon backwards serve to their launcher,
    with the upstream gradient, the forward's out and lse2 (softmax), the call's mask and the variant's
    parameters (the differential threshold: its second view and lambdas), and returns the launcher's
    gradients (d-lambda too); the rest stay portable."""
    import attn
    from attn.kernels import gluon_diff_bwd, gluon_softmax_bwd, gluon_weighted_bwd

    log = []

    def fake(name):
        def launch(q, k, v, *args, **named):
            log.append((name, args, named))
            grads = (torch.full_like(q, 2.0), torch.full_like(k, 3.0), torch.full_like(v, 4.0))
            if name == "launch_diff_threshold_backward":
                q2, k2, lam = args[:3]
                return (*grads, torch.full_like(q2, 6.0), torch.full_like(k2, 7.0), torch.full_like(lam, 8.0))
            return (*grads, torch.full_like(named["temperature"], 5.0)) if name.endswith("_dt") else grads
        return launch

    for name in ("launch_backward", "launch_backward_with_dt"):
        monkeypatch.setattr(gluon_softmax_bwd, name, fake(name))
    for name in ("launch_threshold_backward", "launch_sigmoid_backward"):
        monkeypatch.setattr(gluon_weighted_bwd, name, fake(name))
    monkeypatch.setattr(gluon_diff_bwd, "launch_diff_threshold_backward", fake("launch_diff_threshold_backward"))
    spec = attn.get_variant(variant).make_spec(**params)
    b, n, h, d = 1, 24, 2, 64
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.float16, requires_grad=True) for _ in range(3))
    causal = options.get("causal", True)
    kwargs = dict(causal=causal, window=options.get("window"), backend="triton")
    if options.get("temperature"):
        kwargs["temperature"] = (torch.rand(b, n) + 0.5).requires_grad_(options["temperature"] == "grad")
    if options.get("segments"):
        kwargs["segment_ids"] = torch.tensor([[1] * 16 + [-1] * 8], dtype=torch.int32)
    if options.get("dropout"):
        kwargs.update(dropout_p=0.25, dropout_seed=3)
    if variant == "diff_threshold":
        kwargs["extra"] = _second_view(q, k, h, requires_grad=True)
    out = attn.attention(q, k, v, spec, **kwargs)
    grad = torch.randn_like(out)
    out.backward(grad)
    if launcher is None:
        assert log == []
        return
    (name, args, named), = log
    assert name == launcher
    if variant == "diff_threshold":
        extra = kwargs["extra"]
        q2, k2, lam, dout, got_causal, *variant_args = args
        assert q2 is extra["q2"] and k2 is extra["k2"] and lam is extra["lam"]
        assert variant_args == [spec.beta, spec.power]
        assert (extra["q2"].grad == 6.0).all() and (extra["k2"].grad == 7.0).all()
        assert extra["lam"].grad.dtype == torch.float32 and (extra["lam"].grad == 8.0).all()
    elif launcher.startswith("launch_backward"):
        saved_out, dout, lse2, sm_scale, got_causal = args
        assert saved_out.shape == q.shape and lse2.shape == (b, h, n) and sm_scale == pytest.approx(d ** -0.5)
        cap_id = {"softmax": 0, "softcap_tanh": 1, "alsc": 3}[variant]
        assert named["cap"] == cap_id
        if cap_id:  # a plain softmax spec's cap value is never read, nor a knee but ALSC's
            assert named["cap_value"] == params["cap"]
        if variant == "alsc":
            assert named["knee"] == params["knee"]
        assert (named["temperature"] is None) == ("temperature" not in kwargs)
        if launcher.endswith("_dt"):
            assert (kwargs["temperature"].grad == 5.0).all()
    else:
        dout, got_causal, *variant_args = args
        expected = ([params["beta"], params["power"]] if variant == "threshold"
                    else [pytest.approx(d ** -0.5), params.get("bias")])
        assert variant_args == expected
        assert named["persistent"] is False  # ATTNLAB_GLUON_PERSISTENT=0
    assert torch.equal(dout, grad) and got_causal is causal
    assert (q.grad == 2.0).all() and (k.grad == 3.0).all() and (v.grad == 4.0).all()


def test_the_backward_plans_read_the_switch():
    from attn.kernels import sigmoid_family, softmax_family, threshold_family

    for family in (softmax_family, threshold_family, sigmoid_family):
        assert tiers.GLUON_ENV in family._BWD_PLANS.settings
    for family in (threshold_family, sigmoid_family):
        assert tiers.GLUON_PERSISTENT_ENV in family._BWD_PLANS.settings
    assert tiers.GLUON_DIFF_DKDV_ENV in threshold_family._BWD_PLANS.settings
    assert tiers.GLUON_DIFF_DQ_ENV in threshold_family._BWD_PLANS.settings


BACKWARD_GRID_FAMILIES = [("threshold", {"power": 1.5}, "threshold_family", "gluon_weighted_bwd",
                           "launch_threshold_backward"),
                          ("sigmoid", {}, "sigmoid_family", "gluon_weighted_bwd", "launch_sigmoid_backward"),
                          ("softcap_tanh", {"cap": 30.0}, "softmax_family", "gluon_softmax_bwd", "launch_backward")]


@pytest.mark.parametrize("variant,params,family,module,launcher", BACKWARD_GRID_FAMILIES,
                         ids=[v for v, *_ in BACKWARD_GRID_FAMILIES])
@pytest.mark.parametrize("per_item_ms,persistent_ms,winner", [(2.0, 1.0, True), (1.0, 1.5, False)])
def test_the_gluon_backward_grid_is_timed_per_key_under_auto(per_item_ms, persistent_ms, winner, variant, params,
                                                            family, module, launcher, gluon_offered, monkeypatch):
    """ATTNLAB_GLUON_PERSISTENT=auto, with the persistent backwards offered: the threshold, sigmoid and softmax
    family backward plans' Gluon tier (the softmax family's separate dq form) times the per-item and the
    persistent grid on the call's own arguments at a key's first backward and keeps the faster, keyed by the
    work items too; "0" / "1" pin a grid. Not offered (tiers.PERSISTENT_BACKWARDS_OFFERED): per item."""
    import importlib

    import attn

    plans = importlib.import_module(f"attn.kernels.{family}")
    kernels = importlib.import_module(f"attn.kernels.{module}")
    monkeypatch.setattr(tiers, "PERSISTENT_BACKWARDS_OFFERED", frozenset({"softmax", "threshold", "sigmoid"}))
    monkeypatch.setenv(tiers.GLUON_PERSISTENT_ENV, "auto")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    monkeypatch.setattr(plans, "_GLUON_BWD_GRIDS", tiers.TimedChoice("grid"))
    log = []

    def launch(q, k, v, *args, persistent, **named):
        log.append(persistent)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(kernels, launcher, launch)

    def median_ms(fn):
        forward_before, backward_before = len(gluon_offered), len(log)
        fn()
        persistent = log[-1] if len(log) > backward_before else gluon_offered[forward_before][2]["persistent"]
        return persistent_ms if persistent else per_item_ms

    monkeypatch.setattr(runtime, "median_ms", median_ms)
    spec = attn.get_variant(variant).make_spec(**params)

    def backward(batch=1):
        q, k, v = (torch.randn(batch, 24, 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
        attn.attention(q, k, v, spec, causal=True, backend="triton").sum().backward()
        grids = list(log)
        del log[:]
        return grids

    # each grid once to compile, once timed; then the winner serves the call
    assert backward() == [False, False, True, True, winner]
    assert list(plans._GLUON_BWD_GRIDS.chosen.values()) == ["persistent" if winner else "per_item"]
    assert backward() == [winner]  # remembered
    assert backward(batch=64) == [False, False, True, True, winner]  # more work items: a key of its own
    for value, persistent in (("0", False), ("1", True)):
        monkeypatch.setenv(tiers.GLUON_PERSISTENT_ENV, value)
        assert backward() == [persistent]
    monkeypatch.setattr(tiers, "PERSISTENT_BACKWARDS_OFFERED", frozenset())  # not offered: per item, whatever set
    runtime.clear_launch_plans()
    assert backward() == [False]


def _differential_backward(spec, batch: int = 1):
    """One differential threshold fwd+bwd through attn.attention (the kernel backend) at (batch, 24, 2, 64) fp16."""
    import attn

    q, k, v = (torch.randn(batch, 24, 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    extra = _second_view(q, k, 2, requires_grad=True)
    attn.attention(q, k, v, spec, causal=True, backend="triton", extra=extra).sum().backward()


def _log_diff_backward_launches(monkeypatch, record) -> list:
    """gluon_diff_bwd.launch_diff_threshold_backward replaced by a stand-in that returns zero gradients and logs
    record(its keyword arguments: dkdv_form, persistent, dq_form) per launch; the log."""
    from attn.kernels import gluon_diff_bwd

    log = []

    def launch(q, k, v, q2, k2, lam, *args, **named):
        log.append(record(named))
        return (*(torch.zeros_like(t) for t in (q, k, v, q2, k2)), torch.zeros_like(lam))

    monkeypatch.setattr(gluon_diff_bwd, "launch_diff_threshold_backward", launch)
    return log


@pytest.mark.parametrize("times,winner", [({"key_halves": 2.0, "view_warpgroups": 1.0, "view_exchange": 1.5},
                                              "view_warpgroups"),
                                             ({"key_halves": 1.0, "view_warpgroups": 1.5, "view_exchange": 2.0},
                                              "key_halves"),
                                             ({"key_halves": 2.0, "view_warpgroups": 1.5, "view_exchange": 1.0},
                                              "view_exchange")])
def test_the_differential_backward_form_is_timed_per_key_among_those_offered(times, winner, gluon_offered,
                                                                             monkeypatch):
    """The differential threshold's Gluon backward times the key-block forms tiers.DIFF_DKDV_FORMS_OFFERED holds
    on the call's own arguments at a key's first backward and keeps the fastest (ATTNLAB_GLUON_DIFF_DKDV=auto),
    keyed by the batch x head count too; a form's name pins it; a form not offered is never launched (the key
    halves instead, whatever the switch says); with one form offered nothing is timed."""
    import attn
    from attn.kernels import gluon_diff_bwd, threshold_family

    forms = tuple(gluon_diff_bwd.DKDV_FORMS)
    assert set(forms) == set(times) and forms[0] == "key_halves"
    monkeypatch.setattr(tiers, "DIFF_DKDV_FORMS_OFFERED", forms)
    monkeypatch.setenv(tiers.GLUON_DIFF_DKDV_ENV, "auto")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    monkeypatch.setattr(threshold_family, "_GLUON_DIFF_DKDV_FORMS", tiers.TimedChoice("form"))
    log = _log_diff_backward_launches(monkeypatch, lambda named: named["dkdv_form"])

    def median_ms(fn):
        fn()
        return times[log[-1]]

    monkeypatch.setattr(runtime, "median_ms", median_ms)
    spec = attn.get_variant("diff_threshold").make_spec()

    def backward(batch=1):
        _differential_backward(spec, batch)
        launched = list(log)
        del log[:]
        return launched

    timed = [form for form in forms for _ in range(2)]  # each form once to compile, once timed
    assert backward() == timed + [winner]  # then the winner serves the call
    assert list(threshold_family._GLUON_DIFF_DKDV_FORMS.chosen.values()) == [winner]
    assert backward() == [winner]  # remembered
    assert backward(batch=64) == timed + [winner]  # more (batch, head) pairs: a key of its own
    for form in forms:
        monkeypatch.setenv(tiers.GLUON_DIFF_DKDV_ENV, form)
        assert backward() == [form]
    monkeypatch.setattr(tiers, "DIFF_DKDV_FORMS_OFFERED", ("key_halves", "view_warpgroups"))
    monkeypatch.setenv(tiers.GLUON_DIFF_DKDV_ENV, "view_exchange")  # not offered: the key halves
    runtime.clear_launch_plans()
    assert backward() == ["key_halves"]
    monkeypatch.setattr(tiers, "DIFF_DKDV_FORMS_OFFERED", ("key_halves",))
    monkeypatch.setenv(tiers.GLUON_DIFF_DKDV_ENV, "auto")  # one form offered: launched untimed
    runtime.clear_launch_plans()
    assert backward(batch=3) == ["key_halves"]


@pytest.mark.parametrize("times,winner", [({"rows": 2.0, "view_warpgroups": 1.0}, "view_warpgroups"),
                                          ({"rows": 1.0, "view_warpgroups": 1.5}, "rows")])
def test_the_differential_query_block_form_is_timed_per_key_and_key_block_form(times, winner, gluon_offered,
                                                                             monkeypatch):
    """The differential threshold's Gluon backward times the query-block forms tiers.DIFF_DQ_FORMS_OFFERED holds
    (ATTNLAB_GLUON_DIFF_DQ=auto) for the key-block form in use at a key's first backward and keeps the faster,
    for each key-block form on its own; a form's name pins it; with one form offered nothing is timed."""
    import attn
    from attn.kernels import gluon_diff_bwd, threshold_family

    assert set(gluon_diff_bwd.DQ_FORMS) == set(times)
    monkeypatch.setattr(tiers, "DIFF_DQ_FORMS_OFFERED", gluon_diff_bwd.DQ_FORMS)
    monkeypatch.setenv(tiers.GLUON_DIFF_DQ_ENV, "auto")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    monkeypatch.setattr(threshold_family, "_GLUON_DIFF_DQ_FORMS", tiers.TimedChoice("dq form"))
    log = _log_diff_backward_launches(monkeypatch, lambda named: (named["dkdv_form"], named["dq_form"]))

    def median_ms(fn):
        fn()
        return times[log[-1][1]]

    monkeypatch.setattr(runtime, "median_ms", median_ms)
    spec = attn.get_variant("diff_threshold").make_spec()

    def backward():
        _differential_backward(spec)
        launched = list(log)
        del log[:]
        return launched

    timed = [("key_halves", form) for form in gluon_diff_bwd.DQ_FORMS for _ in range(2)]
    assert backward() == timed + [("key_halves", winner)]
    assert list(threshold_family._GLUON_DIFF_DQ_FORMS.chosen.values()) == [winner]
    assert backward() == [("key_halves", winner)]  # remembered
    monkeypatch.setenv(tiers.GLUON_DIFF_DKDV_ENV, "view_warpgroups")  # another key-block form: timed on its own
    monkeypatch.setattr(tiers, "DIFF_DKDV_FORMS_OFFERED", ("key_halves", "view_warpgroups"))
    assert backward() == [("view_warpgroups", form) for _, form in timed] + [("view_warpgroups", winner)]
    for form in gluon_diff_bwd.DQ_FORMS:
        monkeypatch.setenv(tiers.GLUON_DIFF_DQ_ENV, form)
        assert backward() == [("view_warpgroups", form)]
    monkeypatch.setattr(tiers, "DIFF_DQ_FORMS_OFFERED", ("rows",))
    monkeypatch.setenv(tiers.GLUON_DIFF_DQ_ENV, "view_warpgroups")  # not offered: the rows form
    runtime.clear_launch_plans()
    assert backward() == [("view_warpgroups", "rows")]
    monkeypatch.setenv(tiers.GLUON_DIFF_DQ_ENV, "auto")  # one form offered: launched untimed
    runtime.clear_launch_plans()
    assert backward() == [("view_warpgroups", "rows")]


@pytest.mark.parametrize("per_item_ms,persistent_ms,winner", [(2.0, 1.0, True), (1.0, 1.5, False)])
def test_the_differential_backward_grid_is_timed_per_key_once_offered(per_item_ms, persistent_ms, winner,
                                                                      gluon_offered, monkeypatch):
    """With "diff_threshold" in tiers.PERSISTENT_BACKWARDS_OFFERED and ATTNLAB_GLUON_PERSISTENT=auto, the
    differential backward times its per-item and persistent grids (for the key-block form in use) at a key's
    first backward and keeps the faster; "0" / "1" pin one; not offered: per item; with both view forms (no
    persistent launch among them) per item, untimed."""
    import attn
    from attn.kernels import threshold_family

    monkeypatch.setattr(tiers, "PERSISTENT_BACKWARDS_OFFERED",
                        frozenset({"softmax", "threshold", "sigmoid", "diff_threshold"}))
    monkeypatch.setenv(tiers.GLUON_PERSISTENT_ENV, "auto")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    monkeypatch.setattr(threshold_family, "_GLUON_DIFF_BWD_GRIDS", tiers.TimedChoice("grid"))
    log = _log_diff_backward_launches(monkeypatch, lambda named: (named["dkdv_form"], named["persistent"]))
    def median_ms(fn):  # the forward's grid is timed too under auto: its launches log in the fixture's list
        forward_before, backward_before = len(gluon_offered), len(log)
        fn()
        persistent = log[-1][1] if len(log) > backward_before else gluon_offered[forward_before][2]["persistent"]
        return persistent_ms if persistent else per_item_ms

    monkeypatch.setattr(runtime, "median_ms", median_ms)
    spec = attn.get_variant("diff_threshold").make_spec()

    def backward():
        _differential_backward(spec)
        grids = [persistent for form, persistent in log if form == "key_halves"]
        assert len(grids) == len(log)  # the fixture pins the key halves
        del log[:]
        return grids

    assert backward() == [False, False, True, True, winner]
    assert list(threshold_family._GLUON_DIFF_BWD_GRIDS.chosen.values()) == ["persistent" if winner else "per_item"]
    assert backward() == [winner]
    for value, persistent in (("0", False), ("1", True)):
        monkeypatch.setenv(tiers.GLUON_PERSISTENT_ENV, value)
        assert backward() == [persistent]
    monkeypatch.setattr(tiers, "PERSISTENT_BACKWARDS_OFFERED", frozenset({"softmax", "threshold", "sigmoid"}))
    runtime.clear_launch_plans()
    assert backward() == [False]
    # both view forms: no launch of theirs has a persistent grid, so nothing is timed and the per-item one runs
    monkeypatch.setattr(tiers, "PERSISTENT_BACKWARDS_OFFERED",
                        frozenset({"softmax", "threshold", "sigmoid", "diff_threshold"}))
    monkeypatch.setattr(tiers, "DIFF_DKDV_FORMS_OFFERED", ("key_halves", "view_warpgroups"))
    monkeypatch.setenv(tiers.GLUON_PERSISTENT_ENV, "auto")
    monkeypatch.setenv(tiers.GLUON_DIFF_DKDV_ENV, "view_warpgroups")
    monkeypatch.setenv(tiers.GLUON_DIFF_DQ_ENV, "view_warpgroups")
    runtime.clear_launch_plans()
    grid_keys = len(threshold_family._GLUON_DIFF_BWD_GRIDS.chosen)
    _differential_backward(spec)
    assert log == [("view_warpgroups", False)]
    assert len(threshold_family._GLUON_DIFF_BWD_GRIDS.chosen) == grid_keys


def test_the_softmax_backward_tier_is_timed_per_gluon_dq_form(gluon_offered, monkeypatch):
    """Under ATTNLAB_GLUON=auto the softmax backward's tier timing is keyed by ATTNLAB_GLUON_DQ as well:
    switching the dq form times the tiers again (each form's Gluon kernels are other kernels), and the
    backward plans are rebuilt when the switch changes."""
    import attn
    from attn.kernels import gluon_softmax_bwd, softmax_family

    assert tiers.GLUON_DQ_ENV in softmax_family._BWD_PLANS.settings
    monkeypatch.setenv(tiers.GLUON_ENV, "auto")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    monkeypatch.setattr(gluon_softmax_bwd, "serves", lambda q, k, v: True)
    for name in ("_TIERS", "_BWD_TIERS"):
        monkeypatch.setattr(softmax_family, name, tiers.TierChoice(getattr(softmax_family, name).name))
    timed = iter([2.0, 1.0] * 3)  # portable, then gluon, per timed key: gluon wins
    monkeypatch.setattr(runtime, "median_ms", lambda fn: next(timed))
    monkeypatch.setattr(gluon_softmax_bwd, "launch_backward",
                        lambda q, k, v, *args, **named: (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
    spec = attn.get_variant("softmax").make_spec()
    for form in ("separate", "one_pass", "separate"):
        monkeypatch.setenv(tiers.GLUON_DQ_ENV, form)
        q, k, v = (torch.randn(1, 24, 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
        attn.attention(q, k, v, spec, causal=True, backend="triton").sum().backward()
    assert sorted(key[-1] for key in softmax_family._BWD_TIERS.chosen) == ["one_pass", "separate"]
    assert set(softmax_family._BWD_TIERS.chosen.values()) == {"gluon"}


@pytest.mark.parametrize("lam_dtype,strided", [(torch.float64, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=["float64", "bfloat16", "float32-strided"])
def test_the_gluon_differential_kernels_take_lambda_of_any_float_dtype(lam_dtype, strided, gluon_offered,
                                                                       monkeypatch):
    """Lambda in a dtype the Gluon kernels read (fp32, bf16, fp16) reaches them as it is, strides and all;
    another float dtype as its fp32 copy (the value the portable kernels read); d-lambda comes back in
    lambda's own dtype, as the portable backward returns it."""
    import attn
    from attn.kernels import gluon_diff_bwd

    seen = []

    def backward(q, k, v, q2, k2, lam, dout, causal, beta, power, dkdv_form="key_halves", persistent=False,
                 dq_form="rows"):
        seen.append(lam)
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(q2),
                torch.zeros_like(k2), torch.full_like(lam, 0.25))

    monkeypatch.setattr(gluon_diff_bwd, "launch_diff_threshold_backward", backward)
    b, n, h, d = 1, 24, 2, 64
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.float16, requires_grad=True) for _ in range(3))
    extra = _second_view(q, k, h)
    values = torch.tensor([0.75, -0.25], dtype=lam_dtype)
    base = torch.zeros(2 * h, dtype=lam_dtype)
    base[::2] = values
    lam = (base[::2] if strided else values.clone()).requires_grad_()
    extra["lam"] = lam
    out = attn.attention(q, k, v, attn.get_variant("diff_threshold").make_spec(), causal=True, backend="triton",
                         extra=extra)
    out.backward(torch.ones_like(out))
    (_, (_, _, forward_lam, *_), _), = gluon_offered
    for got in (forward_lam, seen[0]):
        if lam_dtype == torch.float64:
            assert got.dtype == torch.float32 and torch.equal(got, values.float())
        else:
            assert got is lam
    assert lam.grad.dtype == lam_dtype and (lam.grad == 0.25).all()


def test_the_differential_threshold_has_tier_choices_of_its_own_keyed_by_power(monkeypatch):
    """Under ATTNLAB_GLUON=auto the plain and the differential threshold are timed under tier choices of their
    own (forward and backward), one key per power; tuned_configs() reports each choice with its times."""
    import attn
    from attn.kernels import gluon_diff_bwd, gluon_diff_fwd, threshold_family

    monkeypatch.setenv(tiers.GLUON_ENV, "auto")
    monkeypatch.setenv(tiers.GLUON_PERSISTENT_ENV, "0")
    monkeypatch.setenv(tiers.GLUON_DIFF_DQ_ENV, "rows")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    monkeypatch.setattr(threshold_family, "gluon_candidate", lambda device: True)
    for name in ("_TIERS", "_BWD_TIERS", "_DIFF_TIERS", "_DIFF_BWD_TIERS"):
        monkeypatch.setattr(threshold_family, name, tiers.TierChoice(getattr(threshold_family, name).name))
    timed = iter([2.0, 1.0] * 8)  # portable, then gluon, per timed key: gluon wins
    monkeypatch.setattr(runtime, "median_ms", lambda fn: next(timed))
    monkeypatch.setattr(gluon_diff_fwd, "launch_diff_threshold", lambda q, *args, **kwargs: torch.zeros_like(q))
    monkeypatch.setattr(gluon_diff_bwd, "launch_diff_threshold_backward",
                        lambda q, k, v, q2, k2, lam, *args, **named: (torch.zeros_like(q), torch.zeros_like(k),
                                                                       torch.zeros_like(v), torch.zeros_like(q2),
                                                                       torch.zeros_like(k2), torch.zeros_like(lam)))
    b, n, h, d = 1, 24, 2, 64
    for power in (2.0, 1.5):
        q, k, v = (torch.randn(b, n, h, d, dtype=torch.float16, requires_grad=True) for _ in range(3))
        spec = attn.get_variant("diff_threshold").make_spec(power=power)
        attn.attention(q, k, v, spec, causal=True, backend="triton", extra=_second_view(q, k, h)).sum().backward()
    for choice in (threshold_family._DIFF_TIERS, threshold_family._DIFF_BWD_TIERS):
        assert sorted(key[-1] for key in choice.chosen) == [1.5, 2.0]
        assert set(choice.chosen.values()) == {"gluon"}
        assert all(times == {"portable": 2.0, "gluon": 1.0} for times in choice.timings.values())
    assert not threshold_family._TIERS.chosen and not threshold_family._BWD_TIERS.chosen
    report = threshold_family.tuned_configs()
    for name in ("diff_threshold_fwd", "diff_threshold_bwd"):
        rows = [value for key, value in report.items() if key.startswith(f"{name} tier")]
        assert len(rows) == 2 and all(row.startswith("gluon (portable 2.0000 ms, gluon 1.0000 ms") for row in rows)


@pytest.mark.parametrize("variant,launcher", [("threshold", "launch_threshold_backward"),
                                              ("sigmoid", "launch_sigmoid_backward")])
def test_the_weighted_one_pass_form_is_offered_only_where_listed_and_timed_per_key_under_auto(variant, launcher,
                                                                                            gluon_offered,
                                                                                            monkeypatch):
    """The threshold's and sigmoid's Gluon backward: the separate form alone while tiers.WEIGHTED_ONE_PASS_OFFERED
    lacks the family (the sigmoid is listed, the threshold not), whatever ATTNLAB_GLUON_DQ says; once listed,
    "auto" times the separate and the one-pass forms at a key's first backward and keeps the faster, "one_pass" /
    "separate" pin one, and deterministic algorithms keep the separate form."""
    import attn
    from attn.kernels import gluon_weighted_bwd, sigmoid_family, threshold_family

    family = threshold_family if variant == "threshold" else sigmoid_family
    monkeypatch.setattr(gluon_weighted_bwd, "serves", lambda q, k, v: True)
    monkeypatch.setattr(family, "_GLUON_DQ_FORMS", tiers.TimedChoice("dq form"))
    monkeypatch.setattr(family, "_BWD_TIERS", tiers.TierChoice("backward tier"))
    monkeypatch.setenv(tiers.GLUON_ENV, "1")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    log = []

    def fake(q, k, v, dout, *args, one_pass=False, **named):
        log.append("one_pass" if one_pass else "separate")
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(gluon_weighted_bwd, launcher, fake)

    def median_ms(fn):
        before = len(log)
        fn()
        return {"separate": 2.0, "one_pass": 1.0}[log[before]]

    monkeypatch.setattr(runtime, "median_ms", median_ms)
    spec = attn.get_variant(variant).make_spec()

    def backward():
        q, k, v = (torch.randn(1, 24, 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
        attn.attention(q, k, v, spec, causal=True, backend="triton").sum().backward()
        forms = list(log)
        del log[:]
        return forms

    monkeypatch.setattr(tiers, "WEIGHTED_ONE_PASS_OFFERED", frozenset())
    for mode in ("auto", "one_pass"):
        monkeypatch.setenv(tiers.GLUON_DQ_ENV, mode)
        runtime.clear_launch_plans()
        assert backward() == ["separate"]  # not offered
    monkeypatch.setattr(tiers, "WEIGHTED_ONE_PASS_OFFERED", frozenset({variant}))
    monkeypatch.setenv(tiers.GLUON_DQ_ENV, "auto")
    runtime.clear_launch_plans()
    assert backward() == ["separate", "separate", "one_pass", "one_pass", "one_pass"]  # compile, time, serve
    assert list(family._GLUON_DQ_FORMS.chosen.values()) == ["one_pass"]
    assert backward() == ["one_pass"]  # remembered
    torch.use_deterministic_algorithms(True)
    try:
        assert backward() == ["separate"]
    finally:
        torch.use_deterministic_algorithms(False)
    for mode in ("separate", "one_pass"):
        monkeypatch.setenv(tiers.GLUON_DQ_ENV, mode)
        runtime.clear_launch_plans()
        assert backward() == [mode]
