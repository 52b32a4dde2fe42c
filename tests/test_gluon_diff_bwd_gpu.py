"""The Gluon sm_90 differential threshold backward (attn/kernels/gluon_diff_bwd.py), natively on a Hopper GPU
(skipped elsewhere: Gluon has no interpreter; its CPU compile checks are in tests/test_gluon_compile.py).

All six gradients (dq, dk, dv, dq2, dk2, d-lambda) of `gluon_diff_threshold_backward` after the portable or the
Gluon differential forward, against the float64 reference by the DESIGN.md section 6 rule (within 2x the error
of the PyTorch reference run in the kernel's dtype, plus a floor that also holds what one rounding of the inputs
moves the exact result by, as tests/test_threshold_kernels.py does: relu(x)^(p-1) jumps at tau for p = 1, and
d-lambda sums N x KV terms), with torch.empty / empty_like NaN-poisoned so an element the kernels never write
fails: odd lengths, causal and full masks, more keys than queries (bottom-right causal), GQA, D 64 / 128,
bf16 / fp16, p = 1, 2, 1.5 and 3, per-head lambdas of both signs (fp32, the parameter's dtype) on unit-norm q,
k, q2, k2 whose thresholds leave dense and empty rows. Then: two calls give the same bits and are close to the
portable differential backward; lambda in another dtype or with a stride gives the bits of its fp32 copy
(d-lambda in lambda's dtype); the checked entry names what a call misses. The tests call the backward through an
autograd.Function of their own; its calls through the public function are tests/test_gluon_gpu.py's.
"""

from __future__ import annotations

import pytest
import torch

import attn
from attn.kernels import tiers
from attn.testing import outputs_and_grads, rounding_sensitivity
from gluon_cases import FLOORS
from gluon_diff_cases import (CASES, PERSISTENT_SHAPES, case_id, draw_inputs,  # noqa: F401
                             portable_plans)  # (autouse fixture)
from tolerance import assert_within_reference_error

CUDA = torch.device("cuda")
# the portable kernels on their first tile config (conftest)
pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() and tiers.gluon_usable(CUDA)),
                                 reason="needs an sm_90 GPU and Triton's Gluon Hopper API"),
              pytest.mark.usefixtures("first_tile_configs")]


GRADIENTS = ("dq", "dk", "dv", "dq2", "dk2", "dlam")


class _GluonDiffBackward(torch.autograd.Function):
    """Differential threshold attention whose forward is the portable or the Gluon kernel and whose backward is
    the Gluon backward (as the family's backward plan calls it)."""

    @staticmethod
    def forward(ctx, q, k, v, q2, k2, lam, spec, causal, forward_tier, dkdv_form="key_halves", fused_query_rows=None,
                dq_form="rows", one_pass=False):
        from attn.kernels import gluon_diff_fwd, threshold_family

        beta, power = float(spec.beta), float(spec.power)
        if forward_tier == "portable":
            out = threshold_family._forward_impl(q, k, v, q2, k2, lam, None, beta, power, causal, 0)
        else:
            out = gluon_diff_fwd.gluon_diff_threshold_forward(q, k, v, q2, k2, lam, causal, beta, power)
        ctx.save_for_backward(q, k, v, q2, k2, lam)
        ctx.spec, ctx.causal, ctx.dkdv_form, ctx.fused_query_rows = spec, causal, dkdv_form, fused_query_rows
        ctx.dq_form, ctx.one_pass = dq_form, one_pass
        return out

    @staticmethod
    def backward(ctx, dout):
        from attn.kernels.gluon_diff_bwd import gluon_diff_threshold_backward

        q, k, v, q2, k2, lam = ctx.saved_tensors
        spec = ctx.spec
        dq, dk, dv, dq2, dk2, dlam = gluon_diff_threshold_backward(
            q, k, v, q2, k2, lam, dout.contiguous(), ctx.causal, float(spec.beta), float(spec.power),
            dkdv_form=ctx.dkdv_form, fused_query_rows=ctx.fused_query_rows, dq_form=ctx.dq_form,
            one_pass=ctx.one_pass)
        return dq, dk, dv, dq2, dk2, dlam, None, None, None, None, None, None, None


