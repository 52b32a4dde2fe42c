"""The Gluon sm_90 softmax backward (attn/kernels/gluon_softmax_bwd.py), natively on a Hopper GPU (skipped
elsewhere: Gluon has no interpreter; its CPU compile checks are in tests/test_gluon_compile.py).

dq, dk, dv of `gluon_softmax_backward`, fed by the out and lse2 of the portable forward or of the Gluon
forward, against the float64 reference by the DESIGN.md section 6 rule (within 2x the error of the PyTorch
reference run in the kernel's dtype, plus a floor), with torch.empty / empty_like NaN-poisoned so an
element the kernels never write fails: odd lengths (1, 17, 127, 200, 1000), causal and full masks, more
keys than queries under the bottom-right causal mask, GQA, D 64 / 128, bf16 / fp16. The tests pair each
forward with the Gluon backward through an autograd.Function of their own; tests/test_gluon_gpu.py runs
it behind the public function.
"""

from __future__ import annotations

import pytest
import torch

import attn
from attn.kernels import tiers
from attn.testing import outputs_and_grads
from tolerance import assert_within_reference_error

CUDA = torch.device("cuda")
# the portable kernels on their first tile config (conftest; a test of the timed tier choice unsets it)
pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() and tiers.gluon_usable(CUDA)),
                                 reason="needs an sm_90 GPU and Triton's Gluon Hopper API"),
              pytest.mark.usefixtures("first_tile_configs")]
FLOORS = {torch.float16: 1e-3, torch.bfloat16: 8e-3}

# (B, N, KV, H, H_kv, D, causal, dtype)
CASES = [
    (1, 1, 1, 2, 2, 64, True, torch.bfloat16),
    (2, 17, 17, 4, 2, 128, False, torch.float16),
    (2, 127, 127, 4, 1, 128, True, torch.bfloat16),
    (1, 200, 200, 4, 4, 64, False, torch.bfloat16),
    (2, 333, 333, 8, 2, 64, True, torch.float16),
    (1, 100, 300, 4, 4, 128, True, torch.bfloat16),   # KV > N: every row sees the first KV - N keys
    (1, 257, 600, 2, 1, 64, False, torch.float16),
    (1, 1000, 1000, 4, 2, 128, True, torch.bfloat16),
    (2, 1000, 1000, 4, 4, 64, True, torch.float16),
    (1, 200, 1000, 8, 2, 128, False, torch.bfloat16),
]


class _GluonBackwardAttention(torch.autograd.Function):
    """Plain softmax attention whose forward is the portable or the Gluon kernel and whose backward is
    the Gluon backward (the way `_bwd_plan` would call it)."""

    @staticmethod
    def forward(ctx, q, k, v, sm_scale, causal, forward_tier):
        if forward_tier == "gluon":
            from attn.kernels.gluon_softmax_fwd import gluon_softmax_forward

            out, lse2 = gluon_softmax_forward(q, k, v, sm_scale, causal)
        else:
            import os

            from attn.kernels import softmax_family

            old = os.environ.get(tiers.GLUON_ENV)
            os.environ[tiers.GLUON_ENV] = "0"
            try:
                out, lse2 = softmax_family._fwd_impl(q, k, v, None, None, 0, 0.0, 0.0, sm_scale, causal, 0)
            finally:
                if old is None:
                    os.environ.pop(tiers.GLUON_ENV)
                else:
                    os.environ[tiers.GLUON_ENV] = old
        ctx.save_for_backward(q, k, v, out, lse2)
        ctx.sm_scale, ctx.causal = sm_scale, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        from attn.kernels.gluon_softmax_bwd import gluon_softmax_backward

        q, k, v, out, lse2 = ctx.saved_tensors
        dq, dk, dv = gluon_softmax_backward(q, k, v, out, dout, lse2, ctx.sm_scale, ctx.causal)
        return dq, dk, dv, None, None, None


def _inputs(b, n, kv, h, h_kv, d, seed):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    q = torch.randn(b, n, h, d, device=CUDA, dtype=torch.float64, generator=gen)
    k = torch.randn(b, kv, h_kv, d, device=CUDA, dtype=torch.float64, generator=gen)
    v = torch.randn(b, kv, h_kv, d, device=CUDA, dtype=torch.float64, generator=gen)
    do = torch.randn(b, n, h, d, device=CUDA, dtype=torch.float64, generator=gen)
    return {"q": q, "k": k, "v": v}, do


def _case_id(c):
    return f"B{c[0]}-N{c[1]}-KV{c[2]}-H{c[3]}/{c[4]}-D{c[5]}-{'causal' if c[6] else 'full'}-{str(c[7])[6:]}"


def _check(case, forward_tier, seed):
    b, n, kv, h, h_kv, d, causal, dtype = case
    sm_scale = d ** -0.5
    spec = attn.get_variant("softmax").make_spec(sm_scale=sm_scale)
    tensors, do = _inputs(b, n, kv, h, h_kv, d, seed)

    def reference(q, k, v):
        return attn.attention(q, k, v, spec, causal=causal, backend="reference")

    ref64 = outputs_and_grads(reference, {name: t.clone().requires_grad_() for name, t in tensors.items()}, do)
    same = outputs_and_grads(reference, {name: t.to(dtype).requires_grad_() for name, t in tensors.items()}, do)
    fused = outputs_and_grads(lambda q, k, v: _GluonBackwardAttention.apply(q, k, v, sm_scale, causal, forward_tier),
                              {name: t.to(dtype).requires_grad_() for name, t in tensors.items()}, do)
    for name in ("out", "dq", "dk", "dv"):
        allowance = FLOORS[dtype] * max(1.0, ref64[name].abs().max().item())
        assert_within_reference_error(name, fused[name], same[name], ref64[name], floor=allowance)
    return fused


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_gluon_backward_after_the_portable_forward_is_within_the_rule(case, nan_poison):
    _check(case, "portable", seed=CASES.index(case))


@pytest.mark.parametrize("case", CASES[::2], ids=[_case_id(c) for c in CASES[::2]])
def test_gluon_backward_after_the_gluon_forward_is_within_the_rule(case, nan_poison):
    _check(case, "gluon", seed=50 + CASES.index(case))


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
