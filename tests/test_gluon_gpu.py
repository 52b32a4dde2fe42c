"""The Gluon sm_90 forwards behind the public function (attn/kernels/tiers.py), natively on a Hopper GPU
(skipped elsewhere: Gluon has no interpreter; `python3 scripts/gpu_check.py kernels` runs it).

With ATTNLAB_GLUON=1 every softmax-family call that the Gluon kernel serves runs it (a spy on its
launcher proves the call did) and the Gluon backward (a spy on it too): out, dq, dk, dv against the
float64 reference by the DESIGN.md section 6 rule, on odd
lengths, causal and full masks, GQA, more keys than queries, D 64 / 128, bf16 / fp16, with
NaN-poisoned allocations; then every cap (binding caps, with the bound shift and with the online
softmax) and temperatures of every sign. Calls it does not serve (a window, segments, dropout) run the
portable kernel. With ATTNLAB_GLUON=auto the first call of a key times both tiers and remembers the
faster. The threshold and sigmoid forwards and backwards (attn/kernels/gluon_weighted_fwd.py,
gluon_weighted_bwd.py) the same way, spies on both: powers
1, 2 and 1.5 on unit-norm q and k whose thresholds leave dense and empty rows, sigmoid with the
-ln n_i bias and a fixed one. The differential threshold's forward and backward (gluon_diff_fwd.py,
gluon_diff_bwd.py) the same way: out and all six gradients (d-lambda included) on unit-norm q, k, q2, k2
with per-head lambdas of both signs, powers 1, 2 and 1.5; its calls with a window or segments run the
portable kernels; under ATTNLAB_GLUON=auto its first call times both tiers, forward and backward.

The forwards' ping-pong schedule (ATTNLAB_GLUON_SCHEDULE=pingpong: the two consumer warpgroups take turns
at issuing their wgmmas, attn/kernels/gluon_pipeline.py) runs the plain, capped / tempered and threshold /
sigmoid public-call cases as well, and its direct kernel entries must give the unordered schedule's bits
exactly (the same arithmetic, only the wgmma issue order differs) on programs with no key block, one key
block, the ragged and the causal-diagonal blocks, many blocks, GQA, D 64 (3 ring slots) and 128 (2). The
forwards' persistent grid (ATTNLAB_GLUON_PERSISTENT: a program per SM running work items in turn) must give
the per-item grid's bits for every form on those cases and on more work items than SMs with a last work-item
group of fewer pairs; its public calls are within the rule (the threshold and sigmoid calls with their
backwards on the persistent grid too). A mistake in a barrier protocol hangs the GPU:
run these under a `timeout -s KILL`.
"""

from __future__ import annotations

import pytest
import torch

import attn
from attn.kernels import tiers
from attn.testing import outputs_and_grads, rounding_sensitivity
from gluon_diff_cases import draw_inputs
from tolerance import assert_within_reference_error

CUDA = torch.device("cuda")
# the portable kernels on their first tile config (conftest; a test of the timed tier choice unsets it)
pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() and tiers.gluon_usable(CUDA)),
                                 reason="needs an sm_90 GPU and Triton's Gluon Hopper API"),
              pytest.mark.usefixtures("first_tile_configs")]
FLOORS = {torch.float16: 1e-3, torch.bfloat16: 8e-3}
# the Gluon forwards' consumer schedules (ATTNLAB_GLUON_SCHEDULE): the default and the ping-pong
SCHEDULES = ["unordered", "pingpong"]

# (B, N, KV, H, H_kv, D, causal, dtype)
CASES = [
    (1, 1, 1, 2, 2, 64, True, torch.bfloat16),
    (2, 17, 17, 4, 2, 128, False, torch.float16),
    (2, 127, 127, 4, 1, 128, True, torch.bfloat16),
    (1, 200, 200, 4, 4, 64, False, torch.bfloat16),
    (2, 333, 333, 8, 2, 64, True, torch.float16),
    (1, 100, 300, 4, 4, 128, True, torch.bfloat16),
    (1, 257, 600, 2, 1, 64, False, torch.bfloat16),
    (1, 1000, 1000, 4, 2, 128, True, torch.bfloat16),
]


@pytest.fixture
def gluon_launches(monkeypatch):
    """Counts the Gluon forward's launches (the wrapped launcher still runs)."""
    from attn.kernels import gluon_softmax_fwd

    calls = []
    real = gluon_softmax_fwd.launch_forward

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_softmax_fwd, "launch_forward", counted)
    return calls