def _inputs(shape, seed):
    """The shared draw (`gluon_diff_cases.draw_inputs`) with lambda among the tensors, and the cotangent."""
    tensors, lam, gen = draw_inputs(shape, seed)
    b, n, _, h, _, d = shape[:6]
    do = torch.randn(b, n, h, d, device=CUDA, dtype=torch.float64, generator=gen)
    return {**tensors, "lam": lam}, do


def _leaves(tensors, dtype):
    """Leaf copies in dtype; lam stays fp32 for 16-bit runs, as a model keeps it."""
    return {name: t.to(torch.float32 if name == "lam" and dtype != torch.float64 else dtype).requires_grad_()
            for name, t in tensors.items()}


def _check(case, forward_tier, seed, dkdv_form="key_halves", fused_query_rows=None, dq_form="rows", one_pass=False):
    params, shape = case
    causal, dtype = shape[6], shape[7]
    spec = attn.get_variant("diff_threshold").make_spec(**params)
    tensors, do = _inputs(shape, seed)

    def reference(q, k, v, q2, k2, lam):
        return attn.attention(q, k, v, spec, causal=causal, backend="reference",
                              extra={"q2": q2, "k2": k2, "lam": lam})

    ref64 = outputs_and_grads(reference, _leaves(tensors, torch.float64), do)
    same = outputs_and_grads(reference, _leaves(tensors, dtype), do)
    fused = outputs_and_grads(
        lambda q, k, v, q2, k2, lam: _GluonDiffBackward.apply(q, k, v, q2, k2, lam, spec, causal, forward_tier,
                                                              dkdv_form, fused_query_rows, dq_form, one_pass),
        _leaves(tensors, dtype), do)
    sensitivity = rounding_sensitivity(reference, tensors, do, dtype)
    for name in ("out", *GRADIENTS):
        expected_dtype = torch.float32 if name == "dlam" else dtype
        assert fused[name].dtype == expected_dtype and fused[name].shape == ref64[name].shape, name
        allowance = FLOORS[dtype] * max(1.0, ref64[name].abs().max().item()) + sensitivity[name]
        assert_within_reference_error(name, fused[name], same[name], ref64[name], floor=allowance)
    return fused, ref64


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_gluon_differential_backward_after_the_portable_forward_is_within_the_rule(case, nan_poison):
    _check(case, "portable", seed=CASES.index(case))


@pytest.mark.parametrize("case", CASES[::3], ids=[case_id(c) for c in CASES[::3]])
def test_gluon_differential_backward_after_the_gluon_forward_is_within_the_rule(case, nan_poison):
    _check(case, "gluon", seed=100 + CASES.index(case))


VIEW_FORMS = ["view_warpgroups", "view_exchange"]


@pytest.mark.parametrize("form", VIEW_FORMS)
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_the_view_warpgroup_forms_are_within_the_rule(case, form, nan_poison):
    """The key-block kernel's forms with one warpgroup per score view on the same 64 keys
    (`gluon_diff_bwd.VIEW_WARPGROUPS`: view 2's dV part handed to view 1 through shared memory;
    `VIEW_EXCHANGE`: view 1's dP^T and W1^T handed to view 2 per query block) on the whole case matrix: all six
    gradients within the rule."""
    _check(case, "portable", seed=200 + CASES.index(case), dkdv_form=form)


