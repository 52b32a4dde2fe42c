"""The Gluon sm_90 threshold and sigmoid backwards (attn/kernels/gluon_weighted_bwd.py), natively on a Hopper
GPU (skipped elsewhere: Gluon has no interpreter; its CPU compile checks are in tests/test_gluon_compile.py).

dq, dk, dv of `gluon_threshold_backward` / `gluon_sigmoid_backward` after the portable or the Gluon forward,
against the float64 reference by the DESIGN.md section 6 rule (within 2x the error of the PyTorch reference
run in the kernel's dtype, plus a floor; for the threshold the floor also holds what one rounding of the
inputs moves the exact result by, as tests/test_threshold_kernels.py does: relu(x)^(p-1) jumps at tau for
p = 1), with torch.empty / empty_like NaN-poisoned so an element the kernels never write fails: odd lengths,
causal and full masks, more keys than queries (bottom-right causal), GQA, D 64 / 128, bf16 / fp16; thresholds
at p = 1, 2 and general p on unit-norm q and k (dense and empty rows: rows whose scores all stay below their
threshold pass exactly zero dq), sigmoid with the -ln n_i bias and a fixed one. The tests call the backwards
through an autograd.Function of their own (their calls through the public function are
tests/test_gluon_gpu.py's). Neither family has a learnable row parameter (beta, p and the bias are spec
constants): dq, dk, dv are every gradient there is. The persistent dK / dV and dQ kernels
(ATTNLAB_GLUON_PERSISTENT=1: a program per SM running work items in turn) must give the per-item kernels' bits
on the shapes and on more work items than SMs with a last work-item group of fewer pairs. The one-pass form
(dQ in the key-block kernel, `one_pass=True`) must be within the rule on every case and keep dk's and dv's bits.
"""

from __future__ import annotations

import os

import pytest
import torch

import attn
from attn.kernels import tiers
from attn.testing import outputs_and_grads, rounding_sensitivity
from gluon_cases import FLOORS, SHAPES
from tolerance import assert_within_reference_error

CUDA = torch.device("cuda")
# the portable kernels on their first tile config (conftest)
pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() and tiers.gluon_usable(CUDA)),
                                 reason="needs an sm_90 GPU and Triton's Gluon Hopper API"),
              pytest.mark.usefixtures("first_tile_configs")]

# (variant, spec parameters, shape)
CASES = [
    ("threshold", {}, SHAPES[0]),
    ("threshold", {}, SHAPES[2]),
    ("threshold", {"power": 1.0}, SHAPES[1]),
    ("threshold", {"power": 1.0}, SHAPES[4]),
    ("threshold", {"power": 1.5, "beta": 0.5}, SHAPES[4]),
    ("threshold", {"power": 3.0}, SHAPES[3]),
    ("threshold", {"beta": 2.0}, SHAPES[5]),
    ("threshold", {"power": 1.5}, SHAPES[6]),
    ("threshold", {}, SHAPES[7]),
    ("sigmoid", {}, SHAPES[0]),
    ("sigmoid", {}, SHAPES[1]),
    ("sigmoid", {}, SHAPES[3]),
    ("sigmoid", {}, SHAPES[4]),
    ("sigmoid", {"bias": -2.0}, SHAPES[5]),
    ("sigmoid", {"bias": -4.0}, SHAPES[6]),
    ("sigmoid", {}, SHAPES[7]),
]


def _portable_forward(variant, spec, q, k, v, causal):
    """The portable forward's output (ATTNLAB_GLUON=0 for the call)."""
    from attn.kernels import sigmoid_family, threshold_family

    old = os.environ.get(tiers.GLUON_ENV)
    os.environ[tiers.GLUON_ENV] = "0"
    try:
        if variant == "threshold":
            return threshold_family._forward_impl(q, k, v, None, None, None, None, float(spec.beta),
                                                  float(spec.power), causal, 0)
        return sigmoid_family._forward_impl(q, k, v, None, spec.bias, float(spec.scale(q.shape[-1])), causal, 0)
    finally:
        if old is None:
            os.environ.pop(tiers.GLUON_ENV)
        else:
            os.environ[tiers.GLUON_ENV] = old


