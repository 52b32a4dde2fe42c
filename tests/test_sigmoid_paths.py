"""The sigmoid kernels' evaluation paths (attn/kernels/sigmoid_family.py, ATTNLAB_SIGMOID_PATH) and
the MUFU-sparing functions they use (attn/kernels/fast_math.py), under TRITON_INTERPRET=1.

The functions against float64 over the whole fp32 range (relative error bounds, saturation, inf and
NaN); the kernels with each path forced (newton and poly run on the CPU as plain tl arithmetic;
mufu_approx is PTX, GPU only) against the float64 reference by the DESIGN.md §6 rule, forward and
every gradient, in fp32 and fp16, and the split-key decode forward.
"""

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from test_kernels_longer_keys import check as check_longer_keys  # noqa: E402
from test_sigmoid_kernels import MASKS, check_against_reference, make_inputs  # noqa: E402

from attn.kernels import runtime  # noqa: E402
from attn.kernels import sigmoid_family as sg  # noqa: E402
from attn.kernels.fast_math import exp2_poly, rcp_newton  # noqa: E402
from attn.masks import MaskSpec  # noqa: E402
from attn.reference import reference_attention  # noqa: E402
from attn.specs import SigmoidFamilySpec  # noqa: E402
from attn.testing import random_segment_ids  # noqa: E402

BLOCK = 1024


@triton.jit
def _elementwise_kernel(X, Y, n, FUNCTION: tl.constexpr, PARAM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=1.0)
    if FUNCTION == "exp2_poly":
        y = exp2_poly(x, PARAM)
    elif FUNCTION == "rcp_newton":
        y = rcp_newton(x, PARAM)
    else:  # the sigmoid of path PARAM: (NEWTON, EXP2_POLY)
        y = sg._sigmoid2(x, PARAM[0], PARAM[1], False)
    tl.store(Y + offs, y, mask=offs < n)


def elementwise(function, param, x):
    x = x.float().contiguous()
    y = torch.full_like(x, 123.0)
    _elementwise_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), function, param, BLOCK)
    return y


def _relative_error(got, want):
    return ((got.double() - want) / want).abs().max().item()


def _within(got, want, relative, absolute=2.0 ** -22):
    """|got - want| <= relative |want| + absolute everywhere (absolute: fp32's rounding of a value
    near 1 that the quantity is read off: a few of its ulps)."""
    return bool(((got.double() - want).abs() <= relative * want.abs() + absolute).all())


def _grid(lo, hi, n=200_001):
    """Evenly spaced fp32 points plus random ones (every mantissa pattern, not only a lattice)."""
    gen = torch.Generator().manual_seed(int(hi - lo))
    return torch.cat([torch.linspace(lo, hi, n), lo + (hi - lo) * torch.rand(n, generator=gen)])


# the bounds the module docstrings state (measured: degree 3 1.01e-4, 4 2.87e-6, 6 9.2e-8)
EXP2_BOUNDS = {3: 1.02e-4, 4: 2.9e-6, 6: 1.2e-7}


@pytest.mark.parametrize("degree", sorted(EXP2_BOUNDS))
def test_exp2_poly_relative_error_and_saturation(degree):
    x = _grid(-125.0, 127.49)
    y = elementwise("exp2_poly", degree, x)
    assert _relative_error(y, torch.exp2(x.double())) <= EXP2_BOUNDS[degree]
    ints = torch.arange(-125, 128, dtype=torch.float32)
    assert torch.equal(elementwise("exp2_poly", degree, ints), torch.exp2(ints))  # exact at integers
    big = torch.tensor([127.5, 128.0, 128.4, 1e4, 3e38, float("inf")])
    assert torch.equal(elementwise("exp2_poly", degree, big), torch.full_like(big, float("inf")))
    tiny = torch.tensor([-125.0, -125.4, -126.0, -200.0, -3e38, float("-inf")])
    floor = elementwise("exp2_poly", degree, tiny)
    assert torch.equal(floor, torch.full_like(tiny, 2.0 ** -125))  # 1 + 2^x == 1 there
    assert torch.equal(1.0 + floor, torch.ones_like(floor))
    assert torch.isnan(elementwise("exp2_poly", degree, torch.tensor([float("nan")]))).all()