def _packed(seed, b=2, n=700, kv=700, h=8, h_kv=2, d=128, dtype=torch.bfloat16):
    gen = torch.Generator(device=CUDA).manual_seed(seed)

    def unit(*size):
        return torch.nn.functional.normalize(torch.randn(*size, device=CUDA, generator=gen), dim=-1).to(dtype)

    q, q2, k, k2 = unit(b, n, h, d), unit(b, n, h, d), unit(b, kv, h_kv, d), unit(b, kv, h_kv, d)
    v = torch.randn(b, kv, h_kv, d, device=CUDA, generator=gen).to(dtype)
    do = torch.randn(b, n, h, d, device=CUDA, generator=gen).to(dtype)
    lam = torch.linspace(-0.5, 1.2, h, device=CUDA)
    return q, k, v, q2, k2, lam, do


@pytest.mark.parametrize("power,causal", [(2.0, True), (1.0, True), (1.5, False)])
def test_gluon_differential_backward_is_repeatable_and_close_to_the_portable_backward(power, causal):
    """Two calls give the same bits (no atomics; d-lambda summed in a fixed order), and the result is close to the
    portable differential backward's (both within the rule; here a direct comparison at a rounding or two of the
    16-bit results, d-lambda at a few of its fp32 sum's magnitude)."""
    from attn.kernels import threshold_family
    from attn.kernels.gluon_diff_bwd import launch_diff_threshold_backward

    q, k, v, q2, k2, lam, do = _packed(seed=5)
    first = launch_diff_threshold_backward(q, k, v, q2, k2, lam, do, causal, 1.0, power)
    second = launch_diff_threshold_backward(q, k, v, q2, k2, lam, do, causal, 1.0, power)
    portable = threshold_family._backward_impl(do, q, k, v, q2, k2, lam, None, 1.0, power, causal, 0)
    for name, a, b, p in zip(GRADIENTS, first, second, portable):
        assert torch.equal(a, b), name
        assert a.dtype == p.dtype and a.shape == p.shape, name
        scale = p.float().abs().max().item()
        assert scale > 0, name
        assert (a.float() - p.float()).abs().max().item() <= 2e-2 * scale, name


@pytest.mark.parametrize("form", VIEW_FORMS)
@pytest.mark.parametrize("power,causal,d", [(2.0, True, 128), (1.5, True, 64), (1.0, False, 128)])
def test_the_view_warpgroup_forms_are_repeatable_and_close_to_the_key_halves_form(power, causal, d, form):
    """The view-warpgroup forms give the same bits twice (no atomics, fixed orders) and the gradients of the
    key-halves forms but for rounding: dq, dq2 and d-lambda (the same query-block kernel) bit for bit, dk, dk2
    within a rounding of the 16-bit results (the same products, lambda applied per score in both), dv within a
    few (W rounded to 16 bits per view or once, before its product)."""
    from attn.kernels.gluon_diff_bwd import launch_diff_threshold_backward

    q, k, v, q2, k2, lam, do = _packed(seed=11, d=d)
    first = launch_diff_threshold_backward(q, k, v, q2, k2, lam, do, causal, 1.0, power, dkdv_form=form)
    second = launch_diff_threshold_backward(q, k, v, q2, k2, lam, do, causal, 1.0, power, dkdv_form=form)
    halves = launch_diff_threshold_backward(q, k, v, q2, k2, lam, do, causal, 1.0, power)
    for name, a, b, h in zip(GRADIENTS, first, second, halves):
        assert torch.equal(a, b), name
        if name in ("dq", "dq2", "dlam"):
            assert torch.equal(a, h), name
            continue
        scale = h.float().abs().max().item()
        assert scale > 0, name
        assert (a.float() - h.float()).abs().max().item() <= 2e-2 * scale, name


@pytest.mark.parametrize("power,form,rows", [(2.0, "key_halves", None), (1.5, "key_halves", None),
                                            (2.0, "key_halves", 32), (2.0, "view_warpgroups", None)])
