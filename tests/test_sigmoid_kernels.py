"""Fused sigmoid-family kernels (attn/kernels/sigmoid_family.py) vs the float64 reference.

Runs the Triton kernels under TRITON_INTERPRET=1 on CPU, in fp32 and fp16 (bf16 runs on the GPU:
tests/test_kernels_longer_keys.py's bf16 matrix). Every comparison uses the DESIGN.md §6 rule
(tests/tolerance.py): error vs float64 <= 2x the same PyTorch code's error in the kernel's dtype + a
small floor, for out, dq, dk and dv. Queries against longer keys, the split-key decode forward and
key lengths: tests/test_kernels_longer_keys.py; dropout: tests/test_attention_dropout.py.
"""

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tolerance import assert_within_reference_error  # noqa: E402

import attn  # noqa: E402
from attn.families import family_of  # noqa: E402
from attn.kernels import sigmoid_family as sg  # noqa: E402
from attn.masks import MaskSpec, dense_mask, visible_key_counts  # noqa: E402
from attn.reference import reference_attention, sigmoid_family_weights  # noqa: E402
from attn.specs import SigmoidFamilySpec  # noqa: E402
from attn.testing import opcheck_launcher, outputs_and_grads, random_qkv, random_segment_ids  # noqa: E402

# absolute error allowances; fp32's is tight enough that the rule, not the floor, decides
FLOOR = {torch.float32: 3e-6, torch.float16: 1e-3}
MASKS = {"none": MaskSpec(causal=False), "causal": MaskSpec(causal=True), "window": MaskSpec(causal=True, window=9)}


def make_inputs(batch, n, heads, kv_heads, d, seed, kv=None, strided=False, spread=1.0):
    """float64 q (B, n, H, D), k / v (B, kv, H_kv, D) and dout; `spread` scales q and k (s q.k has
    standard deviation spread^2: 1 leaves weights mid-range, 3 saturates many near 0 and 1)."""
    gen = torch.Generator().manual_seed(seed)
    kv = n if kv is None else kv

    def rand(*shape):
        return spread * torch.randn(*shape, generator=gen, dtype=torch.float64)

    tensors = random_qkv(rand, gen, batch, n, kv, heads, kv_heads, d, strided)
    dout = torch.randn(batch, n, heads, d, generator=gen, dtype=torch.float64)
    return tensors, dout


def _as(tensors, dtype):
    return {name: t.detach().to(dtype).requires_grad_() for name, t in tensors.items()}


def check_against_reference(spec, mask, seg, tensors, dout, dtype):
    def reference(dt):
        return outputs_and_grads(lambda q, k, v: reference_attention(q, k, v, spec, mask, seg), _as(tensors, dt), dout)

    ref64, same = reference(torch.float64), reference(dtype)
    got = outputs_and_grads(lambda q, k, v: sg.fused_attention(q, k, v, spec, mask, seg), _as(tensors, dtype), dout)
    assert set(got) == {"out", "dq", "dk", "dv"}
    ratios = {}
    for name in ref64:
        assert got[name].shape == ref64[name].shape and got[name].dtype == same[name].dtype, name
        ratios[name] = assert_within_reference_error(name, got[name], same[name], ref64[name], FLOOR[dtype])
    return ratios


# (n, heads, kv_heads, d, bias, sm_scale, spread, mask, with_seg, dtype, strided)
CASES = [
    # bias null (-ln n_i) and given, default and explicit scales, mid-range and saturating scores
    (17, 2, 1, 16, None, None, 1.0, "causal", False, torch.float32, False),
    (17, 2, 2, 16, None, None, 1.0, "causal", False, torch.float16, False),
    (127, 2, 1, 16, -3.0, None, 1.0, "causal", False, torch.float32, False),
    (40, 2, 2, 32, 2.0, 0.5, 1.0, "none", False, torch.float32, True),
    (33, 2, 1, 16, None, None, 3.0, "causal", False, torch.float32, False),
    (33, 2, 1, 16, 0.0, 0.2, 3.0, "window", False, torch.float16, False),
    # every mask kind, odd lengths, GQA 1 / 2 / 4
    (1, 2, 1, 16, None, None, 1.0, "causal", False, torch.float32, False),
    (1, 2, 2, 16, -1.0, None, 1.0, "none", True, torch.float32, False),
    (200, 2, 1, 16, None, None, 1.0, "window", False, torch.float32, False),
    (127, 2, 2, 16, None, None, 1.0, "window", False, torch.float16, False),
    (45, 4, 1, 16, None, None, 1.0, "none", True, torch.float32, False),
    (45, 2, 2, 16, -2.0, None, 1.0, "causal", True, torch.float16, True),
    (45, 4, 4, 16, None, 0.3, 1.0, "window", True, torch.float32, False),
    (38, 4, 1, 64, None, None, 1.0, "causal", False, torch.float32, False),
    (21, 2, 1, 64, 1.0, None, 1.0, "window", True, torch.float16, False),
    (26, 2, 1, 32, None, None, 1.0, "causal", True, torch.float16, False),
    (37, 2, 2, 16, None, None, 1.0, "none", False, torch.float16, False),
    (19, 2, 1, 128, None, None, 1.0, "causal", False, torch.float32, False),
]


