"""The Gluon sm_90 softmax backward (attn/kernels/gluon_softmax_bwd.py), natively on a Hopper GPU (skipped
elsewhere: Gluon has no interpreter; its CPU compile checks are in tests/test_gluon_compile.py).

dq, dk, dv of `gluon_softmax_backward`, fed by the out and lse2 of the portable forward or of the Gluon
forward, against the float64 reference by the DESIGN.md section 6 rule (within 2x the error of the PyTorch
reference run in the kernel's dtype, plus a floor), with torch.empty / empty_like NaN-poisoned so an
element the kernels never write fails: odd lengths (1, 17, 127, 200, 1000), causal and full masks, more
keys than queries under the bottom-right causal mask, GQA, D 64 / 128, bf16 / fp16; then every cap (tanh,
soft_sign, ALSC, caps small enough to bind) and per-row temperatures of every sign, zero included (a strided
one too), with the temperature's gradient (`gluon_softmax_backward_with_dt`) where asked, against the
reference's d-temperature by the same rule. The tests pair each forward with the Gluon backward through an
autograd.Function of their own; tests/test_gluon_gpu.py runs the plain one behind the public function. The
one-pass dQ form (ATTNLAB_GLUON_DQ=one_pass) on plain, capped and tempered cases by the same rule, and against
the separate form. The separate form's persistent kernels (ATTNLAB_GLUON_PERSISTENT=1: a program per SM running
work items in turn) must give the per-item kernels' bits (plain, tanh, ALSC with a temperature and its gradient)
on those cases and on more work items than SMs with a last work-item group of fewer pairs.
"""

from __future__ import annotations

import pytest
import torch

import attn
from attn.kernels import tiers
from attn.testing import outputs_and_grads
from gluon_cases import FLOORS, SHAPES
from tolerance import assert_within_reference_error

CUDA = torch.device("cuda")
# the portable kernels on their first tile config (conftest; a test of the timed tier choice unsets it)
pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() and tiers.gluon_usable(CUDA)),
                                 reason="needs an sm_90 GPU and Triton's Gluon Hopper API"),
              pytest.mark.usefixtures("first_tile_configs")]

# (B, N, KV, H, H_kv, D, causal, dtype): the shared matrix and two more (D = 64 at 1000 rows, fp16; GQA
# with more keys than queries, full mask)
CASES = [*SHAPES, (2, 1000, 1000, 4, 4, 64, True, torch.float16), (1, 200, 1000, 8, 2, 128, False, torch.bfloat16)]


def _portable_forward(q, k, v, temperature, cap, cap_value, knee, sm_scale, causal):
    """(out, lse2) of the portable forward (the Gluon forward switched off for the call)."""
    import os

    from attn.kernels import softmax_family

    old = os.environ.get(tiers.GLUON_ENV)
    os.environ[tiers.GLUON_ENV] = "0"
    try:
        return softmax_family._fwd_impl(q, k, v, None, temperature, cap, cap_value, knee, sm_scale, causal, 0)
    finally:
        if old is None:
            os.environ.pop(tiers.GLUON_ENV)
        else:
            os.environ[tiers.GLUON_ENV] = old


def _gluon_forward(q, k, v, temperature, cap, cap_value, knee, sm_scale, causal):
    """(out, lse2) of the Gluon forward with the launch arguments the softmax family's plan gives it (a bf16
    cap without temperature shifts by its bound)."""
    from attn.kernels.gluon_softmax_fwd import launch_forward
    from attn.kernels.softmax_family import LOG2E, _scalars

    cap_scale, out_scale, _, _, alsc_knee, _ = _scalars(cap, cap_value, knee, sm_scale)
    shift = (cap_value * LOG2E if cap != 0 and temperature is None and q.dtype == torch.bfloat16
             and 2.0 * cap_value * LOG2E <= 100.0 else None)
    return launch_forward(q, k, v, causal, out_scale, cap=cap, cap_scale=cap_scale, alsc_knee=alsc_knee, shift=shift,
                          temperature=temperature)