def test_the_persistent_grids_give_the_per_item_grids_bits(power, form, rows, nan_poison):
    """`persistent=True` (the query-block kernel and the key halves' key-block launches on persistent grids, one
    program per SM running work items in turn; the view warpgroups' key-block launch stays per item) computes
    each item as the per-item grids do: all six gradients equal bit for bit, every element written (NaN-poisoned
    allocations), on `PERSISTENT_SHAPES` (more work items than SMs, a ragged last group, rows that see no key;
    D 64 runs the fused key-block form on `rows` query rows per ring slot, D 128 the first and second views'
    launches)."""
    from attn.kernels.gluon_diff_bwd import launch_diff_threshold_backward

    for index, shape in enumerate(PERSISTENT_SHAPES):
        causal, dtype = shape[6], shape[7]
        tensors, do = _inputs(shape, seed=300 + index)
        t = {name: x.to(torch.float32 if name == "lam" else dtype) for name, x in tensors.items()}
        args = (t["q"], t["k"], t["v"], t["q2"], t["k2"], t["lam"], do.to(dtype), causal, 1.0, power)
        per_item = launch_diff_threshold_backward(*args, dkdv_form=form, fused_query_rows=rows)
        persistent = launch_diff_threshold_backward(*args, dkdv_form=form, persistent=True, fused_query_rows=rows)
        torch.cuda.synchronize()
        for name, ref, got in zip(GRADIENTS, per_item, persistent):
            assert not got.isnan().any(), f"{shape} {name}: an element unwritten (NaN)"
            assert torch.equal(got, ref), f"{shape} p={power} {name}: the grids' bits differ"


D64_CASES = [case for case in CASES if case[1][5] == 64]


@pytest.mark.parametrize("case", D64_CASES, ids=[case_id(c) for c in D64_CASES])
def test_fused_32_rows_is_within_the_rule(case, nan_poison):
    """fused_32_rows: the fused key-block form (D = 64) with 32 query rows per ring slot instead of
    FUSED_QUERY_ROWS's 64 (`fused_query_rows=32`) on the D = 64 cases: all six gradients within the rule."""
    _check(case, "portable", seed=400 + CASES.index(case), fused_query_rows=32)


@pytest.mark.parametrize("power,causal", [(2.0, True), (1.5, False)])
def test_fused_rows_are_repeatable_and_close_to_each_other(power, causal):
    """fused_32_rows: the same bits twice for 32 and for 64 query rows per ring slot; dq, dq2 and d-lambda (the
    query-block kernel) the same bits for both; dk, dk2, dv within a rounding or two (the same products, summed
    over query rows in other chunks)."""
    from attn.kernels.gluon_diff_bwd import launch_diff_threshold_backward

    q, k, v, q2, k2, lam, do = _packed(seed=13, d=64)
    args = (q, k, v, q2, k2, lam, do, causal, 1.0, power)
    rows64, rows32 = (launch_diff_threshold_backward(*args, fused_query_rows=rows) for rows in (64, 32))
    again64, again32 = (launch_diff_threshold_backward(*args, fused_query_rows=rows) for rows in (64, 32))
    for name, a, b, r, r2 in zip(GRADIENTS, rows64, again64, rows32, again32):
        assert torch.equal(a, b) and torch.equal(r, r2), name
        if name in ("dq", "dq2", "dlam"):
            assert torch.equal(a, r), name
            continue
        scale = r.float().abs().max().item()
        assert scale > 0 and (a.float() - r.float()).abs().max().item() <= 2e-2 * scale, name


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_dq_view_warpgroups_is_within_the_rule(case, nan_poison):
    """dq_view_warpgroups: the query-block kernel's view-warpgroup form (`dq_form="view_warpgroups"`: a warpgroup
    per score view on the same 64 rows, each computing dP) on the whole case matrix: all six gradients within the
    rule."""
    _check(case, "portable", seed=500 + CASES.index(case), dq_form="view_warpgroups")