class _GluonWeightedBackward(torch.autograd.Function):
    """Threshold or sigmoid attention whose forward is the portable or the Gluon kernel and whose backward
    is the Gluon backward (the way the families' backward plans would call it)."""

    @staticmethod
    def forward(ctx, q, k, v, variant, spec, causal, forward_tier, one_pass=False):
        from attn.kernels import gluon_weighted_fwd

        if forward_tier == "portable":
            out = _portable_forward(variant, spec, q, k, v, causal)
        elif variant == "threshold":
            out = gluon_weighted_fwd.gluon_threshold_forward(q, k, v, causal, float(spec.beta), float(spec.power))
        else:
            out = gluon_weighted_fwd.gluon_sigmoid_forward(q, k, v, causal, float(spec.scale(q.shape[-1])), spec.bias)
        ctx.save_for_backward(q, k, v)
        ctx.variant, ctx.spec, ctx.causal, ctx.one_pass = variant, spec, causal, one_pass
        return out

    @staticmethod
    def backward(ctx, dout):
        from attn.kernels.gluon_weighted_bwd import gluon_sigmoid_backward, gluon_threshold_backward

        q, k, v = ctx.saved_tensors
        spec = ctx.spec
        if ctx.variant == "threshold":
            dq, dk, dv = gluon_threshold_backward(q, k, v, dout, ctx.causal, float(spec.beta), float(spec.power),
                                                  one_pass=ctx.one_pass)
        else:
            dq, dk, dv = gluon_sigmoid_backward(q, k, v, dout, ctx.causal, float(spec.scale(q.shape[-1])),
                                                spec.bias, one_pass=ctx.one_pass)
        return dq, dk, dv, None, None, None, None, None


def _inputs(shape, variant, seed):
    b, n, kv, h, h_kv, d = shape[:6]
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    q = torch.randn(b, n, h, d, device=CUDA, dtype=torch.float64, generator=gen)
    k = torch.randn(b, kv, h_kv, d, device=CUDA, dtype=torch.float64, generator=gen)
    v = torch.randn(b, kv, h_kv, d, device=CUDA, dtype=torch.float64, generator=gen)
    do = torch.randn(b, n, h, d, device=CUDA, dtype=torch.float64, generator=gen)
    if variant == "threshold":  # cosine scores, as the threshold model feeds them: thresholds that bind
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    return {"q": q, "k": k, "v": v}, do


def _case_id(case):
    variant, params, c = case
    extra = "".join(f"-{name}{value}" for name, value in params.items())
    return (f"{variant}{extra}-B{c[0]}-N{c[1]}-KV{c[2]}-H{c[3]}/{c[4]}-D{c[5]}-{'causal' if c[6] else 'full'}-"
            f"{str(c[7])[6:]}")


def _check(case, forward_tier, seed, one_pass=False):
    variant, params, shape = case
    causal, dtype = shape[6], shape[7]
    spec = attn.get_variant(variant).make_spec(**params)
    tensors, do = _inputs(shape, variant, seed)

    def reference(q, k, v):
        return attn.attention(q, k, v, spec, causal=causal, backend="reference")

    ref64 = outputs_and_grads(reference, {name: t.clone().requires_grad_() for name, t in tensors.items()}, do)
    same = outputs_and_grads(reference, {name: t.to(dtype).requires_grad_() for name, t in tensors.items()}, do)
    fused = outputs_and_grads(
        lambda q, k, v: _GluonWeightedBackward.apply(q, k, v, variant, spec, causal, forward_tier, one_pass),
        {name: t.to(dtype).requires_grad_() for name, t in tensors.items()}, do)
    sensitivity = (rounding_sensitivity(reference, tensors, do, dtype) if variant == "threshold"
                   else dict.fromkeys(ref64, 0.0))
    for name in ("out", "dq", "dk", "dv"):
        assert fused[name].dtype == dtype and fused[name].shape == ref64[name].shape, name
        allowance = FLOORS[dtype] * max(1.0, ref64[name].abs().max().item()) + sensitivity[name]
        assert_within_reference_error(name, fused[name], same[name], ref64[name], floor=allowance)
    return fused, ref64


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_gluon_backward_after_the_portable_forward_is_within_the_rule(case, nan_poison):
    _check(case, "portable", seed=CASES.index(case))


