"""Fused threshold-family kernels (attn/kernels/threshold_family.py) vs the float64 reference.

Runs the Triton kernels under TRITON_INTERPRET=1 on CPU, in fp32 and fp16 (bf16 is checked
on the GPU by scripts/gpu_checks/check_threshold_gpu.py). Every comparison uses the DESIGN.md §6 rule
(tests/tolerance.py): error vs float64 <= 2x the same PyTorch code's error in the kernel's
dtype + a small floor, for out, dq, dk, dv and, for diff_threshold, dq2, dk2 and d-lambda.
"""

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tolerance import assert_within_reference_error  # noqa: E402

import attn  # noqa: E402
from attn.kernels import threshold_family as tf  # noqa: E402
from attn.testing import (opcheck_launcher, outputs_and_grads, random_qkv, random_segment_ids,  # noqa: E402
                          rounding_sensitivity)
from attn.masks import MaskSpec, dense_mask  # noqa: E402
from attn.reference import exact_zero_fraction, reference_attention, threshold_family_weights  # noqa: E402
from attn.specs import ThresholdFamilySpec  # noqa: E402

# absolute error allowances; fp32's is tight enough that the rule, not the floor, decides
FLOOR = {torch.float32: 3e-6, torch.float16: 1e-3}
# beta regimes for q, k on the unit sphere: tau < 0 keeps (almost) every visible weight,
# 0.5 keeps a few per row, 6 makes tau_i > 1 >= q.k for every row with n_i > 1 (all-zero rows)
BETA = {"dense": -1.0, "sparse": 0.5, "zero": 6.0}


def make_inputs(batch, n, heads, kv_heads, d, dtype, differential, seed, strided=False):
    gen = torch.Generator().manual_seed(seed)

    def unit(*shape):
        return F.normalize(torch.randn(*shape, generator=gen, dtype=torch.float64), dim=-1)

    tensors = random_qkv(unit, gen, batch, n, n, heads, kv_heads, d, strided)
    if differential:
        tensors["q2"] = unit(batch, n, heads, d)
        tensors["k2"] = unit(batch, n, kv_heads, d)
        tensors["lam"] = 0.2 + 0.6 * torch.rand(heads, generator=gen, dtype=torch.float64)
    dout = torch.randn(batch, n, heads, d, generator=gen, dtype=torch.float64)
    return tensors, dout


def _as(tensors, dtype):
    """Leaf copies in dtype (lam stays fp32 for low-precision runs, as a model keeps it)."""
    out = {}
    for name, t in tensors.items():
        target = torch.float32 if name == "lam" and dtype != torch.float64 else dtype
        out[name] = t.detach().to(target).requires_grad_()
    return out


def check_against_reference(spec, mask, seg, tensors, dout, dtype):
    def reference(dt):
        def fn(q, k, v, **extra):
            return reference_attention(q, k, v, spec, mask, seg, None, extra=extra)
        return outputs_and_grads(fn, _as(tensors, dt), dout)

    def fused(q, k, v, **extra):
        return tf.fused_attention(q, k, v, spec, mask, seg, None, extra=extra)

    def reference64(q, k, v, **extra):
        return reference_attention(q, k, v, spec, mask, seg, None, extra=extra)

    ref64 = reference(torch.float64)
    same = reference(dtype)
    got = outputs_and_grads(fused, _as(tensors, dtype), dout)
    # the floor grows with what one rounding of the inputs does to the exact result: d-lambda is a
    # sum of N^2 terms, and p < 1 gradients are unbounded at the threshold
    sensitivity = rounding_sensitivity(reference64, tensors, dout, dtype)
    ratios = {}
    for name in ref64:
        assert got[name].shape == ref64[name].shape, name
        assert got[name].dtype == same[name].dtype, name
        ratios[name] = assert_within_reference_error(name, got[name], same[name], ref64[name],
                                                     FLOOR[dtype] + sensitivity[name])
    return ratios