@pytest.mark.parametrize("power,causal,d", [(2.0, True, 128), (1.5, True, 64), (1.0, False, 128), (3.0, True, 128)])
def test_dq_view_warpgroups_is_repeatable_and_close_to_the_rows_form(power, causal, d, nan_poison):
    """dq_view_warpgroups: the same bits twice; dk, dv, dk2 (the same key-block kernels) the rows form's bits; dq,
    dq2 within a rounding or two of it (the same products summed over other key chunks at D = 128), d-lambda
    within a few of its fp32 sum's magnitude (its terms summed in another order)."""
    from attn.kernels.gluon_diff_bwd import launch_diff_threshold_backward

    q, k, v, q2, k2, lam, do = _packed(seed=17, d=d)
    args = (q, k, v, q2, k2, lam, do, causal, 1.0, power)
    first, second = (launch_diff_threshold_backward(*args, dq_form="view_warpgroups") for _ in range(2))
    for name, a, b in zip(GRADIENTS, first, second):
        assert torch.equal(a, b), name
    _assert_key_gradients_equal_and_the_rest_close(first, launch_diff_threshold_backward(*args))


def _assert_key_gradients_equal_and_the_rest_close(result, other):
    """dk, dv, dk2 (the same key-block step) `other`'s bits; dq, dq2 and d-lambda within 2 % of `other`'s largest
    magnitude (a rounding or two of the 16-bit results, a few of d-lambda's fp32 sum); nothing NaN."""
    for name, a, r in zip(GRADIENTS, result, other):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert not a.isnan().any(), name
        if name in ("dk", "dv", "dk2"):
            assert torch.equal(a, r), name
            continue
        scale = r.float().abs().max().item()
        assert scale > 0 and (a.float() - r.float()).abs().max().item() <= 2e-2 * scale, name


ONE_PASS_CASES = [case for case in CASES if case[0].get("power", 2.0) in (1.0, 2.0)]


@pytest.mark.parametrize("case", ONE_PASS_CASES, ids=[case_id(c) for c in ONE_PASS_CASES])
def test_the_one_pass_form_is_within_the_rule(case, nan_poison):
    """The view warpgroups' one-pass form (`one_pass=True`: dQ and dQ2 added into fp32 buffers by the key-block
    kernel, the d-lambda terms written per key, no query-block kernel) on the case matrix's p = 1 and 2 cases:
    all six gradients within the rule."""
    _check(case, "portable", seed=700 + CASES.index(case), dkdv_form="view_warpgroups", one_pass=True)


@pytest.mark.parametrize("power,causal,d", [(2.0, True, 128), (1.0, False, 128), (2.0, False, 64), (1.0, True, 64)])
def test_the_one_pass_form_keeps_dk_dv_dk2_bits_and_is_close_to_the_separate_form(power, causal, d, nan_poison):
    """dk, dv, dk2 the view-warpgroup separate form's bits (the same key-block step, the dQ path beside it); dq, dq2
    (fp32 sums in no fixed order) and d-lambda (its terms summed per key instead of per query row) within a
    rounding or two of the separate form's; nothing NaN."""
    from attn.kernels.gluon_diff_bwd import launch_diff_threshold_backward

    q, k, v, q2, k2, lam, do = _packed(seed=23, d=d)
    args = (q, k, v, q2, k2, lam, do, causal, 1.0, power)
    _assert_key_gradients_equal_and_the_rest_close(
        launch_diff_threshold_backward(*args, dkdv_form="view_warpgroups", one_pass=True),
        launch_diff_threshold_backward(*args, dkdv_form="view_warpgroups"))