def _case_id(case):
    n, h, hkv, d, bias, scale, spread, mask, seg, dtype, strided = case
    parts = [f"N{n}", f"H{h}/{hkv}", f"D{d}", "b-ln(n)" if bias is None else f"b{bias:g}",
             "sdefault" if scale is None else f"s{scale:g}", f"spread{spread:g}", mask + ("+seg" if seg else ""),
             str(dtype).split(".")[-1]] + (["strided"] if strided else [])
    return "-".join(parts)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_float64_reference(case, nan_poison):
    n, heads, kv_heads, d, bias, sm_scale, spread, mask_name, with_seg, dtype, strided = case
    seed = sum(map(ord, _case_id(case)))  # fixed per case, different across cases
    batch = 1 if n > 100 else 2  # the interpreter's time grows with B * H * N^2
    spec = SigmoidFamilySpec(bias=bias, sm_scale=sm_scale)
    seg = random_segment_ids(batch, n, torch.Generator().manual_seed(seed), min_history=n // 3) if with_seg else None
    tensors, dout = make_inputs(batch, n, heads, kv_heads, d, seed, strided=strided, spread=spread)
    check_against_reference(spec, MASKS[mask_name], seg, tensors, dout, dtype)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)])
def test_other_tile_shapes(blocks, monkeypatch, nan_poison):
    """Query and key tiles of different sizes move the masked / unmasked split."""
    bm, bn = blocks
    for kind in ("fwd", "dq", "dkdv"):
        monkeypatch.setitem(sg.INTERPRETER_CONFIG, kind, (bm, bn))
    batch, n = 2, 70
    seg = random_segment_ids(batch, n, torch.Generator().manual_seed(bm * 7 + bn), min_history=n // 3)
    for mask, s in ((MaskSpec(causal=True, window=37), None), (MaskSpec(causal=True), seg)):
        tensors, dout = make_inputs(batch, n, 2, 1, 16, bm + bn)
        check_against_reference(SigmoidFamilySpec(), mask, s, tensors, dout, torch.float32)


def test_window_of_one_key_sees_only_itself(nan_poison):
    """window=1: n_i = 1, so b_i = 0 and w_ii = sigmoid(s q_i.k_i)."""
    tensors, dout = make_inputs(2, 23, 2, 1, 16, 9)
    check_against_reference(SigmoidFamilySpec(), MaskSpec(causal=True, window=1), None, tensors, dout, torch.float32)


def test_fully_masked_rows_are_zero_with_zero_gradient(nan_poison):
    """Padding queries (segment id 0) output exactly 0 and pass no gradient; padding keys get none."""
    batch, n = 2, 23
    seg = torch.tensor([[1] * 8 + [-1] * 5 + [0] * 10, [0] * 23])
    tensors, dout = make_inputs(batch, n, 2, 1, 16, 5)
    for spec in (SigmoidFamilySpec(), SigmoidFamilySpec(bias=3.0)):  # sigmoid(3) ~ 0.95: no weight is ~0
        x = _as(tensors, torch.float32)
        out = sg.fused_attention(x["q"], x["k"], x["v"], spec, MaskSpec(causal=False), seg)
        out.backward(dout.float())
        padding = seg == 0
        for t in (out, x["q"].grad, x["k"].grad, x["v"].grad):
            assert torch.equal(t[padding], torch.zeros_like(t[padding]))
        assert out[~padding].abs().min() > 0 and x["k"].grad[~padding].abs().sum() > 0


def _expected_counts(mask, n, seg):
    """n_i by brute force over the dense mask (independent of the closed forms)."""
    return dense_mask(mask, n, seg).sum(dim=-1).double()


@pytest.mark.parametrize("mask_name,with_seg", [("causal", False), ("window", False), ("none", True),
                                                ("window", True)])
@pytest.mark.parametrize("bias", [None, -1.5])
def test_row_bias_read_off_the_kernel(mask_name, with_seg, bias, nan_poison):
    """q = 0 makes every visible weight sigmoid(b_i); with v = e_0, out_i[0] = n_i sigmoid(b_i): the
    kernel's b_i (-ln n_i, or the bias) and n_i under each mask, against the dense mask's counts."""
    batch, n, d = 2, 70, 16
    mask = MaskSpec(causal=True, window=20) if mask_name == "window" else MASKS[mask_name]
    seg = random_segment_ids(batch, n, torch.Generator().manual_seed(3), min_history=n // 3) if with_seg else None
    q = torch.zeros(batch, n, 2, d)
    k = torch.randn(batch, n, 1, d, generator=torch.Generator().manual_seed(4))
    v = torch.zeros(batch, n, 1, d)
    v[..., 0] = 1.0
    out = sg.fused_attention(q, k, v, SigmoidFamilySpec(bias=bias), mask, seg)[..., 0].double()
    counts = _expected_counts(mask, n, seg).expand(batch, n)[..., None].expand_as(out)
    b = -torch.log(counts.clamp_min(1)) if bias is None else torch.full_like(counts, bias)
    torch.testing.assert_close(out, counts * torch.sigmoid(b), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[counts == 0], torch.zeros_like(out[counts == 0]))
    if mask_name == "window":
        assert counts.max() == 20  # the window binds


@pytest.mark.parametrize("path", ["mufu", "newton", "poly"])
def test_saturated_weights_stay_finite(path, monkeypatch, nan_poison):
    """Scores far beyond fp32's exp2 range give weights 0 (newton: at most 2^-126) or exactly 1 and
    finite gradients, on every evaluation path the interpreter runs."""
    monkeypatch.setenv(sg.PATH_ENV, path)
    q = torch.zeros(1, 9, 2, 16)
    q[..., 0] = 1.0
    k = torch.zeros(1, 9, 1, 16)
    k[:, 0::2, :, 0] = 1e4
    k[:, 1::2, :, 0] = -1e4
    v = torch.randn(1, 9, 1, 16, generator=torch.Generator().manual_seed(2))
    x = {name: t.clone().requires_grad_() for name, t in {"q": q, "k": k, "v": v}.items()}
    out = sg.fused_attention(x["q"], x["k"], x["v"], SigmoidFamilySpec(), MaskSpec(causal=True))
    want = reference_attention(q.double(), k.double(), v.double(), SigmoidFamilySpec(), MaskSpec(causal=True))
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-6)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in x.values())