# (n, heads, kv_heads, d, power, beta, mask, with_seg, dtype, differential, strided)
CASES = [
    # powers x beta regimes, plain causal, fp32 and fp16
    (17, 2, 1, 16, 1.0, "sparse", "causal", False, torch.float32, False, False),
    (17, 2, 2, 16, 2.0, "dense", "causal", False, torch.float16, False, False),
    (127, 2, 1, 16, 1.5, "sparse", "causal", False, torch.float32, False, False),
    (40, 2, 2, 32, 3.0, "dense", "none", False, torch.float32, False, True),
    (33, 2, 2, 16, 2.0, "zero", "causal", False, torch.float32, False, False),
    (33, 2, 1, 16, 3.0, "zero", "window", False, torch.float16, True, False),
    # every mask kind, odd lengths, GQA 1 / 2 / 4
    (1, 2, 1, 16, 2.0, "sparse", "causal", False, torch.float32, False, False),
    (1, 2, 2, 16, 1.5, "dense", "none", True, torch.float32, True, False),
    (200, 2, 1, 16, 2.0, "sparse", "window", False, torch.float32, False, False),
    (127, 2, 2, 16, 1.0, "dense", "window", False, torch.float16, False, False),
    (45, 4, 1, 16, 2.0, "sparse", "none", True, torch.float32, False, False),
    (45, 2, 2, 16, 1.5, "dense", "causal", True, torch.float16, False, True),
    (45, 4, 4, 16, 1.0, "sparse", "window", True, torch.float32, False, False),
    (38, 4, 1, 64, 2.0, "sparse", "causal", False, torch.float32, False, False),
    (21, 2, 1, 64, 1.5, "dense", "window", True, torch.float16, True, False),
    # differential: both views, d-lambda
    (17, 2, 1, 16, 2.0, "sparse", "causal", False, torch.float32, True, False),
    (127, 2, 1, 16, 1.0, "dense", "causal", False, torch.float32, True, False),
    (50, 4, 1, 32, 1.5, "sparse", "none", True, torch.float32, True, True),
    (50, 2, 2, 16, 3.0, "dense", "causal", True, torch.float16, True, False),
    (64, 2, 1, 16, 2.0, "dense", "window", False, torch.float16, True, False),
    # combinations the rows above leave out: differential with a full mask and with p < 1,
    # all-empty rows under segment ids (both forms), head dims 32 (fp16) and 128
    (37, 2, 2, 16, 2.0, "dense", "none", False, torch.float32, True, False),
    (29, 2, 1, 16, 0.5, "sparse", "causal", False, torch.float32, True, False),
    (33, 2, 1, 16, 2.0, "zero", "none", True, torch.float32, False, False),
    (30, 2, 2, 16, 1.0, "zero", "window", True, torch.float32, True, False),
    (26, 2, 1, 32, 2.0, "sparse", "causal", True, torch.float16, False, False),
    (19, 2, 1, 128, 2.0, "sparse", "causal", False, torch.float32, False, False),
]
MASKS = {"none": MaskSpec(causal=False), "causal": MaskSpec(causal=True), "window": MaskSpec(causal=True, window=9)}