class _GluonBackwardAttention(torch.autograd.Function):
    """Softmax-family attention whose forward is the portable or the Gluon kernel and whose backward is
    the Gluon backward (the way `_bwd_plan` would call it); logits (cap, cap_value, knee, sm_scale) as
    `softmax_family.fused_attention` passes a spec's; the temperature's gradient when it requires one."""

    @staticmethod
    def forward(ctx, q, k, v, temperature, logits, causal, forward_tier):
        forward = _gluon_forward if forward_tier == "gluon" else _portable_forward
        out, lse2 = forward(q, k, v, temperature, *logits, causal)
        ctx.save_for_backward(q, k, v, out, lse2, temperature)
        ctx.logits, ctx.causal = logits, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        from attn.kernels.gluon_softmax_bwd import gluon_softmax_backward, gluon_softmax_backward_with_dt

        q, k, v, out, lse2, temperature = ctx.saved_tensors
        cap, cap_value, knee, sm_scale = ctx.logits
        caps = dict(cap=cap, cap_value=cap_value, knee=knee)
        if temperature is not None and ctx.needs_input_grad[3]:
            dq, dk, dv, dt = gluon_softmax_backward_with_dt(q, k, v, out, dout, lse2, sm_scale, ctx.causal,
                                                            temperature=temperature, **caps)
        else:
            dq, dk, dv = gluon_softmax_backward(q, k, v, out, dout, lse2, sm_scale, ctx.causal,
                                                temperature=temperature, **caps)
            dt = None
        return dq, dk, dv, dt, None, None, None


def _logits(spec, head_dim):
    from attn.kernels.softmax_family import CAP_IDS

    return CAP_IDS[spec.cap], float(spec.cap_value), float(spec.knee), float(spec.scale(head_dim))


def _inputs(b, n, kv, h, h_kv, d, seed):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    q = torch.randn(b, n, h, d, device=CUDA, dtype=torch.float64, generator=gen)
    k = torch.randn(b, kv, h_kv, d, device=CUDA, dtype=torch.float64, generator=gen)
    v = torch.randn(b, kv, h_kv, d, device=CUDA, dtype=torch.float64, generator=gen)
    do = torch.randn(b, n, h, d, device=CUDA, dtype=torch.float64, generator=gen)
    return {"q": q, "k": k, "v": v}, do


def _case_id(c):
    return f"B{c[0]}-N{c[1]}-KV{c[2]}-H{c[3]}/{c[4]}-D{c[5]}-{'causal' if c[6] else 'full'}-{str(c[7])[6:]}"


def _check(case, forward_tier, seed, variant="softmax", params=None, temperature_kind=None, need_dt=False):
    """Out and grads (and d-temperature with need_dt) against float64 by the rule. temperature_kind: None,
    "rows" (every sign, every seventh zero) or "strided" (the same values, every other element of a wider
    tensor)."""
    b, n, kv, h, h_kv, d, causal, dtype = case
    spec = attn.get_variant(variant).make_spec(**(params or {"sm_scale": d ** -0.5}))
    tensors, do = _inputs(b, n, kv, h, h_kv, d, seed)
    temperature = None
    if temperature_kind is not None:  # every sign, zero included: t z may be any real
        gen = torch.Generator(device=CUDA).manual_seed(seed + 1)
        temperature = torch.rand(b, n, device=CUDA, dtype=torch.float64, generator=gen) * 2.5 - 0.5
        temperature[:, ::7] = 0.0

    def reference(q, k, v, temperature=None):
        return attn.attention(q, k, v, spec, causal=causal, temperature=temperature, backend="reference")

    def fused(q, k, v, temperature=None):
        return _GluonBackwardAttention.apply(q, k, v, temperature, _logits(spec, d), causal, forward_tier)

    def leaves(to_dtype):
        out = {name: t.to(to_dtype).requires_grad_() for name, t in tensors.items()}
        if temperature is not None:
            out["temperature"] = temperature.to(torch.float64 if to_dtype == torch.float64 else torch.float32)
            if temperature_kind == "strided":
                wide = torch.zeros(b, 2 * n, device=CUDA, dtype=out["temperature"].dtype)
                wide[:, ::2] = out["temperature"]
                out["temperature"] = wide[:, ::2]
            out["temperature"].requires_grad_(need_dt)
        return out

    def grads_of(fn, to_dtype):
        inputs = leaves(to_dtype)
        with_grad = {name: t for name, t in inputs.items() if t.requires_grad}
        rest = {name: t for name, t in inputs.items() if not t.requires_grad}
        return outputs_and_grads(lambda **kw: fn(**kw, **rest), with_grad, do)

    ref64 = grads_of(reference, torch.float64)
    same = grads_of(reference, dtype)
    got = grads_of(fused, dtype)
    names = ("out", "dq", "dk", "dv") + (("dtemperature",) if need_dt else ())
    for name in names:
        allowance = FLOORS[dtype] * max(1.0, ref64[name].abs().max().item())
        assert_within_reference_error(name, got[name], same[name], ref64[name], floor=allowance)
    return got


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_gluon_backward_after_the_portable_forward_is_within_the_rule(case, nan_poison):
    _check(case, "portable", seed=CASES.index(case))