NEWTON_BOUNDS = {2: 2.45e-4, 3: 1.4e-7}


@pytest.mark.parametrize("steps", sorted(NEWTON_BOUNDS))
def test_rcp_newton_relative_error(steps):
    d = torch.cat([_grid(1.0, 2.0), torch.exp2(_grid(0.0, 126.0, 50_001))])
    got = elementwise("rcp_newton", steps, d)
    want = 1.0 / d.double()
    assert _relative_error(got, want) <= NEWTON_BOUNDS[steps]
    powers = torch.exp2(torch.arange(0, 127, dtype=torch.float32))
    assert torch.equal(elementwise("rcp_newton", steps, powers), 1.0 / powers)  # exact: 1 stays 1
    # near d = 1 the error shrinks with d - 1, so 1 - 1/d keeps its relative accuracy (2 steps: at most
    # 5.2e-4 at d ~ 1.43, twice the bound of 1/d)
    d = 1.0 + torch.exp2(-_grid(1.0, 23.0, 20_001))
    got = elementwise("rcp_newton", steps, d)
    assert _within(1.0 - got.double(), 1.0 - 1.0 / d.double(), 2.5 * NEWTON_BOUNDS[steps])
    assert torch.isnan(elementwise("rcp_newton", steps, torch.tensor([float("nan")]))).all()


# (NEWTON steps, EXP2_POLY degree) of each CPU-runnable path and dtype, and its bounds for w, 1 - w
SIGMOID_PATHS = {"mufu": ((0, 0), 3e-7), "newton-bf16": ((2, 0), 5.3e-4), "newton": ((3, 0), 3e-7),
                 "poly-bf16": ((0, 3), 1.1e-4), "poly-fp16": ((0, 4), 3.2e-6), "poly": ((0, 6), 3e-7)}


@pytest.mark.parametrize("path", list(SIGMOID_PATHS))
def test_sigmoid_paths_relative_error_and_saturation(path):
    """w = 1 / (1 + 2^x), x = -z log2 e: w and 1 - w relatively accurate wherever they are normal
    floats, w exactly 1 for x <= -25, exactly 0 (mufu, poly) or at most 2^-126 (newton) for x >= 128,
    NaN for NaN."""
    param, bound = SIGMOID_PATHS[path]
    x = _grid(-40.0, 124.0)
    w = elementwise("sigmoid", param, x).double()
    want = torch.sigmoid(-x.double() * 0.6931471805599453)
    assert _relative_error(w, want) <= bound
    near_one = x < 0.0  # 1 - w = 2^x / (1 + 2^x), read off w as the kernels do (dz = dp w (1 - w))
    assert _within(1.0 - w[near_one], 1.0 - want[near_one], 2.5 * bound)
    ones = torch.tensor([-25.0, -60.0, -130.0, -1e4, float("-inf")])
    assert torch.equal(elementwise("sigmoid", param, ones), torch.ones_like(ones))
    zeros = elementwise("sigmoid", param, torch.tensor([128.0, 200.0, 1e4, 3e38, float("inf")]))
    assert (zeros >= 0).all() and (zeros <= 2.0 ** -126).all()
    if param[0] == 0:
        assert torch.equal(zeros, torch.zeros_like(zeros))
    assert torch.isnan(elementwise("sigmoid", param, torch.tensor([float("nan")]))).all()


