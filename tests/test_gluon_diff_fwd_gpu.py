"""The Gluon sm_90 differential threshold forward (attn/kernels/gluon_diff_fwd.py), natively on a Hopper GPU
(skipped elsewhere: Gluon has no interpreter; its CPU compile checks are in tests/test_gluon_compile.py).

`gluon_diff_threshold_forward`'s output against the float64 reference by the DESIGN.md section 6 rule (within
2x the error of the PyTorch reference run in the kernel's dtype, plus a floor proportional to the output), with
torch.empty NaN-poisoned so an element the kernel never writes fails: odd lengths, causal and full masks, more
keys than queries (bottom-right causal), GQA, D 64 / 128, bf16 / fp16, p = 1, 2, 1.5 and 3, beta 0.25 to 1,
per-head lambdas of both signs, on unit-norm q, k, q2, k2 whose thresholds leave dense and empty rows. Then:
rows whose scores stay below their threshold in both views output exactly 0; lambda in any float dtype and
strides and strided q2 / k2 give the bits of the contiguous fp32 call; two calls give the same bits, close to
the portable forward's; the checked entry names what a call misses. The tests call the kernel directly; its
calls through the public function are tests/test_gluon_gpu.py's.
"""

from __future__ import annotations

import pytest
import torch

import attn
from attn.kernels import tiers
from gluon_cases import FLOORS
from gluon_diff_cases import (CASES, PERSISTENT_SHAPES, SHAPES, case_id, draw_inputs,  # noqa: F401
                             portable_plans)  # (autouse fixture)
from tolerance import assert_within_reference_error

CUDA = torch.device("cuda")
# the portable kernels on their first tile config (conftest)
pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() and tiers.gluon_usable(CUDA)),
                                 reason="needs an sm_90 GPU and Triton's Gluon Hopper API"),
              pytest.mark.usefixtures("first_tile_configs")]


def _inputs(shape, seed):
    """The shared draw (`gluon_diff_cases.draw_inputs`), lambda in fp32 (the parameter's dtype)."""
    tensors, lam, _ = draw_inputs(shape, seed)
    return tensors, lam.float()


def _reference(tensors, lam, spec, causal, dtype):
    """The reference's output on the inputs rounded to `dtype` (float64: the inputs as they are)."""
    t = {name: x.to(dtype) for name, x in tensors.items()}
    return attn.attention(t["q"], t["k"], t["v"], spec, causal=causal, backend="reference",
                          extra={"q2": t["q2"], "k2": t["k2"], "lam": lam.to(dtype)})


def _gluon(tensors, lam, spec, causal, dtype):
    from attn.kernels.gluon_diff_fwd import gluon_diff_threshold_forward

    t = {name: x.to(dtype) for name, x in tensors.items()}
    return gluon_diff_threshold_forward(t["q"], t["k"], t["v"], t["q2"], t["k2"], lam, causal, float(spec.beta),
                                        float(spec.power))


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_gluon_differential_forward_is_within_the_rule(case, nan_poison):
    params, shape = case
    causal, dtype = shape[6], shape[7]
    spec = attn.get_variant("diff_threshold").make_spec(**params)
    tensors, lam = _inputs(shape, seed=CASES.index(case))
    ref64 = _reference(tensors, lam.double(), spec, causal, torch.float64)
    same = _reference(tensors, lam, spec, causal, dtype)
    fused = _gluon(tensors, lam, spec, causal, dtype)
    assert fused.dtype == dtype and fused.shape == ref64.shape
    assert ref64.abs().max().item() > 0
    # the floor scales with the output (small here where p > 1 and thresholds bind), so no case passes a zero output
    assert_within_reference_error("out", fused, same, ref64, floor=FLOORS[dtype] * ref64.abs().max().item())