def _case_id(case):
    n, h, hkv, d, p, beta, mask, seg, dtype, diff, strided = case
    parts = [f"N{n}", f"H{h}/{hkv}", f"D{d}", f"p{p:g}", beta, mask + ("+seg" if seg else ""),
             str(dtype).split(".")[-1], "diff" if diff else "thr"] + (["strided"] if strided else [])
    return "-".join(parts)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_float64_reference(case, nan_poison):
    n, heads, kv_heads, d, power, beta, mask_name, with_seg, dtype, differential, strided = case
    seed = sum(map(ord, _case_id(case)))  # fixed per case, different across cases
    batch = 1 if n > 100 else 2  # the interpreter's time grows with B * H * N^2
    spec = ThresholdFamilySpec(beta=BETA[beta], power=power, differential=differential)
    mask = MASKS[mask_name]
    seg = random_segment_ids(batch, n, torch.Generator().manual_seed(seed), min_history=n // 3) if with_seg else None
    tensors, dout = make_inputs(batch, n, heads, kv_heads, d, dtype, differential, seed, strided)
    check_against_reference(spec, mask, seg, tensors, dout, dtype)


@pytest.mark.parametrize("blocks,dkdv_form", [((32, 16), "split"), ((16, 32), "fused")])
def test_other_tile_shapes(blocks, dkdv_form, monkeypatch, nan_poison):
    """Query and key tiles of different sizes move the masked / unmasked split; both forms
    of the differential dk/dv kernel (fused: one launch, split: two)."""
    monkeypatch.setenv("ATTNLAB_DIFF_DKDV", dkdv_form)
    bm, bn = blocks
    monkeypatch.setitem(tf.INTERPRETER_CONFIG, "fwd", (bm, bn))
    monkeypatch.setitem(tf.INTERPRETER_CONFIG, "dq", (bm, bn))
    monkeypatch.setitem(tf.INTERPRETER_CONFIG, "dkdv", (bm, bn))
    batch, n = 2, 70
    gen = torch.Generator().manual_seed(bm * 7 + bn)
    seg = random_segment_ids(batch, n, gen, min_history=n // 3)
    for mask, s in ((MaskSpec(causal=True, window=37), None), (MaskSpec(causal=True), seg)):
        spec = ThresholdFamilySpec(beta=0.0, power=2.0, differential=True)
        tensors, dout = make_inputs(batch, n, 2, 1, 16, torch.float32, True, bm + bn)
        check_against_reference(spec, mask, s, tensors, dout, torch.float32)


def test_unknown_dkdv_form_is_named(monkeypatch):
    monkeypatch.setenv("ATTNLAB_DIFF_DKDV", "Fused")
    spec = ThresholdFamilySpec(beta=0.0, power=2.0, differential=True)
    tensors, dout = make_inputs(1, 8, 2, 1, 16, torch.float32, True, 3)
    x = _as(tensors, torch.float32)
    out = tf.fused_attention(x["q"], x["k"], x["v"], spec, MaskSpec(causal=True), None,
                             extra={"q2": x["q2"], "k2": x["k2"], "lam": x["lam"]})
    with pytest.raises(ValueError, match=r"ATTNLAB_DIFF_DKDV must be one of \('fused', 'split'\), got 'Fused'"):
        out.backward(dout.float())


def test_fully_masked_rows_are_zero_with_zero_gradient(nan_poison):
    """Padding queries (segment id 0) output exactly 0 and pass no gradient."""
    batch, n = 2, 23
    seg = torch.tensor([[1] * 8 + [-1] * 5 + [0] * 10, [0] * 23])
    spec = ThresholdFamilySpec(beta=-1.0, power=2.0)
    tensors, dout = make_inputs(batch, n, 2, 1, 16, torch.float32, False, 5)
    x = _as(tensors, torch.float32)
    out = tf.fused_attention(x["q"], x["k"], x["v"], spec, MaskSpec(causal=False), seg)
    out.backward(dout.float())
    padding = seg == 0
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))
    assert torch.equal(x["q"].grad[padding], torch.zeros_like(x["q"].grad[padding]))
    assert torch.equal(x["k"].grad[padding], torch.zeros_like(x["k"].grad[padding]))
    assert torch.equal(x["v"].grad[padding], torch.zeros_like(x["v"].grad[padding]))
    assert out[~padding].abs().sum() > 0  # dense beta: the other rows are not empty


def test_power_below_one_keeps_finite_gradients(nan_poison):
    spec = ThresholdFamilySpec(beta=0.3, power=0.5)
    tensors, dout = make_inputs(1, 31, 2, 1, 16, torch.float32, False, 11)
    check_against_reference(spec, MaskSpec(causal=True), None, tensors, dout, torch.float32)


def _expected_counts(mask, n, seg):
    """n_i by brute force over the dense mask (independent of the closed forms)."""
    return dense_mask(mask, n, seg).sum(dim=-1).double()


@pytest.mark.parametrize("mask_name,with_seg", [("window", False), ("none", True), ("window", True)])
def test_threshold_tau_windowed_and_ranker(mask_name, with_seg, nan_poison):
    """Read tau_i off the kernel: with every key = q_i = e_0 and v = e_0, p = 1 gives
    out_i[0] = n_i (1 - tau_i), so tau_i = 1 - out_i[0] / n_i."""
    batch, n, d, beta = 2, 70, 16, 0.7
    mask = MaskSpec(causal=True, window=20) if mask_name == "window" else MaskSpec(causal=False)
    seg = random_segment_ids(batch, n, torch.Generator().manual_seed(3), min_history=n // 3) if with_seg else None
    e0 = torch.zeros(d)
    e0[0] = 1.0
    q = e0.expand(batch, n, 2, d)
    k = e0.expand(batch, n, 1, d)
    out = tf.fused_attention(q, k, k, ThresholdFamilySpec(beta=beta, power=1.0), mask, seg)
    counts = _expected_counts(mask, n, seg).expand(batch, n)
    seen = counts > 0
    tau = 1.0 - out[..., 0, 0].double() / counts.clamp_min(1)
    expected = beta * torch.sqrt(2.0 * torch.log(counts.clamp_min(1)) / d)
    assert (expected[seen] < 1).all()  # the read-off needs tau < 1
    torch.testing.assert_close(tau[seen], expected[seen], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))
    if mask_name == "window":
        assert counts.max() == 20  # the window binds