def test_path_selection(monkeypatch):
    """auto: mufu in the interpreter whatever the dtype; a forced path takes the dtype's accuracy."""
    monkeypatch.delenv(sg.PATH_ENV, raising=False)
    for dtype in (torch.float32, torch.float16):
        for forward in (True, False):
            assert sg.sigmoid_path(dtype, forward) == {"NEWTON": 0, "EXP2_POLY": 0, "FAST_MUFU": False}
    monkeypatch.setenv(sg.PATH_ENV, "newton")
    assert sg.sigmoid_path(torch.float16, True) == {"NEWTON": 3, "EXP2_POLY": 0, "FAST_MUFU": False}
    monkeypatch.setenv(sg.PATH_ENV, "poly")
    assert sg.sigmoid_path(torch.bfloat16, False) == {"NEWTON": 0, "EXP2_POLY": 3, "FAST_MUFU": False}
    monkeypatch.setattr(sg, "interpreting", lambda: False)  # as on a GPU
    monkeypatch.delenv(sg.PATH_ENV)
    assert sg.sigmoid_path(torch.bfloat16, True) == {"NEWTON": 2, "EXP2_POLY": 0, "FAST_MUFU": True}
    assert sg.sigmoid_path(torch.bfloat16, False) == {"NEWTON": 0, "EXP2_POLY": 0, "FAST_MUFU": True}
    assert sg.sigmoid_path(torch.float32, True) == {"NEWTON": 0, "EXP2_POLY": 0, "FAST_MUFU": False}
    monkeypatch.setenv(sg.PATH_ENV, "mufu")
    assert sg.sigmoid_path(torch.float16, True) == {"NEWTON": 0, "EXP2_POLY": 0, "FAST_MUFU": False}
    monkeypatch.setenv(sg.PATH_ENV, "fast")
    with pytest.raises(ValueError, match="ATTNLAB_SIGMOID_PATH must be one of auto, mufu, mufu_approx, newton, "
                                         "poly, got 'fast'"):
        sg.sigmoid_path(torch.float16, True)


# (n, heads, kv_heads, d, bias, sm_scale, spread, mask, with_seg, dtype): odd lengths, every mask
# kind, GQA, the null bias (-ln n_i) and given ones, saturating scores (spread 3)
CASES = [
    (17, 2, 1, 16, None, None, 1.0, "causal", False, torch.float32),
    (33, 2, 2, 16, None, None, 1.0, "causal", False, torch.float16),
    (45, 4, 1, 16, None, None, 1.0, "none", True, torch.float32),
    (45, 2, 2, 16, -2.0, None, 1.0, "causal", True, torch.float16),
    (70, 2, 1, 16, None, None, 1.0, "window", False, torch.float32),
    (21, 2, 1, 64, 1.0, None, 1.0, "window", True, torch.float16),
    (33, 2, 1, 16, None, None, 3.0, "causal", False, torch.float32),
    (33, 2, 1, 16, 0.0, 0.2, 3.0, "window", False, torch.float16),
]


@pytest.mark.parametrize("path", ["newton", "poly"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-H{c[1]}/{c[2]}-D{c[3]}-b{c[4]}-{c[7]}"
                                                     f"{'+seg' if c[8] else ''}-{str(c[9])[6:]}")
def test_forced_path_matches_float64_reference(path, case, monkeypatch, nan_poison):
    n, heads, kv_heads, d, bias, sm_scale, spread, mask_name, with_seg, dtype = case
    monkeypatch.setenv(sg.PATH_ENV, path)
    seed = n * 31 + heads + d + int(with_seg)
    batch = 2
    spec = SigmoidFamilySpec(bias=bias, sm_scale=sm_scale)
    seg = random_segment_ids(batch, n, torch.Generator().manual_seed(seed), min_history=n // 3) if with_seg else None
    tensors, dout = make_inputs(batch, n, heads, kv_heads, d, seed, spread=spread)
    check_against_reference(spec, MASKS[mask_name], seg, tensors, dout, dtype)


@pytest.mark.parametrize("path", ["newton", "poly"])
def test_forced_path_split_key_decode_forward(path, monkeypatch, nan_poison):
    """Few queries against longer keys, keys split into 3 ranges (the forward's SPLIT_KV form)."""
    monkeypatch.setenv(sg.PATH_ENV, path)
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, "3")
    check_longer_keys("sigmoid", MaskSpec(causal=True, window=30), 3, 45, 2, seed=5)
    check_longer_keys("sigmoid", MaskSpec(causal=False), 16, 40, 1, torch.float16, seed=6)