@pytest.mark.parametrize("case", CASES[::2], ids=[_case_id(c) for c in CASES[::2]])
def test_gluon_backward_after_the_gluon_forward_is_within_the_rule(case, nan_poison):
    _check(case, "gluon", seed=50 + CASES.index(case))


# (variant, params, temperature kind, need_dt, case): caps small enough to bind, temperatures of every sign;
# odd lengths, GQA, causal and full, KV >= N (the public reference refuses fewer keys than queries)
CAPPED = [
    ("softcap_tanh", {"cap": 2.0}, None, False, (2, 127, 127, 4, 1, 128, True, torch.bfloat16)),
    ("softcap_tanh", {"cap": 5.0}, None, False, (1, 100, 300, 4, 4, 128, True, torch.bfloat16)),
    ("softcap_softsign", {"cap": 2.0}, None, False, (1, 200, 200, 4, 4, 64, False, torch.bfloat16)),
    ("softcap_softsign", {"cap": 4.0}, None, False, (2, 17, 17, 4, 2, 128, False, torch.float16)),
    ("alsc", {"cap": 3.0, "knee": 0.5}, None, False, (1, 1000, 1000, 4, 2, 128, True, torch.bfloat16)),
    ("alsc", {"cap": 2.0, "knee": 0.0}, None, False, (2, 333, 333, 8, 2, 64, True, torch.float16)),
    ("softmax", {}, "rows", False, (1, 257, 600, 2, 1, 64, False, torch.float16)),
    ("softmax", {}, "rows", True, (2, 127, 127, 4, 1, 128, True, torch.bfloat16)),
    ("softmax", {}, "strided", True, (2, 1000, 1000, 4, 4, 64, True, torch.float16)),
    ("softcap_tanh", {"cap": 2.0}, "rows", True, (1, 1000, 1000, 4, 2, 128, True, torch.bfloat16)),
    ("softcap_softsign", {"cap": 3.0}, "rows", True, (1, 200, 1000, 8, 2, 128, False, torch.bfloat16)),
    ("alsc", {"cap": 3.0, "knee": 0.5}, "rows", True, (2, 333, 333, 8, 2, 64, True, torch.float16)),
    ("alsc", {"cap": 3.0, "knee": 0.5}, "strided", False, (1, 1, 1, 2, 2, 64, True, torch.bfloat16)),
    ("alsc", {"cap": 3.0, "knee": 0.5}, "rows", True, (1, 77, 200, 4, 2, 64, False, torch.bfloat16)),
]


def _capped_id(entry):
    variant, params, temperature_kind, need_dt, case = entry
    extra = (f"-{temperature_kind}-temp" if temperature_kind else "") + ("-dt" if need_dt else "")
    return f"{variant}{''.join(f'-{k}{v}' for k, v in params.items())}{extra}-{_case_id(case)}"


@pytest.mark.parametrize("entry", CAPPED, ids=[_capped_id(e) for e in CAPPED])
def test_capped_and_tempered_gluon_backward_after_the_portable_forward_is_within_the_rule(entry, nan_poison):
    variant, params, temperature_kind, need_dt, case = entry
    _check(case, "portable", 200 + CAPPED.index(entry), variant, params, temperature_kind, need_dt)


@pytest.mark.parametrize("entry", CAPPED[::2], ids=[_capped_id(e) for e in CAPPED[::2]])
def test_capped_and_tempered_gluon_backward_after_the_gluon_forward_is_within_the_rule(entry, nan_poison):
    variant, params, temperature_kind, need_dt, case = entry
    _check(case, "gluon", 300 + CAPPED.index(entry), variant, params, temperature_kind, need_dt)