@pytest.fixture
def gluon_backward_launches(monkeypatch):
    """Counts the Gluon backward's launches (the wrapped launcher still runs)."""
    from attn.kernels import gluon_softmax_bwd

    calls = []
    real = gluon_softmax_bwd.launch_backward

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_softmax_bwd, "launch_backward", counted)
    return calls


def _inputs(b, n, kv, h, h_kv, d, seed):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    q = torch.randn(b, n, h, d, device=CUDA, dtype=torch.float64, generator=gen)
    k = torch.randn(b, kv, h_kv, d, device=CUDA, dtype=torch.float64, generator=gen)
    v = torch.randn(b, kv, h_kv, d, device=CUDA, dtype=torch.float64, generator=gen)
    do = torch.randn(b, n, h, d, device=CUDA, dtype=torch.float64, generator=gen)
    return {"q": q, "k": k, "v": v}, do


def _case_id(c):
    return f"B{c[0]}-N{c[1]}-KV{c[2]}-H{c[3]}/{c[4]}-D{c[5]}-{'causal' if c[6] else 'full'}-{str(c[7])[6:]}"


def _check_on_gluon(case, variant, params, with_temperature, seed):
    """The public call with the Gluon forward forced, out and grads against float64 by the rule."""
    b, n, kv, h, h_kv, d, causal, dtype = case
    spec = attn.get_variant(variant).make_spec(**params)
    tensors, do = _inputs(b, n, kv, h, h_kv, d, seed=seed)
    temperature = None
    if with_temperature:  # every sign, zero included: t z may be any real
        gen = torch.Generator(device=CUDA).manual_seed(seed + 1)
        temperature = torch.rand(b, n, device=CUDA, dtype=torch.float64, generator=gen) * 2.5 - 0.5
        temperature[:, ::7] = 0.0

    def call(backend, t):
        return lambda q, k, v: attn.attention(q, k, v, spec, causal=causal, temperature=t, backend=backend)

    ref64 = outputs_and_grads(call("reference", temperature),
                              {name: t.clone().requires_grad_() for name, t in tensors.items()}, do)
    low_t = None if temperature is None else temperature.float()
    low = {name: t.to(dtype).requires_grad_() for name, t in tensors.items()}
    same = outputs_and_grads(call("reference", low_t),
                             {name: t.detach().clone().requires_grad_() for name, t in low.items()}, do)
    fused = outputs_and_grads(call("triton", low_t), low, do)
    for name in ("out", "dq", "dk", "dv"):
        allowance = FLOORS[dtype] * max(1.0, ref64[name].abs().max().item())
        assert_within_reference_error(name, fused[name], same[name], ref64[name], floor=allowance)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_public_call_on_the_gluon_forward_is_within_the_rule(case, schedule, gluon_launches, gluon_backward_launches,
                                                             monkeypatch, nan_poison):
    monkeypatch.setenv(tiers.GLUON_ENV, "1")
    monkeypatch.setenv(tiers.GLUON_SCHEDULE_ENV, schedule)
    _check_on_gluon(case, "softmax", {}, False, seed=CASES.index(case))
    assert gluon_launches, "the call did not run the Gluon forward"
    assert gluon_backward_launches, "the call did not run the Gluon backward"


# (variant, params, temperature, case): caps small enough to bind; bf16 caps up to c = 34 take the bound
# shift, larger caps, fp16 and temperatures the online softmax
CAPPED = [
    ("softcap_tanh", {"cap": 2.0}, False, CASES[2]),
    ("softcap_tanh", {"cap": 50.0}, False, CASES[5]),
    ("softcap_tanh", {"cap": 3.0}, False, CASES[4]),
    ("softcap_softsign", {"cap": 2.0}, False, CASES[3]),
    ("softcap_softsign", {"cap": 4.0}, False, CASES[1]),
    ("alsc", {"cap": 3.0, "knee": 0.5}, False, CASES[7]),
    ("alsc", {"cap": 2.0, "knee": 0.0}, False, CASES[6]),
    ("alsc", {"cap": 3.0, "knee": 0.5}, True, CASES[2]),
    ("softmax", {}, True, CASES[7]),
    ("softmax", {}, True, CASES[4]),
    ("softcap_tanh", {"cap": 2.0}, True, CASES[5]),
]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("variant,params,with_temperature,case", CAPPED,
                         ids=[f"{v}-{p}-{'temp-' if t else ''}{_case_id(c)}" for v, p, t, c in CAPPED])