@pytest.mark.parametrize("case", CASES[::3], ids=[_case_id(c) for c in CASES[::3]])
def test_gluon_backward_after_the_gluon_forward_is_within_the_rule(case, nan_poison):
    _check(case, "gluon", seed=100 + CASES.index(case))


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_the_one_pass_backward_is_within_the_rule_and_keeps_dk_dv_bits(case, nan_poison):
    """The one-pass form (dQ in the key-block kernel by TMA reduce-adds into an fp32 dq, then a scale-and-cast):
    dq, dk, dv within the rule on every case, and dk, dv the separate form's bits (the key-block loop's own
    products are unchanged; only dq's sums run in another order)."""
    from attn.kernels.gluon_weighted_bwd import gluon_sigmoid_backward, gluon_threshold_backward

    _check(case, "portable", seed=200 + CASES.index(case), one_pass=True)
    variant, params, shape = case
    spec = attn.get_variant(variant).make_spec(**params)
    tensors, do = _inputs(shape, variant, 300 + CASES.index(case))
    q, k, v = (tensors[name].to(shape[7]) for name in ("q", "k", "v"))
    do = do.to(shape[7])
    if variant == "threshold":
        def run(one_pass):
            return gluon_threshold_backward(q, k, v, do, shape[6], float(spec.beta), float(spec.power),
                                            one_pass=one_pass)
    else:
        def run(one_pass):
            return gluon_sigmoid_backward(q, k, v, do, shape[6], float(spec.scale(q.shape[-1])), spec.bias,
                                          one_pass=one_pass)
    (_, dk, dv), (_, dk1, dv1) = run(False), run(True)
    assert torch.equal(dk, dk1) and torch.equal(dv, dv1)


