"""The float64 PyTorch reference of every variant against independent computations.

Everything here is checked against code written in this file from DESIGN.md §3-§4 alone:
plain Python loops over (b, h, i, j) with `math` on Python floats, an explicit visibility
rule, literal expected masks, and finite differences. Nothing is compared with
attn/ code against itself. CPU only, float64, small shapes.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from attn.caps import alsc_cap, apply_cap, soft_sign_cap, tanh_cap
from attn.masks import MaskSpec, dense_mask, segment_bounds, visible_key_counts
from attn.reference import (
    reference_attention,
    softmax_family_weights,
    threshold_family_weights,
    threshold_tau,
)
from attn.registry import get_variant

F64 = torch.float64

# Softmax-family reference vs the loops: both are float64, only summation order differs.
SOFTMAX_ATOL = 1e-12
SOFTMAX_TOL = dict(rtol=0, atol=SOFTMAX_ATOL)
# Threshold family: tau is computed in the inputs' dtype, so float64 throughout as well.
THRESHOLD_ATOL = SOFTMAX_ATOL
THRESHOLD_TOL = SOFTMAX_TOL


# ----------------------------------------------------------------------------------------
# Independent ground truth: visibility rule, caps and attention as loops over floats
# ----------------------------------------------------------------------------------------

def loop_visible(i: int, j: int, causal: bool, window: int | None, seg_row) -> bool:
    """DESIGN.md §3 read literally: every enabled rule must allow key j for query i."""
    if (causal or window is not None) and j > i:
        return False
    if window is not None and not (i - window < j):
        return False
    if seg_row is not None:
        query_kind, key_kind = seg_row[i], seg_row[j]
        if query_kind == 1:  # history query: history keys only
            return key_kind == 1
        if query_kind == -1:  # candidate query: history keys and itself
            return key_kind == 1 or i == j
        return False  # padding query sees nothing (and padding keys fail both rules above)
    return True


def loop_mask(n, causal, window, seg):
    """(B or 1, N, N) bool built from `loop_visible`."""
    rows = seg.tolist() if seg is not None else [None]
    return torch.tensor(
        [[[loop_visible(i, j, causal, window, r) for j in range(n)] for i in range(n)] for r in rows],
        dtype=torch.bool,
    )


def math_cap(y: float, method: str, c: float, kappa: float) -> float:
    if method == "none":
        return y
    if method == "tanh":
        return c * math.tanh(y / c)
    if method == "soft_sign":
        return y / (1.0 + abs(y) / c)
    if method == "alsc":
        a = kappa * c
        if abs(y) <= a:
            return y
        return math.copysign(a + (c - a) * math.tanh((abs(y) - a) / (c - a)), y)
    raise AssertionError(method)


def dot(x, y) -> float:
    return sum(a * b for a, b in zip(x, y))


def loop_attention(q, k, v, *, family, causal=True, window=None, seg=None, temperature=None,
                   cap="none", c=30.0, kappa=0.5, sm_scale=None, beta=1.0, p=2.0,
                   q2=None, k2=None, lam=None):
    """out (B, N, H, D) from DESIGN.md §4 with Python floats; kv head of query head h is
    h // (H / H_kv) (consecutive query heads share a kv head)."""
    B, N, H, D = q.shape
    group = H // k.shape[2]
    Q, K, V = q.tolist(), k.tolist(), v.tolist()
    Q2 = q2.tolist() if q2 is not None else None
    K2 = k2.tolist() if k2 is not None else None
    T = temperature.tolist() if temperature is not None else None
    L = lam.tolist() if lam is not None else None
    S = seg.tolist() if seg is not None else None
    s = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = [[[[0.0] * D for _ in range(H)] for _ in range(N)] for _ in range(B)]
    for b in range(B):
        for i in range(N):
            keys = [j for j in range(N) if loop_visible(i, j, causal, window, S[b] if S else None)]
            for h in range(H):
                kh = h // group
                if not keys:
                    continue  # fully masked row: output stays 0
                if family == "softmax":
                    t = T[b][i] if T is not None else 1.0
                    z = [t * math_cap(s * dot(Q[b][i][h], K[b][j][kh]), cap, c, kappa) for j in keys]
                    m = max(z)
                    e = [math.exp(x - m) for x in z]
                    total = sum(e)
                    weights = [x / total for x in e]
                else:
                    tau = beta * math.sqrt(2.0 * math.log(len(keys)) / D)
                    weights = []
                    for j in keys:
                        w = max(dot(Q[b][i][h], K[b][j][kh]) - tau, 0.0) ** p
                        if Q2 is not None:
                            w -= L[h] * max(dot(Q2[b][i][h], K2[b][j][kh]) - tau, 0.0) ** p
                        weights.append(w)
                for d in range(D):
                    out[b][i][h][d] = sum(w * V[b][j][kh][d] for w, j in zip(weights, keys))
    return torch.tensor(out, dtype=F64)


def seed(*parts) -> int:
    """Stable per-case seed (Python's hash() of str changes between processes)."""
    return zlib.crc32(repr(parts).encode())