@pytest.mark.parametrize("mask,with_seg", [(MaskSpec(causal=True), False), (MaskSpec(causal=True, window=3), True),
                                           (MaskSpec(causal=False), True)])
def test_weights_are_the_sigmoid_of_the_family_logits(mask, with_seg):
    """The family unit's pieces agree: w = sigmoid(logits) over visible keys, with logits = y + b_i,
    y = s q.k and b_i the given bias or, when null, -ln(n_i) from the keys each query sees."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 7, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    seg = torch.tensor([[1, 1, 1, -1, -1, 0, 0], [1, 1, 1, 1, 1, -1, -1]]) if with_seg else None
    qk = torch.einsum("bihd,bjhd->bhij", q, k)
    n_visible = visible_key_counts(mask, 7, seg)[:, None]  # (B or 1, 1, N) against qk (B, H, N, N)
    for spec in (SigmoidFamilySpec(), SigmoidFamilySpec(bias=-0.5, sm_scale=0.3)):
        fam = family_of(spec)
        w = sigmoid_family_weights(q, k, spec, mask, seg)
        logits = fam.logits(spec, qk, 8, n_visible)
        if spec.bias is None:  # b_i = -ln(n_i) differs between rows: the logits carry it
            row_bias = -torch.log(n_visible.double().clamp_min(1.0))[..., None]
            torch.testing.assert_close(logits, qk * spec.scale(8) + row_bias, atol=0, rtol=0)
        want = torch.sigmoid(logits).masked_fill(~dense_mask(mask, 7, seg)[:, None], 0.0)
        assert torch.equal(w, want)
        assert torch.equal(fam.scores(spec, qk, 8), qk * spec.scale(8))
        assert fam.has_max_logit and fam.extra_inputs(spec) == ()


def test_rejects_unsupported_inputs():
    spec = SigmoidFamilySpec()
    q = torch.randn(1, 8, 2, 48)
    with pytest.raises(ValueError, match=r"head dim D must be one of .* for the sigmoid-family kernels, got 48"):
        sg.fused_attention(q, q, q, spec, MaskSpec(True))
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="temperature is only defined for the softmax family"):
        sg.fused_attention(q, q, q, spec, MaskSpec(True), None, torch.ones(1, 8))
    with pytest.raises(ValueError, match=r"extra has an unexpected key 'q2': the allowed keys for SigmoidFamilySpec"
                                         r"\(.*\) are none"):
        sg.fused_attention(q, q, q, spec, MaskSpec(True), extra={"q2": q})
    with pytest.raises(ValueError, match="dtype"):
        sg.fused_attention(q.double(), q.double(), q.double(), spec, MaskSpec(True))
    with pytest.raises(ValueError, match="spec must be a SigmoidFamilySpec, got ThresholdFamilySpec"):
        sg.fused_attention(q, q, q, attn.ThresholdFamilySpec(), MaskSpec(True))
    with pytest.raises(ValueError, match="dropout_p > 0 needs dropout_seed"):
        sg.fused_attention(q, q, q, spec, MaskSpec(True), dropout_p=0.1)


@pytest.mark.parametrize("bias", [float("nan"), float("inf"), "0", True])
def test_bias_must_be_a_finite_float_or_null(bias):
    with pytest.raises(ValueError, match=r"attn\.bias must be a finite float or null \(-ln\(n_i\)\)"):
        attn.get_variant("sigmoid").make_spec(bias=bias)


@pytest.mark.parametrize("sm_scale", [0.0, -1.0, float("inf"), "0.1"])
def test_sm_scale_must_be_positive_and_finite(sm_scale):
    with pytest.raises(ValueError, match=r"attn\.sm_scale must be > 0 and finite, or null"):
        attn.get_variant("sigmoid").make_spec(sm_scale=sm_scale)


def _op_args(with_seg):
    tensors, dout = make_inputs(1, 17, 2, 1, 16, 2)
    x = {name: t.float().requires_grad_() for name, t in tensors.items()}
    seg = random_segment_ids(1, 17, torch.Generator().manual_seed(1), min_history=17 // 3) if with_seg else None
    bounds = attn.segment_bounds(seg) if seg is not None else None
    return x, bounds, dout.float()


@pytest.mark.parametrize("with_seg,bias", [(False, None), (True, -1.0)])
def test_custom_op_matches_eager_path(with_seg, bias):
    """Eager calls run the impls, traced calls the op and its backward op (same implementation): the
    Function compiled (fullgraph) gives bitwise the eager Function's output and gradients."""
    x, bounds, dout = _op_args(with_seg)
    args = (x["q"], x["k"], x["v"], bounds, bias, 0.25, True, 0)
    results = []
    function = sg._ATTENTION.function.apply
    for fn in (function, torch.compile(function, fullgraph=True)):
        out = fn(*args)
        results.append((out, *torch.autograd.grad(out, list(x.values()), dout)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("with_seg,bias", [(False, None), (True, 0.5)])
def test_opcheck(with_seg, bias):
    x, bounds, dout = _op_args(with_seg)
    scalars = (bias, 0.25, True, 0)
    opcheck_launcher(sg.sigmoid_attention_op, (x["q"], x["k"], x["v"], bounds, *scalars))
    # the backward op is not differentiable itself (no double backward): plain inputs
    x = {name: t.detach() for name, t in x.items()}
    opcheck_launcher(sg.sigmoid_attention_backward_op, (dout, x["q"], x["k"], x["v"], bounds, *scalars))


def test_torch_compile_fullgraph_matches_eager():
    """A small block through attn.attention(backend='triton') compiles without graph breaks
    (fullgraph=True; aot_eager on CPU)."""
    torch._dynamo.reset()
    spec = attn.get_variant("sigmoid").make_spec()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 19, 32, generator=gen)
    proj = torch.randn(32, 3 * 32, generator=gen) / math.sqrt(32)

    def block(x, proj):
        q, k, v = (t.unflatten(-1, (2, 16)) for t in (x @ proj).split(32, dim=-1))
        out = attn.attention(F.rms_norm(q, (16,)), F.rms_norm(k, (16,)), v, spec, causal=True, backend="triton")
        return out.flatten(-2).square().mean()

    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        p = proj.clone().requires_grad_()
        loss = fn(x, p)
        loss.backward()
        results.append((loss.detach(), p.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)