def seed_formula_attention(q, k, v, beta, power):
    """Direct transcription of the seed reference (threshold_attention_reference.py.txt):
    (batch, heads, seq, dim) layout, tau(i) = beta * sqrt(2 * log(i + 1) / d), causal."""
    batch, heads, seq_len, head_dim = q.shape
    rows = torch.arange(seq_len, dtype=q.dtype)
    tau = beta * torch.sqrt(2 * torch.log(rows + 1.0) / head_dim)
    qk = q @ k.transpose(-1, -2)
    causal = torch.arange(seq_len)[None, :] <= torch.arange(seq_len)[:, None]
    qk = torch.where(causal, qk, torch.zeros_like(qk))
    qk_relu = torch.relu(qk - tau[:, None])
    return qk_relu**power @ v


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_agrees_with_seed_formula(power, nan_poison):
    """Causal, no window, q and k L2-normalized: the seed's tau and ours coincide."""
    batch, heads, n, d, beta = 2, 2, 45, 32, 0.4
    tensors, dout = make_inputs(batch, n, heads, heads, d, torch.float32, False, int(power * 10))
    seed64 = {name: t.transpose(1, 2).detach().clone().requires_grad_() for name, t in tensors.items()}
    expected = seed_formula_attention(seed64["q"], seed64["k"], seed64["v"], beta, power)
    expected_grads = torch.autograd.grad(expected, list(seed64.values()), dout.transpose(1, 2))
    x = _as(tensors, torch.float32)
    out = tf.fused_attention(x["q"], x["k"], x["v"], ThresholdFamilySpec(beta=beta, power=power), MaskSpec(True))
    grads = torch.autograd.grad(out, list(x.values()), dout.float())
    torch.testing.assert_close(out.double(), expected.transpose(1, 2), atol=2e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.double(), want.transpose(1, 2), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("differential", [False, True])
@pytest.mark.parametrize("mask_name,with_seg", [("causal", False), ("window", True)])
def test_zero_fraction_matches_reference(differential, mask_name, with_seg, nan_poison):
    batch, n, heads, kv_heads, d = 2, 57, 4, 2, 16
    mask = MASKS[mask_name]
    seg = random_segment_ids(batch, n, torch.Generator().manual_seed(9), min_history=n // 3) if with_seg else None
    spec = ThresholdFamilySpec(beta=0.3, power=2.0, differential=differential)
    tensors, _ = make_inputs(batch, n, heads, kv_heads, d, torch.float32, differential, 21)
    x = {name: t.float() for name, t in tensors.items()}
    extra = {name: x[name] for name in ("q2", "k2", "lam") if name in x}
    got = tf.zero_fraction(x["q"], x["k"], spec, mask, seg, extra=extra)
    weights = threshold_family_weights(x["q"], x["k"], spec, mask, seg, x.get("q2"), x.get("k2"), x.get("lam"))
    want = exact_zero_fraction(weights, dense_mask(mask, n, seg)[:, None])
    assert got.shape == (heads,) and got.dtype == torch.float64
    visible = dense_mask(mask, n, seg).expand(batch, n, n).sum().item()
    torch.testing.assert_close(got, want, atol=1.5 / visible, rtol=0)
    assert ((got > 0.05) & (got < 1)).all()  # a sparse regime, not a degenerate one


DIFFERENTIAL_CASES = [c for c in CASES if c[9]]


@pytest.mark.parametrize("case", DIFFERENTIAL_CASES[::2], ids=[_case_id(c) for c in DIFFERENTIAL_CASES[::2]])
def test_fused_differential_dkdv_form_matches_the_reference(case, monkeypatch, nan_poison):
    """The one-launch differential dk/dv (three accumulators) on the same cases as the split form."""
    monkeypatch.setenv("ATTNLAB_DIFF_DKDV", "fused")
    test_matches_float64_reference(case, None)


@pytest.mark.parametrize("differential", [False, True])
def test_window_of_one_key_sees_only_itself(differential, nan_poison):
    """window=1: every query sees its own key only (n_i = 1, tau_i = 0)."""
    spec = ThresholdFamilySpec(beta=1.0, power=2.0, differential=differential)
    tensors, dout = make_inputs(2, 23, 2, 1, 16, torch.float32, differential, 9)
    check_against_reference(spec, MaskSpec(causal=True, window=1), None, tensors, dout, torch.float32)


def test_rejects_unsupported_inputs():
    spec = ThresholdFamilySpec()
    q = torch.randn(1, 8, 2, 48)
    with pytest.raises(ValueError, match="head dim"):
        tf.fused_attention(q, q, q, spec, MaskSpec(True))
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="temperature"):
        tf.fused_attention(q, q, q, spec, MaskSpec(True), None, torch.ones(1, 8))
    with pytest.raises(ValueError, match="extra is missing the key 'q2'"):
        tf.fused_attention(q, q, q, ThresholdFamilySpec(differential=True), MaskSpec(True))
    with pytest.raises(ValueError, match=r"extra\['q2'\], extra\['k2'\] \(second view\) and extra\['lam'\]"):
        tf.fused_attention(q, q, q, ThresholdFamilySpec(differential=True), MaskSpec(True),
                           extra={"q2": q, "k2": q, "lam": None})
    with pytest.raises(ValueError, match="extra has an unexpected key 'q2'"):
        tf.fused_attention(q, q, q, spec, MaskSpec(True), extra={"q2": q})
    with pytest.raises(ValueError, match="dtype"):
        tf.fused_attention(q.double(), q.double(), q.double(), spec, MaskSpec(True))


def _op_args(differential, with_seg):
    tensors, dout = make_inputs(1, 17, 2, 1, 16, torch.float32, differential, 2)
    x = {name: t.float().requires_grad_() for name, t in tensors.items()}
    seg = random_segment_ids(1, 17, torch.Generator().manual_seed(1), min_history=17 // 3) if with_seg else None
    bounds = attn.segment_bounds(seg) if seg is not None else None
    return x, bounds, dout.float()


@pytest.mark.parametrize("differential,with_seg", [(False, False), (True, True)])
def test_custom_op_matches_eager_path(differential, with_seg):
    """Eager calls run the impls, traced calls the op and its backward op (same implementation): the
    Function compiled (fullgraph) gives bitwise the eager Function's output and gradients."""
    x, bounds, dout = _op_args(differential, with_seg)
    args = (x["q"], x["k"], x["v"], x.get("q2"), x.get("k2"), x.get("lam"), bounds, 0.2, 1.5, True, 0)
    results = []
    function = tf._ATTENTION.function.apply
    for fn in (function, torch.compile(function, fullgraph=True)):
        out = fn(*args)
        results.append((out, *torch.autograd.grad(out, list(x.values()), dout)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("differential,with_seg", [(False, False), (True, True)])
def test_opcheck(differential, with_seg):
    x, bounds, dout = _op_args(differential, with_seg)
    q2, k2, lam = x.get("q2"), x.get("k2"), x.get("lam")
    scalars = (0.2, 2.0, True, 0)
    opcheck_launcher(tf.threshold_attention_op, (x["q"], x["k"], x["v"], q2, k2, lam, bounds, *scalars))
    # the backward ops are not differentiable themselves (no double backward): plain inputs
    x = {name: t.detach() for name, t in x.items()}
    q2, k2, lam = x.get("q2"), x.get("k2"), x.get("lam")
    if differential:
        opcheck_launcher(tf.diff_threshold_attention_backward_op,
                              (dout, x["q"], x["k"], x["v"], q2, k2, lam, bounds, *scalars))
    else:
        opcheck_launcher(tf.threshold_attention_backward_op, (dout, x["q"], x["k"], x["v"], bounds, *scalars))


def test_torch_compile_fullgraph_matches_eager():
    """A small block through attn.attention(backend='triton') compiles without graph breaks
    (fullgraph=True; aot_eager on CPU, inductor in scripts/gpu_checks/check_threshold_gpu.py)."""
    torch._dynamo.reset()
    spec = attn.get_variant("diff_threshold").make_spec(beta=0.2, power=2.0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 19, 32, generator=gen)
    proj = torch.randn(32, 5 * 32, generator=gen) / math.sqrt(32)
    lam = torch.tensor([0.3, 0.6])

    def block(x, proj, lam):
        q, k, v, q2, k2 = (x @ proj).split(32, dim=-1)
        heads = lambda t: F.normalize(t.unflatten(-1, (2, 16)), dim=-1)  # noqa: E731
        out = attn.attention(heads(q), heads(k), v.unflatten(-1, (2, 16)), spec, causal=True,
                             extra={"q2": heads(q2), "k2": heads(k2), "lam": lam}, backend="triton")
        return out.flatten(-2).square().mean()

    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        p, l_ = proj.clone().requires_grad_(), lam.clone().requires_grad_()
        loss = fn(x, p, l_)
        loss.backward()
        results.append((loss.detach(), p.grad, l_.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)