def test_capped_gluon_backward_matches_the_portable_backward(monkeypatch):
    """Tanh cap and a temperature with its gradient: the Gluon and portable backwards agree to a bf16
    rounding or two, and the Gluon one gives the same bits twice."""
    from attn.kernels import softmax_family

    monkeypatch.setenv(tiers.GLUON_ENV, "0")  # the portable kernels for _fwd_impl and _bwd_impl
    from attn.kernels.gluon_softmax_bwd import gluon_softmax_backward_with_dt

    gen = torch.Generator(device=CUDA).manual_seed(6)
    q, do = (torch.randn(2, 700, 8, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 700, 2, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    temperature = torch.rand(2, 700, device=CUDA, generator=gen) * 2.5 - 0.5
    sm_scale, cap, cap_value = 128 ** -0.5, 1, 3.0
    out, lse2 = softmax_family._fwd_impl(q, k, v, None, temperature, cap, cap_value, 0.0, sm_scale, True, 0)
    first = gluon_softmax_backward_with_dt(q, k, v, out, do, lse2, sm_scale, True, temperature=temperature, cap=cap,
                                           cap_value=cap_value)
    second = gluon_softmax_backward_with_dt(q, k, v, out, do, lse2, sm_scale, True, temperature=temperature,
                                            cap=cap, cap_value=cap_value)
    portable = softmax_family._bwd_impl(do, q, k, v, out, lse2, None, temperature, True, cap, cap_value, 0.0,
                                        sm_scale, True, 0)
    for name, a, b, p in zip(("dq", "dk", "dv", "dt"), first, second, portable):
        assert torch.equal(a, b), name
        scale = p.float().abs().max().item()
        assert (a.float() - p.float()).abs().max().item() <= 2e-2 * scale, name


def test_gluon_backward_matches_the_portable_backward_bitwise_repeatably():
    """Two calls give the same bits (no atomics), and the result is close to the portable backward's
    (both within the rule; here a direct comparison at a bf16 rounding or two)."""
    from attn.kernels import softmax_family
    from attn.kernels.gluon_softmax_bwd import gluon_softmax_backward

    gen = torch.Generator(device=CUDA).manual_seed(5)
    q, do = (torch.randn(2, 700, 8, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 700, 2, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    sm_scale = 128 ** -0.5
    out, lse2 = softmax_family._fwd_impl(q, k, v, None, None, 0, 0.0, 0.0, sm_scale, True, 0)
    first = gluon_softmax_backward(q, k, v, out, do, lse2, sm_scale, True)
    second = gluon_softmax_backward(q, k, v, out, do, lse2, sm_scale, True)
    portable = softmax_family._bwd_impl(do, q, k, v, out, lse2, None, None, False, 0, 0.0, 0.0, sm_scale, True, 0)
    for name, a, b, p in zip(("dq", "dk", "dv"), first, second, portable[:3]):
        assert torch.equal(a, b), name
        scale = p.float().abs().max().item()
        assert (a.float() - p.float()).abs().max().item() <= 2e-2 * scale, name


# the one-pass dQ form (ATTNLAB_GLUON_DQ=one_pass): (variant, params, temperature kind, need_dt, case); odd
# lengths, GQA, causal and full, KV > N, a ragged last key block (the K rows past KV the dQ product must not
# see), D 64 / 128; with need_dt the form yields to the separate one
ONE_PASS = [
    ("softmax", {}, None, False, (1, 1, 1, 2, 2, 64, True, torch.bfloat16)),
    ("softmax", {}, None, False, (2, 17, 17, 4, 2, 128, False, torch.float16)),
    ("softmax", {}, None, False, (2, 127, 127, 4, 1, 128, True, torch.bfloat16)),
    ("softmax", {}, None, False, (1, 100, 300, 4, 4, 128, True, torch.bfloat16)),
    ("softmax", {}, None, False, (1, 257, 600, 2, 1, 64, False, torch.float16)),
    ("softmax", {}, None, False, (2, 1000, 1000, 4, 2, 128, True, torch.bfloat16)),
    ("softcap_tanh", {"cap": 2.0}, None, False, (2, 333, 333, 8, 2, 64, True, torch.bfloat16)),
    ("softcap_tanh", {"cap": 5.0}, None, False, (1, 200, 1000, 8, 2, 128, False, torch.bfloat16)),
    ("softcap_softsign", {"cap": 3.0}, None, False, (2, 130, 130, 4, 2, 128, True, torch.float16)),
    ("alsc", {"cap": 3.0, "knee": 0.5}, "rows", False, (1, 1000, 1000, 4, 2, 128, True, torch.bfloat16)),
    ("softmax", {}, "strided", False, (2, 77, 200, 4, 4, 64, False, torch.bfloat16)),
    ("softcap_tanh", {"cap": 2.0}, "rows", True, (1, 300, 300, 4, 2, 128, True, torch.bfloat16)),
]


@pytest.mark.parametrize("entry", ONE_PASS, ids=[_capped_id(e) for e in ONE_PASS])
def test_one_pass_gluon_backward_is_within_the_rule(entry, nan_poison, monkeypatch):
    """ATTNLAB_GLUON_DQ=one_pass: dq from the key-block kernel's TMA reduce-adds (the one-pass launch runs,
    but for d-temperature, which stays on the separate form), within the rule as the separate form is."""
    from attn.kernels import gluon_softmax_bwd

    monkeypatch.setenv(gluon_softmax_bwd.DQ_FORM_ENV, "one_pass")
    calls = []
    launch_one_pass = gluon_softmax_bwd._launch_one_pass

    def counted(*args):
        calls.append(args[0].shape)
        return launch_one_pass(*args)

    monkeypatch.setattr(gluon_softmax_bwd, "_launch_one_pass", counted)
    variant, params, temperature_kind, need_dt, case = entry
    forward_tier = "gluon" if ONE_PASS.index(entry) % 2 else "portable"
    _check(case, forward_tier, 400 + ONE_PASS.index(entry), variant, params, temperature_kind, need_dt)
    assert len(calls) == (0 if need_dt else 1)


def test_one_pass_gluon_backward_matches_the_separate_form(monkeypatch):
    """Tanh cap, GQA, causal, 700 rows: the one-pass form's dq, dk, dv against the separate form's at a bf16
    rounding or two (dk and dv come from the same arithmetic; dq sums its tiles in another order)."""
    from attn.kernels import gluon_softmax_bwd, softmax_family

    monkeypatch.setenv(tiers.GLUON_ENV, "0")  # the portable forward
    gen = torch.Generator(device=CUDA).manual_seed(7)
    q, do = (torch.randn(2, 700, 8, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 700, 2, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    sm_scale, cap, cap_value = 128 ** -0.5, 1, 3.0
    out, lse2 = softmax_family._fwd_impl(q, k, v, None, None, cap, cap_value, 0.0, sm_scale, True, 0)
    monkeypatch.setenv(gluon_softmax_bwd.DQ_FORM_ENV, "separate")
    separate = gluon_softmax_bwd.gluon_softmax_backward(q, k, v, out, do, lse2, sm_scale, True, cap=cap,
                                                         cap_value=cap_value)
    monkeypatch.setenv(gluon_softmax_bwd.DQ_FORM_ENV, "one_pass")
    one_pass = gluon_softmax_bwd.gluon_softmax_backward(q, k, v, out, do, lse2, sm_scale, True, cap=cap,
                                                         cap_value=cap_value)
    for name, a, b in zip(("dq", "dk", "dv"), one_pass, separate):
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * scale, name


# the persistent grids' shapes: CASES and ones with more work items than SMs, a last work-item group of fewer
# (batch, head) pairs than gluon_pipeline.HEADS_PER_WORK_GROUP (B H_kv = 5, 301, 1), rows that see no key (N > KV)
PERSISTENT_CASES = CASES + [
    (16, 1024, 1024, 12, 12, 64, True, torch.bfloat16),
    (3, 777, 777, 5, 5, 128, True, torch.bfloat16),
    (1, 640, 640, 301, 301, 64, False, torch.bfloat16),
    (1, 700, 200, 3, 1, 64, True, torch.float16),
]
# (cap id, cap value, knee, with a temperature and its gradient)
PERSISTENT_FORMS = [(0, 0.0, 0.0, False), (1, 30.0, 0.0, False), (3, 3.0, 0.25, True)]


@pytest.mark.parametrize("cap,cap_value,knee,with_dt", PERSISTENT_FORMS, ids=["plain", "tanh", "alsc-temperature-dt"])
def test_the_persistent_backward_gives_the_per_item_grids_bits(cap, cap_value, knee, with_dt, nan_poison):
    """The separate form's persistent dK / dV and dQ kernels (one program per SM running work items in turn)
    compute each item as the per-item grids do: dq, dk, dv (and d-temperature) equal bit for bit, every element
    written (NaN-poisoned allocations), on PERSISTENT_CASES."""
    from attn.kernels import gluon_softmax_bwd

    for index, case in enumerate(PERSISTENT_CASES):
        b, n, kv, h, h_kv, d, causal, dtype = case
        tensors, do = _inputs(b, n, kv, h, h_kv, d, seed=500 + index)
        q, k, v, do = (t.to(dtype) for t in (tensors["q"], tensors["k"], tensors["v"], do))
        sm_scale = d ** -0.5
        temperature = None
        if with_dt:
            gen = torch.Generator(device=CUDA).manual_seed(index)
            temperature = torch.rand(b, n, device=CUDA, generator=gen) * 2.0 - 0.5
        out, lse2 = _gluon_forward(q, k, v, temperature, cap, cap_value, knee, sm_scale, causal)
        caps = dict(cap=cap, cap_value=cap_value, knee=knee)
        if with_dt:
            def run(persistent):
                return gluon_softmax_bwd.launch_backward_with_dt(q, k, v, out, do, lse2, sm_scale, causal,
                                                                 temperature=temperature, persistent=persistent,
                                                                 **caps)
        else:
            def run(persistent):
                return gluon_softmax_bwd.launch_backward(q, k, v, out, do, lse2, sm_scale, causal, form="separate",
                                                         persistent=persistent, **caps)
        per_item, persistent = run(False), run(True)
        torch.cuda.synchronize()
        for name, ref, got in zip(("dq", "dk", "dv", "dt"), per_item, persistent):
            where = f"cap {cap} {_case_id(case)} {name}"
            assert not got.isnan().any(), f"{where}: an element unwritten (NaN)"
            assert torch.equal(got, ref), f"{where}: the grids' bits differ"


def test_checked_entry_names_what_a_call_misses():
    from attn.kernels.gluon_softmax_bwd import gluon_softmax_backward

    q = torch.randn(1, 64, 2, 64, device=CUDA, dtype=torch.bfloat16)
    k = v = torch.randn(1, 64, 2, 64, device=CUDA, dtype=torch.bfloat16)
    lse2 = torch.zeros(1, 2, 64, device=CUDA)
    with pytest.raises(ValueError, match="lse2"):
        gluon_softmax_backward(q, k, v, q, q, lse2[:, :1], 0.125, True)
    with pytest.raises(ValueError, match="dout"):
        gluon_softmax_backward(q, k, v, q, q.half(), lse2, 0.125, True)
    with pytest.raises(ValueError, match="sm_scale"):
        gluon_softmax_backward(q, k, v, q, q, lse2, 0.0, True)
    with pytest.raises(ValueError, match="head dim"):
        q96 = torch.randn(1, 64, 2, 96, device=CUDA, dtype=torch.bfloat16)
        gluon_softmax_backward(q96, q96, q96, q96, q96, lse2, 0.125, True)
    with pytest.raises(ValueError, match="cap must be"):
        gluon_softmax_backward(q, k, v, q, q, lse2, 0.125, True, cap=4, cap_value=2.0)
    with pytest.raises(ValueError, match="cap_value"):
        gluon_softmax_backward(q, k, v, q, q, lse2, 0.125, True, cap=1, cap_value=0.0)
    with pytest.raises(ValueError, match="knee"):
        gluon_softmax_backward(q, k, v, q, q, lse2, 0.125, True, cap=3, cap_value=2.0, knee=1.0)
    with pytest.raises(ValueError, match="temperature"):
        gluon_softmax_backward(q, k, v, q, q, lse2, 0.125, True, temperature=torch.ones(1, 63, device=CUDA))
    with pytest.raises(ValueError, match="temperature"):
        gluon_softmax_backward(q, k, v, q, q, lse2, 0.125, True,
                               temperature=torch.ones(1, 64, device=CUDA, dtype=torch.int32))


def test_checked_entry_with_dt_needs_a_temperature():
    from attn.kernels.gluon_softmax_bwd import gluon_softmax_backward_with_dt

    q = torch.randn(1, 64, 2, 64, device=CUDA, dtype=torch.bfloat16)
    lse2 = torch.zeros(1, 2, 64, device=CUDA)
    with pytest.raises(ValueError, match="temperature"):
        gluon_softmax_backward_with_dt(q, q, q, q, q, lse2, 0.125, True, temperature=None)