def test_capped_and_tempered_calls_on_the_gluon_kernels_are_within_the_rule(variant, params, with_temperature, case,
                                                                            schedule, gluon_launches,
                                                                            gluon_backward_launches, monkeypatch,
                                                                            nan_poison):
    monkeypatch.setenv(tiers.GLUON_ENV, "1")
    monkeypatch.setenv(tiers.GLUON_SCHEDULE_ENV, schedule)
    _check_on_gluon(case, variant, params, with_temperature, seed=100 + CAPPED.index((variant, params,
                                                                                       with_temperature, case)))
    assert gluon_launches, "the call did not run the Gluon forward"
    assert gluon_backward_launches, "the call did not run the Gluon backward"


EXP2_FORMS = [("poly", "softcap_tanh", {"cap": 2.0}, CASES[2]), ("half", "softcap_tanh", {"cap": 2.0}, CASES[7]),
              ("half", "softmax", {}, CASES[4]), ("poly", "alsc", {"cap": 3.0, "knee": 0.5}, CASES[1])]


@pytest.mark.parametrize("form,variant,params,case", EXP2_FORMS,
                         ids=[f"{f}-{v}-{_case_id(c)}" for f, v, _, c in EXP2_FORMS])
def test_polynomial_exp2_forms_are_within_the_rule(form, variant, params, case, gluon_launches, monkeypatch, nan_poison):
    """ATTNLAB_GLUON_EXP2=poly / half (exp2 on the FMA pipes for all / half the scores of unmasked
    blocks) through the public function, out and grads against float64 by the rule."""
    monkeypatch.setenv(tiers.GLUON_ENV, "1")
    monkeypatch.setenv(tiers.GLUON_EXP2_ENV, form)
    _check_on_gluon(case, variant, params, False, seed=300 + EXP2_FORMS.index((form, variant, params, case)))
    assert gluon_launches, "the call did not run the Gluon forward"