def random_segment_ids(batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Ranker rows: optional left padding, history, candidates, right padding (random sizes)."""
    ids = torch.zeros(batch, n, dtype=torch.int64)
    for b in range(batch):
        left = int(torch.randint(0, n // 3 + 1, (1,), generator=gen))
        hist = int(torch.randint(0, n - left + 1, (1,), generator=gen))
        cand = int(torch.randint(0, n - left - hist + 1, (1,), generator=gen))
        ids[b, left:left + hist] = 1
        ids[b, left + hist:left + hist + cand] = -1
    return ids


def ranker_rows(n: int) -> torch.Tensor:
    """Fixed, deliberately varied layouts of length n (n >= 8)."""
    h = n // 2
    rows = [
        [1] * h + [-1] * (n - h - 3) + [0] * 3,  # history, candidates, right padding
        [0] * 2 + [1] * (h - 2) + [-1] * (n - h),  # left padding
        [-1] * 3 + [1] * (n - 5) + [0] * 2,  # candidates before history
        [0] * n,  # nothing but padding
        [1] * n,  # history only
        [-1] * (n - 1) + [0],  # candidates only
    ]
    return torch.tensor(rows, dtype=torch.int64)


# variant name -> (family, make_spec kwargs, loop kwargs)
VARIANTS = {
    "softmax": ("softmax", {}, dict(cap="none")),
    "softcap_tanh": ("softmax", dict(cap=1.5), dict(cap="tanh", c=1.5)),
    "softcap_softsign": ("softmax", dict(cap=1.5), dict(cap="soft_sign", c=1.5)),
    "alsc": ("softmax", dict(cap=2.0, knee=0.4), dict(cap="alsc", c=2.0, kappa=0.4)),
    "threshold_p1": ("threshold", dict(beta=0.9, power=1.0), dict(beta=0.9, p=1.0)),
    "threshold_p2": ("threshold", dict(beta=1.0, power=2.0), dict(beta=1.0, p=2.0)),
    "threshold_p1.5": ("threshold", dict(beta=0.7, power=1.5), dict(beta=0.7, p=1.5)),
    "diff_threshold": ("threshold", dict(beta=0.8, power=1.5), dict(beta=0.8, p=1.5)),
}


def registry_name(case: str) -> str:
    return "threshold" if case.startswith("threshold_") else case


def make_inputs(case, b, n, h, h_kv, d, gen, *, temperature=False, logit_scale=3.0):
    """float64 inputs; q is scaled so the caps bind and thresholds leave dense and empty rows."""
    q = torch.randn(b, n, h, d, dtype=F64, generator=gen) * (logit_scale if VARIANTS[case][0] == "softmax" else 0.8)
    k = torch.randn(b, n, h_kv, d, dtype=F64, generator=gen)
    v = torch.randn(b, n, h_kv, d, dtype=F64, generator=gen)
    extra = {}
    if temperature:
        extra["temperature"] = torch.rand(b, n, dtype=F64, generator=gen) * 1.5 + 0.5
    if case == "diff_threshold":
        extra["q2"] = torch.randn(b, n, h, d, dtype=F64, generator=gen) * 0.8
        extra["k2"] = torch.randn(b, n, h_kv, d, dtype=F64, generator=gen)
        extra["lam"] = torch.rand(h, dtype=F64, generator=gen) * 0.9 + 0.05
    return q, k, v, extra


def family_extra(extra: dict) -> dict:
    """The family's `extra` mapping among make_inputs' tensors: all but the temperature."""
    return {key: t for key, t in extra.items() if key != "temperature"}


def run_both(case, q, k, v, extra, *, causal=True, window=None, seg=None):
    family, spec_kwargs, loop_kwargs = VARIANTS[case]
    spec = get_variant(registry_name(case)).make_spec(**spec_kwargs)
    got = reference_attention(q, k, v, spec, MaskSpec(causal=causal, window=window), seg,
                              extra.get("temperature"), extra=family_extra(extra))
    want = loop_attention(q, k, v, family=family, causal=causal, window=window, seg=seg, **loop_kwargs, **extra)
    return got, want, (SOFTMAX_TOL if family == "softmax" else THRESHOLD_TOL)


# ----------------------------------------------------------------------------------------
# Formulas
# ----------------------------------------------------------------------------------------

SOFTMAX_CASES = [c for c, (f, _, _) in VARIANTS.items() if f == "softmax"]
THRESHOLD_CASES = [c for c, (f, _, _) in VARIANTS.items() if f == "threshold"]


@pytest.mark.parametrize("n", [1, 5, 17])
@pytest.mark.parametrize("h_kv", [1, 2, 4])
@pytest.mark.parametrize("with_temperature", [False, True])
@pytest.mark.parametrize("case", SOFTMAX_CASES)
def test_softmax_family_matches_loops(case, with_temperature, h_kv, n):
    gen = torch.Generator().manual_seed(seed(case, with_temperature, h_kv, n))
    q, k, v, extra = make_inputs(case, 2, n, 4, h_kv, 8, gen, temperature=with_temperature)
    got, want, tol = run_both(case, q, k, v, extra)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("n", [1, 5, 17])
@pytest.mark.parametrize("h_kv", [1, 2, 4])
@pytest.mark.parametrize("case", THRESHOLD_CASES)
def test_threshold_family_matches_loops(case, h_kv, n):
    gen = torch.Generator().manual_seed(seed(case, h_kv, n))
    q, k, v, extra = make_inputs(case, 2, n, 4, h_kv, 8, gen)
    got, want, tol = run_both(case, q, k, v, extra)
    torch.testing.assert_close(got, want, **tol)
    if n == 17:  # the inputs exercise both sides of the threshold (otherwise the test is weak)
        w = threshold_family_weights(q, k, get_variant(registry_name(case)).make_spec(**VARIANTS[case][1]),
                                     MaskSpec(), None, extra.get("q2"), extra.get("k2"), extra.get("lam"))
        visible = dense_mask(MaskSpec(), n)[:, None].expand_as(w)
        assert 0.1 < (w[visible] == 0).double().mean() < 0.9


MASKS = {
    "full": dict(causal=False),
    "causal": dict(causal=True),
    "window3": dict(causal=True, window=3),
    "window1": dict(causal=True, window=1),
    "segments": dict(causal=True, seg=True),
    "segments_noncausal": dict(causal=False, seg=True),
    "window4_segments": dict(causal=True, window=4, seg=True),
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("case", list(VARIANTS))
def test_every_variant_under_every_mask_matches_loops(case, mask):
    n = 11
    gen = torch.Generator().manual_seed(seed(case, mask))
    kw = dict(MASKS[mask])
    seg = ranker_rows(n)[[0, 1, 2, 3]] if kw.pop("seg", False) else None
    b = 4 if seg is not None else 2
    q, k, v, extra = make_inputs(case, b, n, 4, 2, 8, gen, temperature=VARIANTS[case][0] == "softmax")
    got, want, tol = run_both(case, q, k, v, extra, seg=seg, **kw)
    torch.testing.assert_close(got, want, **tol)


def test_temperature_multiplies_after_the_cap():
    """z = t_i * cap(s q.k): with a binding cap, cap(t * y) would give a different answer."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, extra = make_inputs("softcap_tanh", 1, 9, 2, 2, 8, gen, temperature=True, logit_scale=6.0)
    t = extra["temperature"]
    spec = get_variant("softcap_tanh").make_spec(cap=1.5)
    got = reference_attention(q, k, v, spec, MaskSpec(), temperature=t)
    cap_first = loop_attention(q, k, v, family="softmax", cap="tanh", c=1.5, temperature=t)
    torch.testing.assert_close(got, cap_first, rtol=0, atol=SOFTMAX_ATOL)
    # the wrong order, cap(t * s q.k): fold query i's temperature into the scale, keep row i
    temp_first = torch.stack([
        loop_attention(q, k, v, family="softmax", cap="tanh", c=1.5, sm_scale=float(t[0, i]) / math.sqrt(8))[:, i]
        for i in range(9)
    ], dim=1)
    assert (got - temp_first).abs().max() > 1e-3


def test_softmax_rows_are_probability_distributions():
    gen = torch.Generator().manual_seed(6)
    q, k, _, extra = make_inputs("alsc", 2, 13, 4, 2, 8, gen, temperature=True)
    seg = ranker_rows(13)[[0, 3]]
    spec = get_variant("alsc").make_spec(cap=2.0, knee=0.4)
    w = softmax_family_weights(q, k, spec, MaskSpec(window=5), seg, extra["temperature"])
    visible = loop_mask(13, True, 5, seg)[:, None].expand_as(w)
    assert torch.all(w[~visible] == 0)
    assert torch.all(w[visible] > 0)
    row_sum = w.sum(-1)
    has_keys = visible.any(-1)
    torch.testing.assert_close(row_sum[has_keys], torch.ones_like(row_sum[has_keys]), rtol=0, atol=1e-14)
    assert torch.all(row_sum[~has_keys] == 0)


def test_gqa_uses_consecutive_query_heads_per_kv_head():
    """H=4, H_kv=2: query heads 0,1 read kv head 0; heads 2,3 read kv head 1."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, _ = make_inputs("softmax", 1, 6, 4, 2, 8, gen)
    spec = get_variant("softmax").make_spec()
    got = reference_attention(q, k, v, spec, MaskSpec())
    for h, kh in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        single = reference_attention(q[:, :, h:h + 1], k[:, :, kh:kh + 1], v[:, :, kh:kh + 1], spec, MaskSpec())
        torch.testing.assert_close(got[:, :, h:h + 1], single, rtol=0, atol=0)


def test_sm_scale_override_is_used():
    gen = torch.Generator().manual_seed(8)
    q, k, v, _ = make_inputs("softmax", 1, 7, 2, 1, 8, gen)
    spec = get_variant("softmax").make_spec(sm_scale=0.05)
    got = reference_attention(q, k, v, spec, MaskSpec())
    want = loop_attention(q, k, v, family="softmax", sm_scale=0.05)
    torch.testing.assert_close(got, want, rtol=0, atol=SOFTMAX_ATOL)
    default = reference_attention(q, k, v, get_variant("softmax").make_spec(), MaskSpec())
    assert (got - default).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------

def test_dense_mask_literal_examples():
    """Hand-written matrices, independent of both attn.masks and loop_visible."""
    causal4 = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(dense_mask(MaskSpec(causal=True), 4)[0], causal4)
    assert torch.equal(dense_mask(MaskSpec(causal=False), 4)[0], torch.ones(4, 4, dtype=torch.bool))
    window2 = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(dense_mask(MaskSpec(causal=False, window=2), 4)[0], window2)  # window implies causal
    # history 0..2, candidates 3..4, padding 5
    seg = torch.tensor([[1, 1, 1, -1, -1, 0]])
    ranker_causal = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],  # candidate 4 sees history and itself, not candidate 3
        [0, 0, 0, 0, 0, 0],  # padding sees nothing
    ], dtype=torch.bool)
    assert torch.equal(dense_mask(MaskSpec(causal=True), 6, seg)[0], ranker_causal)
    ranker_full = ranker_causal.clone()
    ranker_full[:3, :3] = True  # history is bidirectional without causal
    assert torch.equal(dense_mask(MaskSpec(causal=False), 6, seg)[0], ranker_full)
    ranker_window2 = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],  # history key 2 is outside the window of query 4
        [0, 0, 0, 0, 0, 0],
    ], dtype=torch.bool)
    assert torch.equal(dense_mask(MaskSpec(window=2), 6, seg)[0], ranker_window2)


@pytest.mark.parametrize("n", [1, 5, 17])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 1), (True, 4), (False, 4), (True, 40)])
@pytest.mark.parametrize("with_seg", [False, True])
def test_dense_mask_and_counts_match_loops(n, causal, window, with_seg):
    gen = torch.Generator().manual_seed(n * 100 + (window or 0) + 7 * causal)
    seg = random_segment_ids(6, n, gen) if with_seg else None
    if with_seg and n >= 8:
        seg = torch.cat([seg, ranker_rows(n)])
    spec = MaskSpec(causal=causal, window=window)
    mask = dense_mask(spec, n, seg)
    want = loop_mask(n, causal, window, seg)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, want)
    counts = visible_key_counts(spec, n, seg)
    assert counts.shape == (want.shape[0], n)
    assert torch.equal(counts, want.sum(-1).to(counts.dtype))
    if with_seg:
        padding = seg == 0
        assert not mask[padding].any()  # padding queries see nothing
        assert not mask.transpose(1, 2)[padding].any()  # padding keys are seen by nothing
        # every non-padding query sees at least itself, so only padding rows are ever empty
        assert torch.all(counts[~padding] >= 1)


def test_segment_bounds_examples():
    ids = torch.tensor([
        [1, 1, 1, -1, -1, 0, 0],
        [0, 0, 1, 1, -1, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [-1, -1, -1, 0, 0, 0, 0],
        [-1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, -1],
    ])
    want = torch.tensor([
        [0, 3, 3, 5],
        [2, 4, 4, 5],
        [0, 0, 0, 0],
        [0, 2, 0, 0],
        [0, 0, 0, 3],
        [1, 4, 0, 1],
        [0, 6, 6, 7],
    ], dtype=torch.int32)
    got = segment_bounds(ids)
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------
# Cap functions and ALSC properties
# ----------------------------------------------------------------------------------------

CAP_FNS = {
    "tanh": lambda y, c: tanh_cap(y, c),
    "soft_sign": lambda y, c: soft_sign_cap(y, c),
    "alsc": lambda y, c: alsc_cap(y, c, 0.5),
    "alsc_k0.9": lambda y, c: alsc_cap(y, c, 0.9),
}


@pytest.mark.parametrize("name", list(CAP_FNS))
def test_cap_functions_match_math_and_are_odd(name):
    c = 3.0
    y = torch.cat([torch.linspace(-40, 40, 801, dtype=F64), torch.tensor([0.0, 1e-300, 1e30, -1e30], dtype=F64)])
    f = CAP_FNS[name](y, c)
    method, kappa = ("alsc", 0.5) if name == "alsc" else ("alsc", 0.9) if name == "alsc_k0.9" else (name, 0.0)
    want = torch.tensor([math_cap(float(x), method, c, kappa) for x in y], dtype=F64)
    torch.testing.assert_close(f, want, rtol=1e-15, atol=1e-15)
    assert torch.equal(CAP_FNS[name](-y, c), -f)  # odd, exactly
    assert torch.all(f.abs() <= c)  # bounded (saturates to exactly c in floating point)
    moderate = y.abs() <= 5.0
    assert torch.all(f[moderate].abs() < c)  # strictly inside the cap where tanh has not saturated


@pytest.mark.parametrize("name", list(CAP_FNS))
def test_cap_functions_strictly_increasing(name):
    # over the range where float64 tanh has not saturated to 1 (beyond, f == c exactly)
    c = 3.0
    y = torch.linspace(-6, 6, 20001, dtype=F64, requires_grad=True)
    f = CAP_FNS[name](y, c)
    assert torch.all(f[1:] > f[:-1])
    (grad,) = torch.autograd.grad(f.sum(), y)
    assert torch.all(grad > 0)


def test_alsc_default_strictly_increasing_on_wide_range():
    c, kappa = 30.0, 0.5  # DESIGN defaults
    y = torch.linspace(-200, 200, 40001, dtype=F64)
    f = alsc_cap(y, c, kappa)
    assert torch.all(f[1:] > f[:-1])


@pytest.mark.parametrize("c,kappa", [(30.0, 0.5), (2.0, 0.0), (5.0, 0.25), (1.0, 0.9), (50.0, 0.99)])
def test_alsc_identity_on_knee_interval(c, kappa):
    a = kappa * c
    y = torch.cat([torch.linspace(-a, a, 1001, dtype=F64), torch.tensor([a, -a], dtype=F64)])
    assert torch.equal(alsc_cap(y, c, kappa), y)
    beyond = torch.tensor([a + 1e-3, -(a + 1e-3), a + c, 10 * c], dtype=F64)
    assert torch.all(alsc_cap(beyond, c, kappa).abs() < beyond.abs())  # compressed outside the knee


@pytest.mark.parametrize("c,kappa", [(30.0, 0.5), (2.0, 0.0), (5.0, 0.25), (1.0, 0.9)])
def test_alsc_bounded_by_cap_for_huge_inputs(c, kappa):
    y = torch.tensor([1e3, 1e8, 1e30, 1e300, -1e3, -1e300], dtype=F64)
    f = alsc_cap(y, c, kappa)
    assert torch.all(torch.isfinite(f))
    assert torch.all(f.abs() <= c)
    assert torch.equal(torch.sign(f), torch.sign(y))
    # just past the knee, the bound is strict and the value is close to the tanh form
    a = kappa * c
    mid = torch.tensor([a + 0.5 * (c - a), a + 5 * (c - a)], dtype=F64)
    assert torch.all(alsc_cap(mid, c, kappa) < c)


@pytest.mark.parametrize("c", [0.5, 2.0, 30.0])
def test_alsc_with_zero_knee_is_exactly_the_tanh_cap(c):
    y = torch.cat([torch.linspace(-10 * c, 10 * c, 2001, dtype=F64), torch.tensor([1e30, -1e30, 0.0], dtype=F64)])
    assert torch.equal(alsc_cap(y, c, 0.0), tanh_cap(y, c))
    y32 = y.float()
    assert torch.equal(alsc_cap(y32, c, 0.0), tanh_cap(y32, c))


def test_alsc_zero_knee_variant_equals_softcap_tanh_variant():
    gen = torch.Generator().manual_seed(11)
    q, k, v, extra = make_inputs("alsc", 2, 9, 4, 2, 8, gen, temperature=True)
    t = extra["temperature"]
    alsc = reference_attention(q, k, v, get_variant("alsc").make_spec(cap=1.5, knee=0.0), MaskSpec(), temperature=t)
    tanh = reference_attention(q, k, v, get_variant("softcap_tanh").make_spec(cap=1.5), MaskSpec(), temperature=t)
    assert torch.equal(alsc, tanh)


def test_alsc_leaves_moderate_logits_untouched_in_attention():
    """All |s q.k| <= a: ALSC attention equals plain softmax attention bit for bit."""
    gen = torch.Generator().manual_seed(12)
    q, k, v, _ = make_inputs("softmax", 2, 9, 4, 2, 8, gen, logit_scale=0.3)
    spec = get_variant("alsc").make_spec(cap=30.0, knee=0.5)
    assert (torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(2, 2)) / math.sqrt(8)).abs().max() < 15.0
    assert torch.equal(reference_attention(q, k, v, spec, MaskSpec()),
                       reference_attention(q, k, v, get_variant("softmax").make_spec(), MaskSpec()))


def _derivative(fn, y: float) -> float:
    t = torch.tensor(y, dtype=F64, requires_grad=True)
    (g,) = torch.autograd.grad(fn(t), t)
    return float(g)


def _second_derivative(fn, y: float) -> float:
    t = torch.tensor(y, dtype=F64, requires_grad=True)
    (g,) = torch.autograd.grad(fn(t), t, create_graph=True)
    (g2,) = torch.autograd.grad(g, t)
    return float(g2)


@pytest.mark.parametrize("c,kappa", [(30.0, 0.5), (2.0, 0.3), (5.0, 0.9), (1.0, 0.0)])
def test_alsc_derivatives_continuous_at_knee(c, kappa):
    a = kappa * c
    fn = lambda y: alsc_cap(y, c, kappa)  # noqa: E731
    for knee in (a, -a):
        inside = knee - math.copysign(1e-9, knee) if a > 0 else 0.0
        outside = knee + (1e-9 if knee >= 0 else -1e-9)
        d_in, d_out = _derivative(fn, inside), _derivative(fn, outside)
        assert d_in == pytest.approx(1.0, abs=1e-12)
        assert abs(d_in - d_out) < 1e-6
        assert abs(_second_derivative(fn, inside) - _second_derivative(fn, outside)) < 1e-6  # C^2
    # far from the knee the derivative is the analytic 1 - tanh^2
    y = a + 0.7 * (c - a)
    assert _derivative(fn, y) == pytest.approx(1 - math.tanh(0.7) ** 2, rel=1e-12)
    assert _derivative(fn, -y) == pytest.approx(1 - math.tanh(0.7) ** 2, rel=1e-12)


def test_apply_cap_dispatch():
    y = torch.linspace(-9, 9, 37, dtype=F64)
    assert torch.equal(apply_cap(y, "none", 2.0, 0.5), y)
    assert torch.equal(apply_cap(y, "tanh", 2.0, 0.5), tanh_cap(y, 2.0))
    assert torch.equal(apply_cap(y, "soft_sign", 2.0, 0.5), soft_sign_cap(y, 2.0))
    assert torch.equal(apply_cap(y, "alsc", 2.0, 0.5), alsc_cap(y, 2.0, 0.5))


# ----------------------------------------------------------------------------------------
# Fully masked rows and finiteness of gradients
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=False), dict(causal=True, window=2), dict(causal=True, window=1)])
@pytest.mark.parametrize("case", list(VARIANTS) + ["threshold_p0.5"])
def test_fully_masked_rows_zero_output_and_gradient(case, mask):
    n = 12
    seg = ranker_rows(n)[[0, 1, 3]]  # right padding, left padding, all padding
    gen = torch.Generator().manual_seed(seed(case, str(mask)))
    base = "threshold_p1.5" if case == "threshold_p0.5" else case
    q, k, v, extra = make_inputs(base, 3, n, 4, 2, 8, gen, temperature=VARIANTS[base][0] == "softmax")
    family, spec_kwargs, _ = VARIANTS[base]
    if case == "threshold_p0.5":
        spec_kwargs = dict(beta=0.7, power=0.5)
    spec = get_variant(registry_name(base)).make_spec(**spec_kwargs)
    padding = seg == 0
    # padding embeddings are often exactly zero: scores of 0 against tau = 0 sit exactly on
    # the threshold's kink, where a careless x**p (p < 1) backward gives 0 * inf = NaN
    for t in [q, k] + [extra[x] for x in ("q2", "k2") if x in extra]:
        t[padding] = 0.0
    leaves = [q, k, v] + [extra[x] for x in ("temperature", "q2", "k2", "lam") if x in extra]
    for t in leaves:
        t.requires_grad_(True)
    out = reference_attention(q, k, v, spec, MaskSpec(**mask), seg, extra.get("temperature"),
                              extra=family_extra(extra))
    assert torch.isfinite(out).all()
    assert torch.all(out[padding] == 0)
    assert out[~padding].abs().sum() > 0
    (out * torch.randn(out.shape, dtype=F64, generator=gen)).sum().backward()
    for t in leaves:
        assert t.grad is not None and torch.isfinite(t.grad).all()
    assert torch.all(q.grad[padding] == 0)  # nothing flows into a fully masked query
    assert torch.all(k.grad[padding] == 0) and torch.all(v.grad[padding] == 0)  # padding keys unseen
    if family == "softmax" and mask.get("window") == 1:
        # one visible key per row: weight 1 whatever q is, so q gets no gradient and out = v_i
        assert torch.all(q.grad == 0)
        torch.testing.assert_close(out[~padding], v.repeat_interleave(2, 2)[~padding], rtol=0, atol=0)
    else:
        assert q.grad[~padding].abs().sum() > 0
    if "q2" in extra:
        assert torch.all(extra["q2"].grad[padding] == 0)
        assert torch.all(extra["k2"].grad[padding] == 0)
    if "temperature" in extra:
        assert torch.all(extra["temperature"].grad[padding] == 0)


def test_huge_logits_give_finite_outputs_and_gradients():
    gen = torch.Generator().manual_seed(13)
    for case in SOFTMAX_CASES:
        q, k, v, _ = make_inputs(case, 1, 7, 2, 1, 8, gen, logit_scale=1e6)
        q.requires_grad_(True)
        out = reference_attention(q, k, v, get_variant(case).make_spec(**VARIANTS[case][1]), MaskSpec())
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(q.grad).all(), case


def test_threshold_rows_below_tau_are_exactly_zero():
    """Sink-free: a row whose scores all stay under tau outputs exactly 0 (no normalization)."""
    n, d = 6, 4
    q = torch.zeros(1, n, 1, d, dtype=F64)
    q[0, :, 0, 0] = 1.0
    k = torch.zeros(1, n, 1, d, dtype=F64)
    k[0, :, 0, 0] = 0.1  # x = 0.1 < tau_i for every i > 0 (tau_0 = 0, since n_0 = 1)
    v = torch.randn(1, n, 1, d, dtype=F64)
    out = reference_attention(q, k, v, get_variant("threshold").make_spec(power=1.0), MaskSpec())
    assert torch.all(out[0, 1:] == 0)
    torch.testing.assert_close(out[0, 0], 0.1 * v[0, 0], rtol=0, atol=1e-15)


# ----------------------------------------------------------------------------------------
# tau uses the number of visible keys
# ----------------------------------------------------------------------------------------

TAU_MASKS = [
    ("causal", MaskSpec(causal=True), False),
    ("full", MaskSpec(causal=False), False),
    ("window3", MaskSpec(window=3), False),
    ("ranker", MaskSpec(causal=True), True),
    ("ranker_window4", MaskSpec(window=4), True),
    ("ranker_full", MaskSpec(causal=False), True),
]


@pytest.mark.parametrize("name,mask,with_seg", TAU_MASKS, ids=[m[0] for m in TAU_MASKS])
@pytest.mark.parametrize("power", [1.0, 2.0])
def test_tau_revealed_by_output_uses_visible_key_count(name, mask, with_seg, power):
    """q_i = k_j = e_0 makes every score 1 and v_j = e_j makes out[i, j] = (1 - tau_i)^p
    for visible j and 0 otherwise: the output spells out the mask and tau row by row."""
    n, d, beta = 12, 16, 0.9
    seg = ranker_rows(n)[[0, 1, 2]] if with_seg else None
    b = 3 if with_seg else 1
    q = torch.zeros(b, n, 1, d, dtype=F64)
    q[..., 0] = 1.0
    k = q.clone()
    v = torch.eye(n, d, dtype=F64).expand(b, n, d)[:, :, None, :].clone()
    out = reference_attention(q, k, v, get_variant("threshold").make_spec(beta=beta, power=power), mask, seg)
    weights = out[:, :, 0, :n]  # (b, i, j)
    assert torch.all(out[..., n:] == 0)
    visible = loop_mask(n, mask.causal, mask.window, seg).expand(b, n, n)
    assert torch.all(weights[~visible] == 0)
    counts = visible.sum(-1)
    for bi in range(b):
        for i in range(n):
            if counts[bi, i] == 0:
                assert torch.all(weights[bi, i] == 0)
                continue
            tau_i = beta * math.sqrt(2 * math.log(int(counts[bi, i])) / d)
            want = (1 - tau_i) ** power
            got = weights[bi, i][visible[bi, i]]
            torch.testing.assert_close(got, torch.full_like(got, want), rtol=0, atol=THRESHOLD_ATOL)
    # under a window the counts are min(i + 1, W), not i + 1: the rows differ from plain causal
    if name == "window3":
        causal = reference_attention(q, k, v, get_variant("threshold").make_spec(beta=beta, power=power), MaskSpec())
        assert (causal[0, 5:] - out[0, 5:]).abs().max() > 1e-2


@pytest.mark.parametrize("name,mask,with_seg", TAU_MASKS, ids=[m[0] for m in TAU_MASKS])
def test_threshold_tau_with_visible_counts(name, mask, with_seg):
    n, d, beta = 13, 8, 1.3
    seg = ranker_rows(n) if with_seg else None
    counts = visible_key_counts(mask, n, seg)
    tau = threshold_tau(beta, d, counts)
    loop_counts = loop_mask(n, mask.causal, mask.window, seg).sum(-1)
    want = torch.tensor([[beta * math.sqrt(2 * math.log(c) / d) if c > 0 else 0.0 for c in row]
                         for row in loop_counts.tolist()], dtype=F64)
    torch.testing.assert_close(tau.double(), want, rtol=1e-6, atol=1e-7)
    assert torch.all(tau[loop_counts <= 1] == 0)  # ln 1 = 0; empty rows also get 0, never NaN


def test_threshold_tau_is_float64_exact_in_float64_reference():
    n, d = 17, 8
    q = torch.zeros(1, n, 1, d, dtype=F64)
    q[..., 0] = 1.0
    w = threshold_family_weights(q, q.clone(), get_variant("threshold").make_spec(beta=1.0, power=1.0), MaskSpec())
    want = torch.tensor([1 - math.sqrt(2 * math.log(i + 1) / d) for i in range(n)], dtype=F64)
    torch.testing.assert_close(w[0, 0].diagonal(), want, rtol=0, atol=1e-13)


# ----------------------------------------------------------------------------------------
# Gradients: differential lambda, gradcheck of every variant
# ----------------------------------------------------------------------------------------

def test_differential_lambda_gradient_matches_finite_differences_and_closed_form():
    gen = torch.Generator().manual_seed(21)
    n, h, d = 9, 4, 8
    q, k, v, extra = make_inputs("diff_threshold", 2, n, h, 2, d, gen)
    lam = extra["lam"].clone().requires_grad_(True)
    spec = get_variant("diff_threshold").make_spec(beta=0.8, power=1.5)
    mask = MaskSpec(window=6)
    g = torch.randn(2, n, h, d, dtype=F64, generator=gen)

    def loss(lam_value):
        second_view = {"q2": extra["q2"], "k2": extra["k2"], "lam": lam_value}
        return (reference_attention(q, k, v, spec, mask, None, None, extra=second_view) * g).sum()

    assert lam.requires_grad
    loss(lam).backward()
    assert lam.grad is not None and torch.all(lam.grad != 0)
    eps = 1e-6
    fd = torch.zeros(h, dtype=F64)
    for i in range(h):
        up, down = lam.detach().clone(), lam.detach().clone()
        up[i] += eps
        down[i] -= eps
        fd[i] = (loss(up) - loss(down)) / (2 * eps)
    torch.testing.assert_close(lam.grad, fd, rtol=1e-7, atol=1e-9)
    # closed form: dL/dlam_h = -sum_{b,i,j} relu(x2_ij - tau_i)^p (g_i . v_j); loss is linear in lam
    second_view_only = loop_attention(extra["q2"], extra["k2"], v, family="threshold", window=6, beta=0.8, p=1.5)
    closed = -(second_view_only * g).sum(dim=(0, 1, 3))
    torch.testing.assert_close(lam.grad, closed, rtol=1e-6, atol=1e-6)


GRADCHECK_CASES = list(VARIANTS) + ["threshold_p0.5"]


@pytest.mark.parametrize("case", GRADCHECK_CASES)
def test_gradcheck_reference(case):
    """Causal mask with ranker segments: covers dense rows, candidate isolation and a padding row."""
    gen = torch.Generator().manual_seed(seed(case, "gradcheck"))
    base = "threshold_p1.5" if case == "threshold_p0.5" else case
    family, spec_kwargs, _ = VARIANTS[base]
    if case == "threshold_p0.5":
        spec_kwargs = dict(beta=0.5, power=0.5)
    spec = get_variant(registry_name(base)).make_spec(**spec_kwargs)
    n = 5
    q, k, v, extra = make_inputs(base, 2, n, 2, 1, 3, gen, temperature=family == "softmax", logit_scale=1.5)
    seg = torch.tensor([[1, 1, -1, -1, 0], [0, 1, 1, 1, -1]])
    names = ["q", "k", "v"] + [x for x in ("temperature", "q2", "k2", "lam") if x in extra]
    inputs = tuple(t.clone().requires_grad_(True) for t in [q, k, v] + [extra[x] for x in names[3:]])

    def fn(*args):
        kw = dict(zip(names, args))
        return reference_attention(kw["q"], kw["k"], kw["v"], spec, MaskSpec(causal=True), seg,
                                   kw.get("temperature"), extra=family_extra({x: kw[x] for x in names[3:]}))

    if family == "threshold":
        # every visible score stays >= 1e-3 from tau_i, so finite differences never straddle
        # the kink, and both sides of the threshold occur (the check covers both branches)
        visible = loop_mask(n, True, None, seg)[:, None]
        counts = visible.sum(-1, keepdim=True).double()
        tau = spec.beta * torch.sqrt(2 * torch.log(counts.clamp_min(1)) / q.shape[-1])
        for qv, kv in [(q, k)] + ([(extra["q2"], extra["k2"])] if "q2" in extra else []):
            margin = torch.einsum("bihd,bjhd->bhij", qv, kv.expand(-1, -1, qv.shape[2], -1)) - tau
            margin = margin[visible.expand_as(margin)]
            assert margin.abs().min() > 1e-3
            assert (margin > 0).any() and (margin < 0).any()
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_exact_zero_fraction_by_hand():
    """Per head: exactly-zero weights among the visible (i, j), over batch and rows; a masked
    entry never counts, whatever its weight; a head without any visible entry gives 0, not NaN.
    (The threshold kernel's statistics are checked against this function.)"""
    from attn.reference import exact_zero_fraction

    visible = torch.tensor([[True, False, False], [True, True, False]])[None, None]  # (1, 1, N=2, KV=3): 3 visible
    weights = torch.zeros(2, 3, 2, 3)  # (B=2, H=3, 2, 3)
    weights[:, 0] = torch.tensor([[0.0, 5.0, 5.0], [0.5, 0.0, 0.0]])  # head 0: zeros at 2 of 3 visible, each batch
    weights[0, 1] = torch.tensor([[0.1, 0.0, 0.0], [-0.2, 0.3, 0.0]])  # head 1: none in batch 0 ...
    weights[1, 1] = torch.tensor([[0.0, 1.0, 1.0], [0.0, -1e-30, 7.0]])  # ... 2 of 3 in batch 1; -1e-30 is no zero
    weights[:, 2] = 1.0  # head 2: no zeros
    got = exact_zero_fraction(weights, visible)
    assert got.dtype == torch.float64 and got.shape == (3,)
    assert got.tolist() == [4 / 6, 2 / 6, 0.0]
    assert exact_zero_fraction(weights, torch.zeros_like(visible)).tolist() == [0.0, 0.0, 0.0]
    one_visible = torch.tensor([True, False])[None, None, None]  # a single visible entry, weight 0
    assert exact_zero_fraction(torch.zeros(1, 1, 1, 2), one_visible).tolist() == [1.0]


def test_threshold_weights_for_a_power_below_one():
    """p = 0.5 (any float > 0, DESIGN.md §4): relu(x - tau)^p over the visible keys, written out
    directly; the loop comparisons above use p >= 1 only."""
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randn(1, 9, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    w = threshold_family_weights(q, k, get_variant("threshold").make_spec(beta=0.5, power=0.5), MaskSpec())
    x = torch.einsum("bihd,bjhd->bhij", q, k)
    tau = 0.5 * torch.sqrt(2 * torch.log(torch.arange(1, 10, dtype=torch.float64)) / 8)[None, None, :, None]
    visible = dense_mask(MaskSpec(), 9)[:, None]
    want = torch.where(visible, torch.relu(x - tau) ** 0.5, torch.zeros_like(x))
    torch.testing.assert_close(w, want, rtol=1e-12, atol=0)
    assert 0.1 < (w[visible.expand_as(w)] == 0).double().mean() < 0.9  # both sides of the threshold


@pytest.mark.parametrize("name", ["softmax", "softcap_tanh", "sigmoid"])
def test_the_reference_backend_computes_float16_calls_in_float32(name):
    """Scores past float16's range (q.k up to 160000 here): the reference backend stays finite and
    within float16's rounding of the float64 result, through `attn.attention` and `AttentionCall`;
    `reference_attention` itself computes in float16 (the same-dtype yardstick), where the plain
    softmax's scores overflow (a cap or the sigmoid saturates them first)."""
    import attn

    gen = torch.Generator().manual_seed(seed("fp16-range", name))
    q, k, v = (torch.randn(1, 9, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    q, k = q.sign() * 100.0, k.sign() * 100.0
    spec = get_variant(name).make_spec(**({"cap": 30.0} if name == "softcap_tanh" else {}))
    want = reference_attention(q, k, v, spec, MaskSpec(causal=True))
    half = [t.half() for t in (q, k, v)]
    call = attn.AttentionCall(spec, causal=True, backend="reference")
    for got in (attn.attention(*half, spec, causal=True, backend="reference"), call(*half)):
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-3 * float(want.abs().max()) + 1e-3)
    same_dtype = reference_attention(*half, spec, MaskSpec(causal=True))
    assert torch.isfinite(same_dtype).all() == (name != "softmax")