@pytest.mark.parametrize("power", [1.0, 2.0, 1.5])
def test_rows_below_their_threshold_in_both_views_output_zero(power, nan_poison):
    """A row whose float64 scores of both views stay below its threshold by more than the 16-bit scores'
    rounding (1e-2) outputs exactly 0; the cases hold such rows and rows with weights."""
    b, n, kv, h, h_kv, d, causal, dtype = shape = SHAPES[7]
    spec = attn.get_variant("diff_threshold").make_spec(power=power)
    tensors, lam = _inputs(shape, seed=7)
    fused = _gluon(tensors, lam, spec, causal, dtype)
    pos = torch.arange(n, device=CUDA)[:, None] + (kv - n)
    tau = 1.0 * torch.sqrt(2.0 * torch.log((pos[:, 0] + 1).double()) / d)  # beta = 1

    def top_score(qv, kv_):
        scores = torch.einsum("bihd,bjhd->bhij", qv, kv_.repeat_interleave(h // h_kv, dim=2))
        return scores.masked_fill(torch.arange(kv, device=CUDA)[None, :] > pos, float("-inf")).amax(dim=-1)

    below = ((top_score(tensors["q"], tensors["k"]) - tau) < -1e-2) & ((top_score(tensors["q2"], tensors["k2"]) - tau)
                                                                       < -1e-2)  # (B, H, N)
    assert below.any() and (~below).any()
    rows = fused.transpose(1, 2)  # (B, H, N, D)
    assert torch.count_nonzero(rows[below]) == 0
    assert torch.count_nonzero(rows[~below]) > 0


def test_lambda_of_any_float_dtype_and_strides_and_strided_second_views_give_the_contiguous_bits(nan_poison):
    """lambda is read per head through its stride and converted to fp32 in the kernel: a bf16 lambda gives the
    bits of its fp32 copy, a strided one those of its contiguous copy; q2 / k2 sliced out of packed tensors
    (row stride 2 H D) give the bits of their contiguous copies."""
    from attn.kernels.gluon_diff_fwd import launch_diff_threshold

    b, n, kv, h, h_kv, d = 2, 300, 300, 4, 2, 128
    gen = torch.Generator(device=CUDA).manual_seed(3)

    def unit(*size):
        return torch.nn.functional.normalize(torch.randn(*size, device=CUDA, generator=gen), dim=-1).to(torch.bfloat16)

    q, k = unit(b, n, h, d), unit(b, kv, h_kv, d)
    v = torch.randn(b, kv, h_kv, d, device=CUDA, generator=gen).to(torch.bfloat16)
    packed_q, packed_k = unit(b, n, 2, h, d), unit(b, kv, 2, h_kv, d)
    q2, k2 = packed_q[:, :, 1], packed_k[:, :, 0]
    assert not q2.is_contiguous() and not k2.is_contiguous()
    lam16 = torch.tensor([0.75, -0.25, 0.5, 1.0], device=CUDA, dtype=torch.bfloat16)
    lam_strided = torch.zeros(2 * h, device=CUDA)
    lam_strided[::2] = lam16.float()
    base = launch_diff_threshold(q, k, v, q2.contiguous(), k2.contiguous(), lam16.float(), True, 1.0, 2.0)
    assert base.abs().max().item() > 0
    for lam in (lam16, lam_strided[::2], lam16.half()):
        assert torch.equal(launch_diff_threshold(q, k, v, q2, k2, lam, True, 1.0, 2.0), base), lam.dtype


@pytest.mark.parametrize("power", [2.0, 1.0, 1.5])
def test_gluon_differential_forward_is_repeatable_and_close_to_the_portable_forward(power):
    """Two calls give the same bits (no atomics), and the result is close to the portable forward's (both within
    the rule; here a direct comparison at a rounding or two of the 16-bit results)."""
    from attn.kernels import threshold_family
    from attn.kernels.gluon_diff_fwd import launch_diff_threshold

    gen = torch.Generator(device=CUDA).manual_seed(5)

    def unit(*size):
        return torch.nn.functional.normalize(torch.randn(*size, device=CUDA, generator=gen), dim=-1).to(torch.bfloat16)

    q, q2 = unit(2, 700, 8, 128), unit(2, 700, 8, 128)
    k, k2 = unit(2, 700, 2, 128), unit(2, 700, 2, 128)
    v = torch.randn(2, 700, 2, 128, device=CUDA, generator=gen).to(torch.bfloat16)
    lam = torch.linspace(-0.5, 1.2, 8, device=CUDA)
    first = launch_diff_threshold(q, k, v, q2, k2, lam, True, 1.0, power)
    second = launch_diff_threshold(q, k, v, q2, k2, lam, True, 1.0, power)
    portable = threshold_family._forward_impl(q, k, v, q2, k2, lam, None, 1.0, power, True, 0)
    assert torch.equal(first, second)
    scale = portable.float().abs().max().item()
    assert scale > 0
    assert (first.float() - portable.float()).abs().max().item() <= 2e-2 * scale


@pytest.mark.parametrize("power", [2.0, 1.5])
def test_the_persistent_forward_gives_the_per_item_grids_bits(power, nan_poison):
    """The persistent forward (one program per SM running work items in turn) computes each item as the
    per-item grid does: the outputs equal bit for bit, every element written (NaN-poisoned allocations)."""
    from attn.kernels.gluon_diff_fwd import launch_diff_threshold

    for index, shape in enumerate(PERSISTENT_SHAPES):
        causal, dtype = shape[6], shape[7]
        tensors, lam = _inputs(shape, seed=index)
        t = {name: x.to(dtype) for name, x in tensors.items()}
        args = (t["q"], t["k"], t["v"], t["q2"], t["k2"], lam, causal, 1.0, power)
        per_item = launch_diff_threshold(*args)
        persistent = launch_diff_threshold(*args, persistent=True)
        torch.cuda.synchronize()
        assert not persistent.isnan().any(), f"{shape}: an element unwritten (NaN)"
        assert torch.equal(persistent, per_item), f"{shape} p={power}: the grids' bits differ"


def test_checked_entry_names_what_a_call_misses():
    from attn.kernels.gluon_diff_fwd import gluon_diff_threshold_forward

    q = torch.randn(1, 64, 2, 64, device=CUDA, dtype=torch.bfloat16)
    k = v = torch.randn(1, 64, 1, 64, device=CUDA, dtype=torch.bfloat16)
    lam = torch.full((2,), 0.5, device=CUDA)
    with pytest.raises(ValueError, match="q2"):
        gluon_diff_threshold_forward(q, k, v, q[:, :32], k, lam, True)
    with pytest.raises(ValueError, match="q2"):
        gluon_diff_threshold_forward(q, k, v, None, k, lam, True)
    with pytest.raises(ValueError, match="k2"):
        gluon_diff_threshold_forward(q, k, v, q, k.half(), lam, True)
    with pytest.raises(ValueError, match="k2"):
        gluon_diff_threshold_forward(q, k, v, q, q, lam, True)
    with pytest.raises(ValueError, match="lam"):
        gluon_diff_threshold_forward(q, k, v, q, k, lam[:1], True)
    with pytest.raises(ValueError, match="lam"):
        gluon_diff_threshold_forward(q, k, v, q, k, lam.double(), True)
    with pytest.raises(ValueError, match="lam"):
        gluon_diff_threshold_forward(q, k, v, q, k, 0.5, True)
    with pytest.raises(ValueError, match="power"):
        gluon_diff_threshold_forward(q, k, v, q, k, lam, True, power=0.0)
    with pytest.raises(ValueError, match="beta"):
        gluon_diff_threshold_forward(q, k, v, q, k, lam, True, beta=float("nan"))
    with pytest.raises(ValueError, match="causal"):
        gluon_diff_threshold_forward(q, k, v, q, k, lam, 1)
    with pytest.raises(ValueError, match="head dim"):
        q96 = torch.randn(1, 64, 2, 96, device=CUDA, dtype=torch.bfloat16)
        gluon_diff_threshold_forward(q96, q96, q96, q96, q96, lam, True)