@pytest.mark.parametrize("power", [1.0, 2.0, 1.5])
def test_threshold_rows_below_their_threshold_get_zero_dq(power, nan_poison):
    """Unit-norm cases keep weights in some rows and none in others; a row whose float64 scores all stay
    below its threshold by more than the 16-bit scores' rounding (1e-2) gets exactly zero dq."""
    b, n, kv, h, h_kv, d, causal, dtype = shape = SHAPES[7]
    fused, ref64 = _check(("threshold", {"power": power}, shape), "portable", seed=7)
    tensors, _ = _inputs(shape, "threshold", seed=7)
    scores = torch.einsum("bihd,bjhd->bhij", tensors["q"], tensors["k"].repeat_interleave(h // h_kv, dim=2))
    pos = torch.arange(n, device=CUDA)[:, None] + (kv - n)
    scores = scores.masked_fill(torch.arange(kv, device=CUDA)[None, :] > pos, float("-inf"))
    tau = 1.0 * torch.sqrt(2.0 * torch.log((pos[:, 0] + 1).double()) / d)  # beta = 1
    below = (scores.amax(dim=-1) - tau) < -1e-2  # (B, H, N)
    assert below.any() and (~below).any()
    assert torch.count_nonzero(fused["dq"].transpose(1, 2)[below]) == 0
    assert torch.count_nonzero(fused["dq"].transpose(1, 2)[~below]) > 0


@pytest.mark.parametrize("variant,params", [("threshold", {"power": 2.0}), ("threshold", {"power": 1.5}),
                                            ("sigmoid", {}), ("sigmoid", {"bias": -3.0})])
def test_gluon_backward_matches_the_portable_backward_bitwise_repeatably(variant, params):
    """Two calls give the same bits (no atomics), and the result is close to the portable backward's
    (both within the rule; here a direct comparison at a rounding or two of the 16-bit results)."""
    from attn.kernels import sigmoid_family, threshold_family
    from attn.kernels.gluon_weighted_bwd import launch_sigmoid_backward, launch_threshold_backward

    spec = attn.get_variant(variant).make_spec(**params)
    gen = torch.Generator(device=CUDA).manual_seed(5)
    q, do = (torch.randn(2, 700, 8, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 700, 2, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    if variant == "threshold":
        q, k = (torch.nn.functional.normalize(t.float(), dim=-1).to(torch.bfloat16) for t in (q, k))
        beta, power = float(spec.beta), float(spec.power)
        first = launch_threshold_backward(q, k, v, do, True, beta, power)
        second = launch_threshold_backward(q, k, v, do, True, beta, power)
        portable = threshold_family._backward_impl(do, q, k, v, None, None, None, None, beta, power, True, 0)
    else:
        sm_scale = float(spec.scale(128))
        first = launch_sigmoid_backward(q, k, v, do, True, sm_scale, spec.bias)
        second = launch_sigmoid_backward(q, k, v, do, True, sm_scale, spec.bias)
        portable = sigmoid_family._backward_impl(do, q, k, v, None, spec.bias, sm_scale, True, 0)
    for name, a, b, p in zip(("dq", "dk", "dv"), first, second, portable[:3]):
        assert torch.equal(a, b), name
        scale = p.float().abs().max().item()
        assert scale > 0, name
        assert (a.float() - p.float()).abs().max().item() <= 2e-2 * scale, name


# the persistent grids' shapes: SHAPES and ones with more work items than SMs, a last work-item group of fewer
# (batch, head) pairs than gluon_pipeline.HEADS_PER_WORK_GROUP (B H_kv = 5, 301, 1), rows that see no key (N > KV)
PERSISTENT_SHAPES = SHAPES + [
    (16, 1024, 1024, 12, 12, 64, True, torch.bfloat16),
    (3, 777, 777, 5, 5, 128, True, torch.bfloat16),
    (1, 640, 640, 301, 301, 64, False, torch.bfloat16),
    (1, 700, 200, 3, 1, 64, True, torch.float16),
]


@pytest.mark.parametrize("variant,params", [("threshold", {"power": 2.0}), ("threshold", {"power": 1.5}),
                                            ("sigmoid", {})])
def test_the_persistent_backward_gives_the_per_item_grids_bits(variant, params, nan_poison):
    """The persistent dK / dV and dQ kernels (one program per SM running work items in turn) compute each item
    as the per-item grids do: dq, dk, dv equal bit for bit, every element written (NaN-poisoned allocations),
    on PERSISTENT_SHAPES."""
    from attn.kernels.gluon_weighted_bwd import launch_sigmoid_backward, launch_threshold_backward

    spec = attn.get_variant(variant).make_spec(**params)
    for index, shape in enumerate(PERSISTENT_SHAPES):
        causal, dtype = shape[6], shape[7]
        tensors, do = _inputs(shape, variant, seed=400 + index)
        q, k, v, do = (t.to(dtype) for t in (tensors["q"], tensors["k"], tensors["v"], do))
        if variant == "threshold":
            def run(persistent):
                return launch_threshold_backward(q, k, v, do, causal, float(spec.beta), float(spec.power),
                                                 persistent=persistent)
        else:
            def run(persistent):
                return launch_sigmoid_backward(q, k, v, do, causal, float(spec.scale(q.shape[-1])), spec.bias,
                                               persistent=persistent)
        per_item, persistent = run(False), run(True)
        torch.cuda.synchronize()
        for name, ref, got in zip(("dq", "dk", "dv"), per_item, persistent):
            where = f"{variant} {params} {shape} {name}"
            assert not got.isnan().any(), f"{where}: an element unwritten (NaN)"
            assert torch.equal(got, ref), f"{where}: the grids' bits differ"


def test_checked_entries_name_what_a_call_misses():
    from attn.kernels.gluon_weighted_bwd import gluon_sigmoid_backward, gluon_threshold_backward

    q = torch.randn(1, 64, 2, 64, device=CUDA, dtype=torch.bfloat16)
    k = v = torch.randn(1, 64, 2, 64, device=CUDA, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dout"):
        gluon_threshold_backward(q, k, v, q[:, :32], True)
    with pytest.raises(ValueError, match="dout"):
        gluon_sigmoid_backward(q, k, v, q.half(), True, 0.125)
    with pytest.raises(ValueError, match="power"):
        gluon_threshold_backward(q, k, v, q, True, power=0.0)
    with pytest.raises(ValueError, match="beta"):
        gluon_threshold_backward(q, k, v, q, True, beta=float("nan"))
    with pytest.raises(ValueError, match="sm_scale"):
        gluon_sigmoid_backward(q, k, v, q, True, 0.0)
    with pytest.raises(ValueError, match="bias"):
        gluon_sigmoid_backward(q, k, v, q, True, 0.125, bias=float("inf"))
    with pytest.raises(ValueError, match="newton"):
        gluon_sigmoid_backward(q, k, v, q, True, 0.125, newton=5)
    with pytest.raises(ValueError, match="causal"):
        gluon_sigmoid_backward(q, k, v, q, 1, 0.125)
    with pytest.raises(ValueError, match="head dim"):
        q96 = torch.randn(1, 64, 2, 96, device=CUDA, dtype=torch.bfloat16)
        gluon_threshold_backward(q96, q96, q96, q96, True)