@pytest.mark.parametrize("fixed_shift", ["1", "0"])
def test_the_bound_shift_and_the_online_softmax_agree(fixed_shift, monkeypatch):
    """A binding tanh cap in bf16 through both forms of the Gluon forward gives the same output (to a
    bf16 rounding or two) and logsumexp as the portable kernel."""
    from attn.kernels import softmax_family as sf

    monkeypatch.setenv("ATTNLAB_FIXED_SHIFT", fixed_shift)
    gen = torch.Generator(device=CUDA).manual_seed(7)
    q, k, v = (torch.randn(2, 700, 4, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) * 2 for _ in range(3))
    outs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(tiers.GLUON_ENV, mode)
        outs[mode] = sf._fwd_impl(q, k, v, None, None, 1, 5.0, 0.0, 128 ** -0.5, True, 0)
    gluon_out, portable_out = outs["1"][0].float(), outs["0"][0].float()
    assert ((gluon_out - portable_out).abs() <= 2e-2 + 2 ** -6 * portable_out.abs()).all()
    assert torch.allclose(outs["1"][1], outs["0"][1], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("options", [dict(window=64), dict(segments=True), dict(name="softcap_tanh", window=32)],
                         ids=["window", "segments", "cap-window"])
def test_calls_the_gluon_forward_does_not_serve_run_the_portable_kernel(options, gluon_launches, monkeypatch):
    monkeypatch.setenv(tiers.GLUON_ENV, "1")
    spec = attn.get_variant(options.get("name", "softmax")).make_spec()
    q, k, v = (torch.randn(2, 256, 4, 64, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    segment_ids = None
    if options.get("segments"):  # 200 history tokens, 56 candidates
        segment_ids = torch.ones(2, 256, dtype=torch.int32, device=CUDA)
        segment_ids[:, 200:] = -1
    kwargs = dict(causal=True, window=options.get("window"), segment_ids=segment_ids)
    out = attn.attention(q, k, v, spec, backend="triton", **kwargs)
    ref = attn.attention(q.double(), k.double(), v.double(), spec, backend="reference", **kwargs)
    assert not gluon_launches
    assert (out.double() - ref).abs().max().item() < 0.05


def test_auto_times_both_tiers_once_per_key_and_keeps_the_faster(gluon_launches, monkeypatch):
    from attn.kernels import softmax_family as sf

    monkeypatch.setenv(tiers.GLUON_ENV, "auto")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    monkeypatch.setattr(sf, "_TIERS", tiers.TierChoice("softmax_family_fwd"))
    spec = attn.get_variant("softmax").make_spec()
    q, k, v = (torch.randn(2, 2048, 8, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    first = attn.attention(q, k, v, spec, causal=True, backend="triton")
    (key, timings), = sf._TIERS.timings.items()
    assert set(timings) == {"portable", "gluon"} and all(ms > 0 for ms in timings.values())
    chosen = sf._TIERS.chosen[key]
    assert chosen == min(timings, key=timings.get)
    launches = len(gluon_launches)
    second = attn.attention(q, k, v, spec, causal=True, backend="triton")
    assert len(sf._TIERS.timings) == 1  # timed once
    assert len(gluon_launches) == launches + (chosen == "gluon")
    assert torch.allclose(first.float(), second.float(), atol=2e-2, rtol=0)


@pytest.fixture
def weighted_launches(monkeypatch):
    """Names the threshold / sigmoid / differential threshold Gluon forwards' and backwards' launches (the
    wrapped launchers still run)."""
    from attn.kernels import gluon_diff_bwd, gluon_diff_fwd, gluon_weighted_bwd, gluon_weighted_fwd

    calls = []
    for module, name in ((gluon_weighted_fwd, "launch_threshold"), (gluon_weighted_fwd, "launch_sigmoid"),
                         (gluon_weighted_bwd, "launch_threshold_backward"),
                         (gluon_weighted_bwd, "launch_sigmoid_backward"),
                         (gluon_diff_fwd, "launch_diff_threshold"),
                         (gluon_diff_bwd, "launch_diff_threshold_backward")):
        real = getattr(module, name)

        def counted(*args, real=real, name=name, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def _check_weighted_on_gluon(case, variant, params, seed, unit_norm):
    b, n, kv, h, h_kv, d, causal, dtype = case
    spec = attn.get_variant(variant).make_spec(**params)
    tensors, do = _inputs(b, n, kv, h, h_kv, d, seed=seed)
    if unit_norm:  # cosine scores, as the threshold model feeds them: thresholds that bind
        tensors = {name: (t / t.norm(dim=-1, keepdim=True) if name in "qk" else t) for name, t in tensors.items()}

    def call(backend):
        return lambda q, k, v: attn.attention(q, k, v, spec, causal=causal, backend=backend)

    ref64 = outputs_and_grads(call("reference"), {name: t.clone().requires_grad_() for name, t in tensors.items()}, do)
    low = {name: t.to(dtype).requires_grad_() for name, t in tensors.items()}
    same = outputs_and_grads(call("reference"), {name: t.detach().clone().requires_grad_() for name, t in low.items()},
                             do)
    fused = outputs_and_grads(call("triton"), low, do)
    for name in ("out", "dq", "dk", "dv"):
        allowance = FLOORS[dtype] * max(1.0, ref64[name].abs().max().item())
        assert_within_reference_error(name, fused[name], same[name], ref64[name], floor=allowance)
    return ref64["out"]


WEIGHTED = [
    ("threshold", {}, CASES[0]),
    ("threshold", {}, CASES[2]),
    ("threshold", {"power": 1.0}, CASES[1]),
    ("threshold", {"power": 1.5, "beta": 0.5}, CASES[4]),
    ("threshold", {"beta": 2.0}, CASES[5]),
    ("threshold", {}, CASES[6]),
    ("threshold", {}, CASES[7]),
    ("sigmoid", {}, CASES[0]),
    ("sigmoid", {}, CASES[3]),
    ("sigmoid", {}, CASES[4]),
    ("sigmoid", {"bias": -2.0}, CASES[5]),
    ("sigmoid", {}, CASES[6]),
    ("sigmoid", {}, CASES[7]),
]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("variant,params,case", WEIGHTED, ids=[f"{v}-{p}-{_case_id(c)}" for v, p, c in WEIGHTED])
def test_threshold_and_sigmoid_calls_on_the_gluon_kernels_are_within_the_rule(variant, params, case, schedule,
                                                                              weighted_launches, monkeypatch,
                                                                              nan_poison):
    monkeypatch.setenv(tiers.GLUON_ENV, "1")
    monkeypatch.setenv(tiers.GLUON_SCHEDULE_ENV, schedule)
    out = _check_weighted_on_gluon(case, variant, params, seed=200 + WEIGHTED.index((variant, params, case)),
                                   unit_norm=variant == "threshold")
    assert f"launch_{variant}" in weighted_launches, "the call did not run the Gluon forward"
    assert f"launch_{variant}_backward" in weighted_launches, "the call did not run the Gluon backward"
    if variant == "threshold" and case[1] > 100:  # the thresholds leave some rows empty and others not
        row_norms = out.norm(dim=-1)
        assert (row_norms == 0).any() and (row_norms > 0).any()


@pytest.mark.parametrize("variant,params,case", WEIGHTED, ids=[f"{v}-{p}-{_case_id(c)}" for v, p, c in WEIGHTED])
def test_threshold_and_sigmoid_calls_on_the_persistent_grids_are_within_the_rule(variant, params, case,
                                                                                 weighted_launches, monkeypatch,
                                                                                 nan_poison):
    """ATTNLAB_GLUON_PERSISTENT=1: the threshold and sigmoid Gluon forwards and backwards on their persistent
    grids through attn.attention, out and gradients within the float64 rule (the persistent backwards offered
    whether or not the plans offer them by default)."""
    monkeypatch.setenv(tiers.GLUON_ENV, "1")
    monkeypatch.setenv(tiers.GLUON_PERSISTENT_ENV, "1")
    monkeypatch.setattr(tiers, "PERSISTENT_BACKWARDS_OFFERED", frozenset({"softmax", "threshold", "sigmoid"}))
    _check_weighted_on_gluon(case, variant, params, seed=300 + WEIGHTED.index((variant, params, case)),
                             unit_norm=variant == "threshold")
    assert f"launch_{variant}" in weighted_launches, "the call did not run the Gluon forward"
    assert f"launch_{variant}_backward" in weighted_launches, "the call did not run the Gluon backward"


DIFF_GRADIENTS = ("dq", "dk", "dv", "dq2", "dk2", "dlam")


def _diff_inputs(case, seed):
    """The differential threshold's shared draw (`gluon_diff_cases.draw_inputs`) with lambda among the
    tensors, and the cotangent."""
    tensors, lam, gen = draw_inputs(case, seed)
    b, n, _, h, _, d = case[:6]
    do = torch.randn(b, n, h, d, device=CUDA, dtype=torch.float64, generator=gen)
    return {**tensors, "lam": lam}, do


def _diff_leaves(tensors, dtype):
    """Leaf copies in dtype; lambda in fp32 beside 16-bit views, as a model keeps it."""
    return {name: t.to(torch.float32 if name == "lam" and dtype != torch.float64 else dtype).requires_grad_()
            for name, t in tensors.items()}


def _check_diff_on_gluon(case, params, seed):
    """The public differential threshold call, out and all six gradients against float64 by the rule, with a
    floor that also holds what one rounding of the inputs moves the exact result by (relu(x)^(p-1) jumps at
    tau for p = 1; d-lambda sums N x KV terms), as tests/test_gluon_diff_bwd_gpu.py does."""
    b, n, kv, h, h_kv, d, causal, dtype = case
    spec = attn.get_variant("diff_threshold").make_spec(**params)
    tensors, do = _diff_inputs(case, seed)

    def call(backend):
        return lambda q, k, v, q2, k2, lam: attn.attention(q, k, v, spec, causal=causal, backend=backend,
                                                          extra={"q2": q2, "k2": k2, "lam": lam})

    ref64 = outputs_and_grads(call("reference"), _diff_leaves(tensors, torch.float64), do)
    same = outputs_and_grads(call("reference"), _diff_leaves(tensors, dtype), do)
    fused = outputs_and_grads(call("triton"), _diff_leaves(tensors, dtype), do)
    sensitivity = rounding_sensitivity(call("reference"), tensors, do, dtype)
    for name in ("out", *DIFF_GRADIENTS):
        expected_dtype = torch.float32 if name == "dlam" else dtype  # d-lambda in lambda's dtype
        assert fused[name].dtype == expected_dtype and fused[name].shape == ref64[name].shape, name
        allowance = FLOORS[dtype] * max(1.0, ref64[name].abs().max().item()) + sensitivity[name]
        assert_within_reference_error(name, fused[name], same[name], ref64[name], floor=allowance)
    return ref64["out"]


DIFF = [
    ({}, CASES[0]),
    ({}, CASES[2]),
    ({"power": 1.0}, CASES[1]),
    ({"power": 1.0}, CASES[3]),
    ({"power": 1.5, "beta": 0.5}, CASES[4]),
    ({"power": 1.5}, CASES[6]),
    ({"beta": 0.25}, CASES[5]),
    ({}, CASES[7]),
]


@pytest.mark.parametrize("params,case", DIFF, ids=[f"diff-{p}-{_case_id(c)}" for p, c in DIFF])
def test_differential_threshold_calls_on_the_gluon_kernels_are_within_the_rule(params, case, weighted_launches,
                                                                                monkeypatch, nan_poison):
    monkeypatch.setenv(tiers.GLUON_ENV, "1")
    out = _check_diff_on_gluon(case, params, seed=400 + DIFF.index((params, case)))
    assert "launch_diff_threshold" in weighted_launches, "the call did not run the Gluon forward"
    assert "launch_diff_threshold_backward" in weighted_launches, "the call did not run the Gluon backward"
    if case[1] > 100 and params.get("beta", 1.0) == 1.0:  # the thresholds leave some rows empty and others not
        row_norms = out.norm(dim=-1)
        assert (row_norms == 0).any() and (row_norms > 0).any()


@pytest.mark.parametrize("options", [dict(window=64), dict(segments=True)], ids=["window", "segments"])
def test_a_differential_call_with_a_window_or_segments_runs_the_portable_kernels(options, weighted_launches,
                                                                                  monkeypatch):
    monkeypatch.setenv(tiers.GLUON_ENV, "1")
    spec = attn.get_variant("diff_threshold").make_spec()
    gen = torch.Generator(device=CUDA).manual_seed(11)
    q, k, v, q2, k2 = (torch.nn.functional.normalize(torch.randn(2, 256, 4, 64, device=CUDA, generator=gen),
                                                     dim=-1).to(torch.bfloat16).requires_grad_() for _ in range(5))
    lam = torch.tensor([0.5, -0.25, 0.8, 0.1], device=CUDA, requires_grad=True)
    segment_ids = None
    if options.get("segments"):  # 200 history tokens, 56 candidates
        segment_ids = torch.ones(2, 256, dtype=torch.int32, device=CUDA)
        segment_ids[:, 200:] = -1
    kwargs = dict(causal=True, window=options.get("window"), segment_ids=segment_ids)
    out = attn.attention(q, k, v, spec, backend="triton", extra={"q2": q2, "k2": k2, "lam": lam}, **kwargs)
    out.float().sum().backward()
    assert not weighted_launches
    wide = {name: t.detach().double().requires_grad_() for name, t in (("q", q), ("k", k), ("v", v), ("q2", q2),
                                                                       ("k2", k2), ("lam", lam))}
    ref = attn.attention(wide["q"], wide["k"], wide["v"], spec, backend="reference",
                         extra={name: wide[name] for name in ("q2", "k2", "lam")}, **kwargs)
    ref.sum().backward()
    assert (out.double() - ref).abs().max().item() < 0.05
    for name, t in (("v", v), ("lam", lam)):
        scale = max(1.0, wide[name].grad.abs().max().item())
        assert (t.grad.double() - wide[name].grad).abs().max().item() < 0.05 * scale, name


def test_auto_times_the_differential_tiers_once_per_key_and_keeps_the_faster(monkeypatch):
    from attn.kernels import threshold_family as tf

    monkeypatch.setenv(tiers.GLUON_ENV, "auto")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    for name in ("_DIFF_TIERS", "_DIFF_BWD_TIERS"):
        monkeypatch.setattr(tf, name, tiers.TierChoice(getattr(tf, name).name))
    spec = attn.get_variant("diff_threshold").make_spec(power=1.5)
    gen = torch.Generator(device=CUDA).manual_seed(5)
    q, k, v, q2, k2 = (torch.nn.functional.normalize(torch.randn(2, 2048, 8, 128, device=CUDA, generator=gen),
                                                     dim=-1).to(torch.bfloat16).requires_grad_() for _ in range(5))
    extra = {"q2": q2, "k2": k2, "lam": torch.linspace(-0.5, 1.0, 8, device=CUDA, requires_grad=True)}
    outs = []
    for _ in range(2):
        out = attn.attention(q, k, v, spec, causal=True, backend="triton", extra=extra)
        out.float().sum().backward()
        outs.append(out.detach())
    for choice in (tf._DIFF_TIERS, tf._DIFF_BWD_TIERS):
        (key, timings), = choice.timings.items()  # timed once: the second call reused the choice
        assert key[-1] == 1.5  # the power is part of the key
        assert set(timings) == {"portable", "gluon"} and all(ms > 0 for ms in timings.values())
        assert choice.chosen[key] == min(timings, key=timings.get)
    assert torch.allclose(outs[0].float(), outs[1].float(), atol=2e-2, rtol=0)


# the direct entries in both schedules: (B, N, KV, H, H_kv, D, causal, dtype). Causal programs see 0 key
# blocks (N > KV: rows before N - KV see none), 1 (N <= 128), the ragged last block, the diagonal and
# many unmasked blocks; both warpgroups of a program always run the program's block count.
SCHEDULE_CASES = [
    (1, 1, 1, 2, 2, 64, True, torch.bfloat16),
    (2, 17, 17, 4, 2, 128, False, torch.float16),
    (1, 64, 64, 2, 2, 128, True, torch.bfloat16),
    (2, 127, 127, 4, 1, 128, True, torch.bfloat16),
    (1, 300, 100, 2, 2, 64, True, torch.bfloat16),
    (1, 300, 100, 2, 2, 128, True, torch.bfloat16),
    (1, 100, 300, 4, 4, 128, True, torch.bfloat16),
    (2, 333, 333, 8, 2, 64, True, torch.float16),
    (1, 257, 600, 2, 1, 64, False, torch.bfloat16),
    (1, 1000, 1000, 4, 2, 128, True, torch.bfloat16),
    (2, 4096, 4096, 4, 4, 128, True, torch.bfloat16),
    (1, 2048, 2048, 4, 4, 64, False, torch.bfloat16),
]
# (name, form): the softmax family's cap (softmax_family._scalars' conventions for a cap c; ALSC's knee
# fraction 0.5), its bound shift or the online softmax, a temperature; or the threshold / sigmoid weight
SCHEDULE_FORMS = [
    ("softmax", dict(cap=0)),
    ("tanh bound shift", dict(cap=1, c=2.0, shift=True)),
    ("tanh online", dict(cap=1, c=3.0)),
    ("soft_sign bound shift", dict(cap=2, c=4.0, shift=True)),
    ("alsc bound shift", dict(cap=3, c=3.0, shift=True)),
    ("softmax temperature", dict(cap=0, temperature=True)),
    ("threshold p=2", dict(weight="threshold", power=2.0)),
    ("threshold p=1.5", dict(weight="threshold", power=1.5)),
    ("sigmoid", dict(weight="sigmoid")),
]
LOG2E = 1.4426950408889634


def _direct_forward(form: dict, q, k, v, causal: bool, pingpong: bool, persistent: bool = False):
    """(out, lse2 or None) of a Gluon forward's direct entry with the given schedule (and for the softmax
    family, grid)."""
    from attn.kernels import gluon_softmax_fwd, gluon_weighted_fwd

    sm_scale = q.shape[-1] ** -0.5
    if form.get("weight") == "threshold":  # unit-norm q and k: cosine scores, thresholds that bind
        qn, kn = (torch.nn.functional.normalize(t.float(), dim=-1).to(t.dtype) for t in (q, k))
        return gluon_weighted_fwd.launch_threshold(qn, kn, v, causal, 1.0, form["power"], pingpong=pingpong,
                                                   persistent=persistent), None
    if form.get("weight") == "sigmoid":
        return gluon_weighted_fwd.launch_sigmoid(q, k, v, causal, sm_scale, None, pingpong=pingpong,
                                                 persistent=persistent), None
    cap = form["cap"]
    if cap == 0:
        row_scale, cap_scale, knee = sm_scale * LOG2E, 1.0, 0.0
    else:  # logits capped in units of g = c (tanh, soft_sign) or c - a (ALSC, a = c / 2)
        c = form["c"]
        g = c / 2 if cap == 3 else c
        row_scale, cap_scale, knee = g * LOG2E, sm_scale / g, (c - g) / g
    temperature = None
    if form.get("temperature"):  # every sign and zero
        gen = torch.Generator(device=CUDA).manual_seed(5)
        temperature = torch.rand(q.shape[0], q.shape[1], device=CUDA, generator=gen) * 2.5 - 0.5
    return gluon_softmax_fwd.launch_forward(q, k, v, causal, row_scale, cap=cap, cap_scale=cap_scale, alsc_knee=knee,
                                            shift=form["c"] * LOG2E if form.get("shift") else None,
                                            temperature=temperature, pingpong=pingpong, persistent=persistent)


def _form_cases(cases: list, form: dict):
    """(case, (q, k, v, causal)) per case of `cases` that the form serves (the bound shift serves bf16 P, the
    launch plans' rule), its tensors drawn from a generator seeded by the case's index."""
    for index, case in enumerate(cases):
        b, n, kv, h, h_kv, d, causal, dtype = case
        if form.get("shift") and dtype != torch.bfloat16:
            continue
        gen = torch.Generator(device=CUDA).manual_seed(index)
        q = torch.randn(b, n, h, d, device=CUDA, generator=gen).to(dtype)
        k, v = (torch.randn(b, kv, h_kv, d, device=CUDA, generator=gen).to(dtype) for _ in range(2))
        yield case, (q, k, v, causal)


@pytest.mark.parametrize("name,form", SCHEDULE_FORMS, ids=[name for name, _ in SCHEDULE_FORMS])
def test_the_pingpong_schedule_gives_the_unordered_schedules_bits(name, form, nan_poison):
    """Every form's direct entry on every SCHEDULE_CASES shape: the ping-pong schedule's out (and lse2)
    equal the unordered schedule's bit for bit, with every element written (NaN-poisoned allocations),
    and a repeated ping-pong launch gives the same bits again."""
    for case, (q, k, v, causal) in _form_cases(SCHEDULE_CASES, form):
        unordered = _direct_forward(form, q, k, v, causal, False)
        pingpong = _direct_forward(form, q, k, v, causal, True)
        again = _direct_forward(form, q, k, v, causal, True)
        torch.cuda.synchronize()
        for what, ref, got, repeat in zip(("out", "lse2"), unordered, pingpong, again):
            if ref is None:
                continue
            where = f"{name} {_case_id(case)} {what}"
            assert not ref.isnan().any() and not got.isnan().any(), f"{where}: an element unwritten (NaN)"
            assert torch.equal(got, ref), f"{where}: the schedules' bits differ"
            assert torch.equal(repeat, got), f"{where}: repeated ping-pong launches differ"


# the persistent grid's cases: SCHEDULE_CASES and shapes with more work items than SMs, a last work-item
# group of fewer (batch, head) pairs than gluon_pipeline.HEADS_PER_WORK_GROUP (B H = 15, 301, 3), rows that see
# no key (N > KV)
PERSISTENT_CASES = SCHEDULE_CASES + [
    (16, 1024, 1024, 12, 12, 64, True, torch.bfloat16),
    (3, 777, 777, 5, 5, 128, True, torch.bfloat16),
    (1, 640, 640, 301, 301, 64, False, torch.bfloat16),
    (1, 700, 200, 3, 1, 64, True, torch.float16),
]


@pytest.mark.parametrize("name,form", SCHEDULE_FORMS, ids=[name for name, _ in SCHEDULE_FORMS])
def test_the_persistent_forward_gives_the_per_item_grids_bits(name, form, nan_poison):
    """Every form's persistent forward (one program per SM running work items in turn) computes each item as
    the per-item grid does: out (and the softmax family's lse2) equal bit for bit, every element written
    (NaN-poisoned allocations), on PERSISTENT_CASES."""
    for case, (q, k, v, causal) in _form_cases(PERSISTENT_CASES, form):
        per_item = _direct_forward(form, q, k, v, causal, False)
        persistent = _direct_forward(form, q, k, v, causal, False, persistent=True)
        torch.cuda.synchronize()
        for what, ref, got in zip(("out", "lse2"), per_item, persistent):
            if ref is None:
                continue
            where = f"{name} {_case_id(case)} {what}"
            assert not got.isnan().any(), f"{where}: an element unwritten (NaN)"
            assert torch.equal(got, ref), f"{where}: the grids' bits differ"


@pytest.mark.parametrize("case", CASES[:6], ids=[_case_id(c) for c in CASES[:6]])
def test_public_call_on_the_persistent_grids_is_within_the_rule(case, gluon_launches, monkeypatch, nan_poison):
    """The softmax family through attn.attention on the persistent grids (ATTNLAB_GLUON_PERSISTENT=1, the
    persistent backward offered whether or not the plans offer it by default): out and gradients within the
    float64 rule."""
    monkeypatch.setenv(tiers.GLUON_ENV, "1")
    monkeypatch.setenv(tiers.GLUON_PERSISTENT_ENV, "1")
    monkeypatch.setattr(tiers, "PERSISTENT_BACKWARDS_OFFERED", frozenset({"softmax", "threshold", "sigmoid"}))
    _check_on_gluon(case, "softcap_tanh", {"cap": 3.0}, False, seed=CASES.index(case))
    assert gluon_launches, "the call did not run the Gluon forward"