def test_lambda_of_any_float_dtype_and_strides_gives_the_bits_of_its_fp32_copy(nan_poison):
    """lambda is read per head through its stride and converted to fp32 in the kernels: a bf16 or fp16 lambda, or a
    strided one, gives the gradients of q, k, v, q2, k2 of its contiguous fp32 copy, and d-lambda in its own dtype
    (the fp32 d-lambda rounded to it)."""
    from attn.kernels.gluon_diff_bwd import launch_diff_threshold_backward

    q, k, v, q2, k2, _, do = _packed(seed=3, n=300, kv=300, h=4)
    lam16 = torch.tensor([0.75, -0.25, 0.5, 1.0], device=CUDA, dtype=torch.bfloat16)
    lam_strided = torch.zeros(8, device=CUDA)
    lam_strided[::2] = lam16.float()
    base = launch_diff_threshold_backward(q, k, v, q2, k2, lam16.float(), do, True, 1.0, 2.0)
    for lam in (lam16, lam_strided[::2], lam16.half()):
        got = launch_diff_threshold_backward(q, k, v, q2, k2, lam, do, True, 1.0, 2.0)
        for name, a, b in zip(GRADIENTS[:5], got[:5], base[:5]):
            assert torch.equal(a, b), (name, lam.dtype)
        assert got[5].dtype == lam.dtype and torch.equal(got[5], base[5].to(lam.dtype)), lam.dtype


def test_checked_entry_names_what_a_call_misses():
    from attn.kernels.gluon_diff_bwd import gluon_diff_threshold_backward

    q = torch.randn(1, 64, 2, 64, device=CUDA, dtype=torch.bfloat16)
    k = v = torch.randn(1, 64, 1, 64, device=CUDA, dtype=torch.bfloat16)
    lam = torch.full((2,), 0.5, device=CUDA)
    with pytest.raises(ValueError, match="q2"):
        gluon_diff_threshold_backward(q, k, v, q[:, :32], k, lam, q, True)
    with pytest.raises(ValueError, match="k2"):
        gluon_diff_threshold_backward(q, k, v, q, k.half(), lam, q, True)
    with pytest.raises(ValueError, match="dout"):
        gluon_diff_threshold_backward(q, k, v, q, k, lam, q[:, :32], True)
    with pytest.raises(ValueError, match="dout"):
        gluon_diff_threshold_backward(q, k, v, q, k, lam, q.half(), True)
    with pytest.raises(ValueError, match="lam"):
        gluon_diff_threshold_backward(q, k, v, q, k, lam[:1], q, True)
    with pytest.raises(ValueError, match="lam"):
        gluon_diff_threshold_backward(q, k, v, q, k, lam.double(), q, True)
    with pytest.raises(ValueError, match="power"):
        gluon_diff_threshold_backward(q, k, v, q, k, lam, q, True, power=0.0)
    with pytest.raises(ValueError, match="beta"):
        gluon_diff_threshold_backward(q, k, v, q, k, lam, q, True, beta=float("nan"))
    with pytest.raises(ValueError, match="dkdv_form"):
        gluon_diff_threshold_backward(q, k, v, q, k, lam, q, True, dkdv_form="views")
    with pytest.raises(ValueError, match="fused_query_rows"):
        gluon_diff_threshold_backward(q, k, v, q, k, lam, q, True, fused_query_rows=48)
    with pytest.raises(ValueError, match="dq_form"):
        gluon_diff_threshold_backward(q, k, v, q, k, lam, q, True, dq_form="views")
    with pytest.raises(ValueError, match="one_pass"):
        gluon_diff_threshold_backward(q, k, v, q, k, lam, q, True, one_pass=True)  # the key halves' form
    with pytest.raises(ValueError, match="one_pass"):
        gluon_diff_threshold_backward(q, k, v, q, k, lam, q, True, power=1.5, dkdv_form="view_warpgroups",
                                      one_pass=True)
    with pytest.raises(ValueError, match="causal"):
        gluon_diff_threshold_backward(q, k, v, q, k, lam, q, 1)
    with pytest.raises(ValueError, match="head dim"):
        q96 = torch.randn(1, 64, 2, 96, device=CUDA, dtype=torch.bfloat16)
        gluon_diff_threshold_backward(q96, q96, q96, q96, q96, lam, q96, True)
