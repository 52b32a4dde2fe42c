"""Fused softmax-family kernels (softmax, tanh / soft_sign caps, ALSC) against the float64
reference, by the DESIGN.md §6 rule, on CPU under TRITON_INTERPRET=1.

Every case checks out, dq, dk, dv (and d-temperature when it requires grad) with
NaN-poisoned allocations. The matrix covers every cap method with caps small enough
to bind, every mask kind and their compositions, GQA ratios 1/2/4, odd N and rows
that see nothing. bf16 is checked on the GPU (scripts/gpu_checks/check_softmax_family_gpu.py).
"""

import os
import zlib
from types import SimpleNamespace


import pytest
import torch

import attn
from attn.testing import opcheck_launcher
from attn.kernels.softmax_family import CAP_IDS, fused_attention, softmax_family_bwd, softmax_family_fwd
from attn.testing import random_segment_ids, softmax_family_outputs_and_grads
from attn.masks import MaskSpec, segment_bounds
from attn.reference import reference_attention
from tolerance import assert_within_reference_error

VARIANT_OF_CAP = {"none": "softmax", "tanh": "softcap_tanh", "soft_sign": "softcap_softsign", "alsc": "alsc"}
# absolute error allowances (times max(1, |reference|)): fp32's is the noise of the kernels' blockwise
# sums, a few times PyTorch's pairwise ones; at 1e-5 it hid errors 25-100x the rule's, so it is tight
FLOORS = {torch.float32: 3e-6, torch.float16: 1e-4}


def make_spec(cap, cap_value=2.0, knee=0.5, sm_scale=None):
    params = {} if cap == "none" else {"cap": cap_value}
    if cap == "alsc":
        params["knee"] = knee
    if sm_scale is not None:
        params["sm_scale"] = sm_scale
    return attn.get_variant(VARIANT_OF_CAP[cap]).make_spec(**params)


def run_case(cap, n, group, mask, seg, temp, dtype, *, batch=2, h_kv=2, d=16, cap_value=2.0, knee=0.5,
             seed=0, pad_row=False, scale=2.0, sm_scale=None, floor=None):
    gen = torch.Generator().manual_seed(seed)
    h = h_kv * group
    q = torch.randn(batch, n, h, d, generator=gen, dtype=torch.float64) * scale
    k = torch.randn(batch, n, h_kv, d, generator=gen, dtype=torch.float64) * scale
    v = torch.randn(batch, n, h_kv, d, generator=gen, dtype=torch.float64)
    do = torch.randn(batch, n, h, d, generator=gen, dtype=torch.float64)
    t = (torch.rand(batch, n, generator=gen, dtype=torch.float64) * 1.5 + 0.25) if temp else None
    ids = random_segment_ids(batch, n, gen, padding_row=pad_row) if seg else None
    spec = make_spec(cap, cap_value, knee, sm_scale)

    ref, same, fused = (softmax_family_outputs_and_grads(fn, q, k, v, t, do, spec, mask, ids, dt)
                        for fn, dt in ((reference_attention, torch.float64), (reference_attention, dtype),
                                       (fused_attention, dtype)))
    ratios = {}
    for name, f, s, r in zip(("out", "dq", "dk", "dv", "dtemp"), fused, same, ref):
        assert f.dtype == dtype and f.shape == r.shape, name
        # the floor scales with the gradient's size: fp32 summation-order noise does too
        allowance = (floor or FLOORS[dtype]) * max(1.0, r.abs().max().item())
        ratios[name] = assert_within_reference_error(name, f, s, r, floor=allowance)
    return fused, ids, ratios


MASKS = {
    "full": (MaskSpec(causal=False), False),
    "causal": (MaskSpec(causal=True), False),
    "window": (MaskSpec(causal=True, window=24), False),
    "ranker": (MaskSpec(causal=False), True),
    "ranker+causal": (MaskSpec(causal=True), True),
    "ranker+window": (MaskSpec(causal=True, window=9), True),
}
LENGTHS = (1, 17, 127, 200, 333)
GROUPS = (1, 2, 4)

# every cap x every mask kind; N, GQA ratio and temperature rotate so that each value meets each cap
MATRIX = [
    pytest.param(cap, mask, LENGTHS[(i + 2 * j) % len(LENGTHS)], GROUPS[(i + j) % 3], (i + j) % 2 == 0,
                 id=f"{cap}-{mask}-N{LENGTHS[(i + 2 * j) % len(LENGTHS)]}-G{GROUPS[(i + j) % 3]}")
    for i, cap in enumerate(CAP_IDS)
    for j, mask in enumerate(MASKS)
]


@pytest.mark.parametrize("cap,mask,n,group,temp", MATRIX)
def test_matrix_fp32(nan_poison, cap, mask, n, group, temp):
    spec, seg = MASKS[mask]
    # keep the biggest interpreter cases small in batch / heads
    batch, h_kv = (1, 1) if n >= 200 else (2, 2)
    run_case(cap, n, group, spec, seg, temp, torch.float32, batch=batch, h_kv=h_kv, seed=zlib.crc32(f"{cap}{mask}".encode()) % 1000)


@pytest.mark.parametrize("cap", list(CAP_IDS))
def test_fp16(nan_poison, cap):
    run_case(cap, 67, 2, MaskSpec(causal=True), False, True, torch.float16, seed=5)


# combinations the matrix leaves out: fp16 with every mask kind and GQA 1 / 4, head dims 32, 64 and
# 128 beyond ALSC, a window of one key, a custom sm_scale reaching the kernels
GAPS = [  # (cap, mask, n, group, temp, dtype, d, sm_scale)
    ("tanh", "window", 45, 1, True, torch.float16, 16, None),
    ("none", "ranker", 40, 4, False, torch.float16, 16, None),
    ("soft_sign", "full", 33, 4, True, torch.float16, 16, None),
    ("alsc", "ranker+causal", 29, 1, False, torch.float16, 32, None),
    ("none", "causal", 37, 2, True, torch.float32, 32, 0.3),
    ("tanh", "window", 40, 1, False, torch.float32, 64, None),
    ("soft_sign", "causal", 24, 2, True, torch.float32, 128, 0.05),
    # a single visible key: d-temperature is exactly 0 (p = 1, dp - delta = 0), which PyTorch gets
    # exactly and the online softmax to its p = exp2(z - lse) rounding times |dp| |F| (about 5e-6)
    ("alsc", "window1", 19, 2, True, torch.float32, 16, None),
    ("none", "window1", 21, 1, False, torch.float16, 16, None),
]
MASKS_WITH_WINDOW1 = {**MASKS, "window1": (MaskSpec(causal=True, window=1), False)}


@pytest.mark.parametrize("cap,mask,n,group,temp,dtype,d,sm_scale", GAPS,
                         ids=[f"{c}-{m}-N{n}-G{g}-{str(dt)[6:]}-D{d}" + (f"-s{s}" if s else "")
                              for c, m, n, g, _, dt, d, s in GAPS])
def test_matrix_gaps(nan_poison, cap, mask, n, group, temp, dtype, d, sm_scale):
    spec, seg = MASKS_WITH_WINDOW1[mask]
    batch, h_kv = (1, 1) if d >= 64 else (2, 2)
    exact_zero = mask == "window1" and temp and dtype == torch.float32
    run_case(cap, n, group, spec, seg, temp, dtype, batch=batch, h_kv=h_kv, d=d, sm_scale=sm_scale,
             scale=1.0 if d >= 64 else 2.0, seed=n + d, floor=1e-5 if exact_zero else None)


@pytest.mark.parametrize("d", [64, 128])
def test_head_dims(nan_poison, d):
    run_case("alsc", 40, 2, MaskSpec(causal=True, window=20), True, True, torch.float32, batch=1, h_kv=1, d=d,
             scale=0.5)


@pytest.mark.parametrize("cap", ["tanh", "alsc"])
def test_caps_bind(nan_poison, cap):
    """Logits far past the cap: the capped function, not plain softmax, is what is computed."""
    n = 33
    _, _, ratios = run_case(cap, n, 1, MaskSpec(causal=False), False, False, torch.float32, cap_value=1.5,
                            knee=0.3, scale=4.0, batch=1, h_kv=1)
    # and the result differs from plain softmax by far more than the tolerance
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, n, 1, 16, generator=gen) * 4
    k = torch.randn(1, n, 1, 16, generator=gen) * 4
    v = torch.randn(1, n, 1, 16, generator=gen)
    capped = fused_attention(q, k, v, make_spec(cap, 1.5, 0.3), MaskSpec(causal=False))
    plain = fused_attention(q, k, v, make_spec("none"), MaskSpec(causal=False))
    assert (capped - plain).abs().max() > 0.1


def test_alsc_knee_zero_is_tanh():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 29, 2, 16, generator=gen) * 3 for _ in range(3))
    a = fused_attention(q, k, v, make_spec("alsc", 2.0, 0.0), MaskSpec(causal=True))
    b = fused_attention(q, k, v, make_spec("tanh", 2.0), MaskSpec(causal=True))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_are_zero_with_zero_grad(nan_poison):
    fused, ids, _ = run_case("tanh", 40, 2, MaskSpec(causal=True), True, True, torch.float32, batch=3,
                             pad_row=True, seed=7)
    out, dq = fused[0], fused[1]
    padding = ids == 0
    assert padding[-1].all() and padding.sum() > 40
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    assert (out[padding] == 0).all()
    assert (dq[padding] == 0).all()
    assert (fused[4][padding] == 0).all()  # d-temperature


def test_temperature_without_grad_and_strided_inputs(nan_poison):
    """Strided (non-contiguous) q/k/v and a temperature that needs no gradient."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 45, 3, 4, 16, generator=gen)
    q = base[:, :, 0].transpose(1, 2).contiguous().transpose(1, 2)  # (B,N,H,D) with H-major strides
    k = base[:, :, 1, :2]
    v = base[:, :, 2, 1:3]
    assert not k.is_contiguous() and not q.is_contiguous()
    t = torch.rand(2, 45, generator=gen) + 0.5
    for x in (q, k, v):
        x.requires_grad_()
    spec, mask = make_spec("soft_sign"), MaskSpec(causal=True, window=10)
    out = fused_attention(q, k, v, spec, mask, None, t)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*leaves, spec, mask, None, t.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    dout = torch.randn(out.shape, generator=gen)
    out.backward(dout)
    ref.backward(dout.double())
    for x, r in zip((q, k, v), leaves):  # every gradient, through the strided layouts
        torch.testing.assert_close(x.grad.double(), r.grad, atol=5e-5, rtol=1e-4)


def test_errors_name_the_argument():
    spec = make_spec("tanh")
    q = torch.randn(1, 8, 2, 48)
    with pytest.raises(ValueError, match="head dim"):
        fused_attention(q, q, q, spec, MaskSpec())
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="dtype"):
        fused_attention(q, q, q, spec, MaskSpec())
    q = torch.randn(1, 8, 2, 48)
    with pytest.raises(ValueError, match="head dim"):
        attn.attention(q, q, q, spec, backend="triton")


def test_public_api_dispatches_to_kernel(nan_poison):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 21, 4, 16, generator=gen)
    k = torch.randn(2, 21, 2, 16, generator=gen)
    v = torch.randn(2, 21, 2, 16, generator=gen)
    spec = make_spec("alsc")
    via_api = attn.attention(q, k, v, spec, causal=True, backend="triton")
    direct = fused_attention(q, k, v, spec, MaskSpec(causal=True))
    assert torch.equal(via_api, direct)
    assert attn.resolve_backend("auto", torch.device("cpu")) == "reference"
    from attn.registry import family_kernel
    assert family_kernel(spec) is fused_attention


def _op_args(with_seg, with_temp, requires_grad):
    gen = torch.Generator().manual_seed(6)
    n = 11
    q = torch.randn(1, n, 2, 16, generator=gen, requires_grad=requires_grad)
    k = torch.randn(1, n, 1, 16, generator=gen, requires_grad=requires_grad)
    v = torch.randn(1, n, 1, 16, generator=gen, requires_grad=requires_grad)
    bounds = segment_bounds(random_segment_ids(1, n, gen)) if with_seg else None
    t = (torch.rand(1, n, generator=gen) + 0.5).requires_grad_(requires_grad) if with_temp else None
    return q, k, v, bounds, t


@pytest.mark.parametrize("with_seg,with_temp", [(False, False), (True, True)])
def test_opcheck(with_seg, with_temp):
    q, k, v, bounds, t = _op_args(with_seg, with_temp, requires_grad=True)
    args = (q, k, v, bounds, t, CAP_IDS["alsc"], 2.0, 0.5, 0.25, True, 0 if with_seg else 7)
    opcheck_launcher(softmax_family_fwd, args)
    with torch.no_grad():
        out, lse = softmax_family_fwd(*args)
    do = torch.randn_like(out)
    bwd_args = (do, q.detach(), k.detach(), v.detach(), out, lse, bounds,
                t.detach() if t is not None else None, with_temp, CAP_IDS["alsc"], 2.0, 0.5, 0.25, True,
                0 if with_seg else 7)
    opcheck_launcher(softmax_family_bwd, bwd_args)


class TinyAttentionModel(torch.nn.Module):
    """A GPT-style block: projections -> registry-chosen attention -> output projection."""

    def __init__(self, dim=32, heads=2, kv_heads=1, variant="alsc"):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)
        self.temp = torch.nn.Linear(dim, 1)
        self.spec = attn.get_variant(variant).make_spec(cap=3.0)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.hd)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.hd).unbind(2)
        t = torch.nn.functional.softplus(self.temp(x)).squeeze(-1) + 0.5
        y = attn.attention(q, k, v, self.spec, causal=True, temperature=t, backend="triton")
        return self.o(y.reshape(b, n, -1))


def test_compiled_matches_eager_fullgraph():
    torch.manual_seed(0)
    model = TinyAttentionModel()
    x = torch.randn(2, 23, 32)
    eager = model(x)
    eager.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.square().mean().backward()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cap", ["none", "alsc"])
def test_zero_and_negative_temperature(nan_poison, cap):
    """t = 0 rows are uniform, t < 0 rows favour the smallest logits; masked keys stay masked."""
    gen = torch.Generator().manual_seed(8)
    n = 37
    q, k, v = (torch.randn(1, n, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    t = torch.randn(1, n, generator=gen, dtype=torch.float64) * 2
    t[0, ::5] = 0.0
    spec, mask = make_spec(cap), MaskSpec(causal=True, window=11)
    ref = reference_attention(q, k, v, spec, mask, None, t)
    ins = [x.float().requires_grad_() for x in (q, k, v, t)]
    out = fused_attention(ins[0], ins[1], ins[2], spec, mask, None, ins[3])
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    out.sum().backward()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, t)]
    reference_attention(*leaves[:3], spec, mask, None, leaves[3]).sum().backward()
    for got, want in zip(ins, leaves):  # dq, dk, dv and d-temperature
        torch.testing.assert_close(got.grad.double(), want.grad, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("cap,mask,n,setting", [("tanh", "causal", 17, None), ("alsc", "ranker+window", 127, "1"),
                                                ("soft_sign", "full", 1, None), ("tanh", "window", 33, "0")])
def test_fixed_shift_forward(nan_poison, monkeypatch, cap, mask, n, setting):
    """Capped forwards without a temperature shift by the diagonal logit (FIXED_MAX) unless
    ATTNLAB_FIXED_SHIFT=0 asks for the online softmax; either form meets the same rule."""
    from attn.kernels import softmax_family as sf

    if setting is None:
        monkeypatch.delenv(sf.FIXED_SHIFT_ENV, raising=False)
    else:
        monkeypatch.setenv(sf.FIXED_SHIFT_ENV, setting)
    launched, run = [], sf._FWD.run

    def recording_run(cfg, grid, tensors, scalars, meta):  # which forward form every launch asked for
        launched.append(meta["FIXED_MAX"])
        return run(cfg, grid, tensors, scalars, meta)

    monkeypatch.setattr(sf._FWD, "run", recording_run)
    spec, seg = MASKS[mask]
    run_case(cap, n, 2, spec, seg, False, torch.float32, batch=1, h_kv=1, pad_row=seg)
    assert launched and all(fixed == (setting != "0") for fixed in launched), launched


def test_fixed_shift_setting_is_0_or_1(monkeypatch):
    from attn.kernels import softmax_family as sf

    monkeypatch.setenv(sf.FIXED_SHIFT_ENV, "yes")
    with pytest.raises(ValueError, match="ATTNLAB_FIXED_SHIFT must be 0 or 1"):
        run_case("tanh", 5, 1, MaskSpec(causal=True), False, False, torch.float32, batch=1, h_kv=1)


@pytest.mark.parametrize("cap,mask,n,group,temp,form,kernels", [
    ("none", "causal", 127, 2, False, "separate", "1"), ("tanh", "ranker+window", 200, 1, True, "separate", "1"),
    ("alsc", "full", 17, 4, False, "one_pass", "1"), ("soft_sign", "window", 1, 1, False, "separate", "1"),
    ("none", "ranker+causal", 333, 2, False, "one_pass", "1"), ("tanh", "causal", 200, 2, False, "separate", "fwd,dq")])
def test_tma_loads(nan_poison, monkeypatch, cap, mask, n, group, temp, form, kernels):
    """The kernels with their tiles through TMA descriptors (ATTNLAB_TMA=1: forward k / v, dk/dv q / do,
    dq k / v; rows past the end arrive as zeros instead of through masked loads) meet the same rule on
    every mask kind, GQA, temperature, both backward forms."""
    from attn.kernels import softmax_family as sf

    monkeypatch.setenv("ATTNLAB_TMA", kernels)
    monkeypatch.setattr(sf, "TMA_MIN_ROWS", 1)  # the test's short sequences too
    monkeypatch.setenv(sf.DQ_FORM_ENV, form)
    launched = []
    for kernel in (sf._FWD, sf._DKDV, sf._DQ):
        def recording_run(cfg, grid, tensors, scalars, meta, run=kernel.run, name=kernel.name):
            launched.append((name, meta["TMA"]))
            return run(cfg, grid, tensors, scalars, meta)

        monkeypatch.setattr(kernel, "run", recording_run)
    spec, seg = MASKS[mask]
    run_case(cap, n, group, spec, seg, temp, torch.float32, pad_row=seg)
    names = {"softmax_family_fwd", "softmax_family_dkdv"} | ({"softmax_family_dq"} if form == "separate" else set())
    wanted = {f"softmax_family_{k}" for k in ("fwd", "dkdv", "dq")} if kernels == "1" else {
        f"softmax_family_{k}" for k in kernels.split(",")}
    assert {name for name, _ in launched} == names, launched
    assert all(tma == (name in wanted) for name, tma in launched), launched


@pytest.mark.parametrize("form", ["separate", "one_pass"])
def test_tma_loads_with_longer_keys(monkeypatch, form):
    """Queries against more keys (bottom-right aligned, a prefill after a cache): the TMA tiles give what
    the pointer loads give (which tests/test_kernels_longer_keys.py checks against the reference)."""
    from attn.kernels import softmax_family as sf

    monkeypatch.setattr(sf, "TMA_MIN_ROWS", 1)
    monkeypatch.setenv(sf.DQ_FORM_ENV, form)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 37, 4, 16, generator=gen)
    k, v = (torch.randn(2, 101, 2, 16, generator=gen) for _ in range(2))
    do = torch.randn_like(q)
    results = []
    for tma in ("0", "1"):
        monkeypatch.setenv("ATTNLAB_TMA", tma)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fused_attention(*leaves, make_spec("tanh"), MaskSpec(causal=True, window=50))
        out.backward(do)
        results.append([out.detach(), *(x.grad for x in leaves)])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


def test_tma_skips_short_launches(monkeypatch):
    """Below TMA_MIN_ROWS query rows (host-bound launches with untimed configs) the pointer loads run."""
    from attn.kernels import softmax_family as sf

    monkeypatch.setenv("ATTNLAB_TMA", "1")
    launched, run = [], sf._FWD.run
    monkeypatch.setattr(sf._FWD, "run", lambda cfg, grid, tensors, scalars, meta: (launched.append(meta["TMA"]),
                                                                                   run(cfg, grid, tensors, scalars,
                                                                                       meta)))
    run_case("tanh", 33, 1, MaskSpec(causal=True), False, False, torch.float32, batch=1, h_kv=1)
    assert launched == [False]


def test_tma_is_opt_in_per_kernel_and_needs_its_layout(monkeypatch):
    """TMA descriptors need unit stride in D and 16-byte strides and base; anything else takes the
    pointer loads. ATTNLAB_TMA: 0 (default), 1 (every kernel) or a comma list of kernels; on a GPU
    only with tuned configs."""
    from attn.kernels import runtime
    from attn.kernels.runtime import TMA_ENV, tma_layout, use_tma

    x = torch.zeros(2, 8, 4, 16)
    assert tma_layout(x) and tma_layout(x[:, :, :2])
    assert not tma_layout(x[..., ::2]) and not tma_layout(x[..., 1:]) and not tma_layout(torch.zeros(2, 8, 4, 17)[..., :16])
    monkeypatch.delenv(TMA_ENV, raising=False)
    assert not any(use_tma(kernel, x) for kernel in runtime.TMA_KERNELS)
    monkeypatch.setenv(TMA_ENV, "1")
    assert all(use_tma(kernel, x) for kernel in runtime.TMA_KERNELS) and not use_tma("fwd", x[..., 1:])
    monkeypatch.setenv(TMA_ENV, "fwd,dq")
    assert use_tma("fwd", x) and use_tma("dq", x) and not use_tma("dkdv", x)
    monkeypatch.setenv(TMA_ENV, "0")
    assert not use_tma("fwd", x)
    monkeypatch.setenv(TMA_ENV, "1")
    monkeypatch.setattr(runtime, "interpreting", lambda: False)  # the GPU's rule, here on the CPU
    assert not use_tma("fwd", x)  # CPU tensors: no TMA
    monkeypatch.setattr(runtime, "_properties", lambda device: SimpleNamespace(major=9))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    monkeypatch.delenv(runtime.CONFIG_ENV, raising=False)
    assert use_tma("fwd", x)
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "0")
    assert not use_tma("fwd", x)  # pinned configs
    monkeypatch.delenv("ATTNLAB_AUTOTUNE")
    monkeypatch.setattr(runtime, "_properties", lambda device: SimpleNamespace(major=8))
    assert not use_tma("fwd", x)
    for bad in ("yes", "fwd,bwd", ""):
        monkeypatch.setenv(TMA_ENV, bad)
        with pytest.raises(ValueError, match="ATTNLAB_TMA must be 0, 1 or a comma list of fwd, dkdv, dq"):
            use_tma("fwd", x)


def test_tuning_skips_configs_the_compiler_fails_on(monkeypatch):
    """A candidate that Triton cannot compile (ptxas fails) or that does not fit is skipped, as Triton's
    own autotuner does; the fastest of the rest is chosen; none left names the kernel and key."""
    from triton.runtime.errors import OutOfResources, PTXASError

    from attn.kernels import runtime

    configs = [runtime.TileConfig(128, 64, 8, 2), runtime.TileConfig(64, 64, 4, 3), runtime.TileConfig(64, 32, 4, 3),
               runtime.TileConfig(128, 128, 8, 3)]
    broken = {configs[0]: PTXASError("ptxas failed with error code -11"), configs[3]: OutOfResources(300, 228, "smem")}
    speed = {configs[1]: 2.0, configs[2]: 1.0}
    kernel = runtime.Kernel(None, "probe")

    def run(cfg, grid, tensors, scalars, meta):
        if cfg in broken:
            raise broken[cfg]

    monkeypatch.setattr(kernel, "run", run)
    import triton.testing
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), speed[chosen[-1]])[1])
    chosen = []
    monkeypatch.setattr(kernel, "run", lambda cfg, *a: (chosen.append(cfg), run(cfg, *a)))
    assert kernel._tune(lambda c: (1,), (), (), {}, configs, "key") == configs[2]
    assert set(kernel.timings["key"]) == {configs[1], configs[2]}
    with pytest.raises(RuntimeError, match="probe: no tile config fits"):
        kernel._tune(lambda c: (1,), (), (), {}, [configs[0], configs[3]], "key2")


def test_pinned_configs_skip_timing(monkeypatch):
    """attn.pin_kernel_configs (deterministic=true) makes every tuned kernel keep one config, so no
    timing can choose a different tile (summation order) in another process; ATTNLAB_KERNEL_CONFIG
    picks another candidate; unpinned, a key is timed once and its choice remembered."""
    from attn.kernels import runtime

    configs = [runtime.TileConfig(128, 64, 8, 3), runtime.TileConfig(64, 64, 4, 3), runtime.TileConfig(128, 32, 4, 2)]
    timed = []
    kernel = runtime.Kernel(None, "probe")
    monkeypatch.setattr(kernel, "_tune", lambda grid, tensors, scalars, meta, cfgs, key: timed.append(key) or cfgs[2])
    monkeypatch.setattr(runtime, "interpreting", lambda: False)  # the GPU's choice logic, here on the CPU
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "1")  # recorded, so restored even if an assert fails
    monkeypatch.delenv("ATTNLAB_AUTOTUNE")
    monkeypatch.delenv(runtime.CONFIG_ENV, raising=False)
    choose = lambda key: kernel.choose(None, (), (), {}, configs, key)  # noqa: E731
    assert choose("a") == configs[2] and choose("a") == configs[2] and timed == ["a"]  # timed once per key
    attn.pin_kernel_configs(True)
    assert choose("b") == configs[0] and timed == ["a"]
    monkeypatch.setenv(runtime.CONFIG_ENV, "4")  # the i-th candidate, modulo the list's length
    assert choose("b") == configs[1] and timed == ["a"]
    monkeypatch.setenv(runtime.CONFIG_ENV, "x")
    with pytest.raises(ValueError, match="ATTNLAB_KERNEL_CONFIG"):
        choose("b")
    monkeypatch.delenv(runtime.CONFIG_ENV)
    attn.pin_kernel_configs(False)
    assert "ATTNLAB_AUTOTUNE" not in os.environ
    assert choose("c") == configs[2] and timed == ["a", "c"]


ONE_PASS_CASES = [  # (cap, mask, n, group, temp, dtype, d): every mask kind, GQA, temperature, fp16, D up to 128
    ("none", "causal", 127, 2, False, torch.float32, 16),
    ("tanh", "ranker", 200, 4, False, torch.float32, 16),
    ("soft_sign", "window", 45, 1, True, torch.float16, 16),
    ("alsc", "ranker+window", 67, 2, False, torch.float32, 32),
    ("none", "full", 33, 1, False, torch.float16, 64),
    ("tanh", "ranker+causal", 40, 2, False, torch.float32, 128),
]


@pytest.mark.parametrize("cap,mask,n,group,temp,dtype,d", ONE_PASS_CASES,
                         ids=[f"{c}-{m}-N{n}-G{g}-{str(dt)[6:]}-D{d}" for c, m, n, g, _, dt, d in ONE_PASS_CASES])
def test_one_pass_backward(nan_poison, monkeypatch, cap, mask, n, group, temp, dtype, d):
    """The one-pass backward (ATTNLAB_SOFTMAX_DQ=one_pass: dq summed by the dk/dv kernel's atomic adds)
    meets the same rule; a temperature that requires grad keeps the dq kernel (it sums d-temperature)."""
    from attn.kernels import softmax_family as sf

    monkeypatch.setenv(sf.DQ_FORM_ENV, "one_pass")
    launched, run = [], sf._DKDV.run

    def recording_run(cfg, grid, tensors, scalars, meta):
        launched.append(meta["ATOMIC_DQ"])
        return run(cfg, grid, tensors, scalars, meta)

    monkeypatch.setattr(sf._DKDV, "run", recording_run)
    spec, seg = MASKS[mask]
    batch, h_kv = (1, 1) if d >= 64 or n >= 200 else (2, 2)
    run_case(cap, n, group, spec, seg, temp, dtype, batch=batch, h_kv=h_kv, d=d, scale=1.0 if d >= 64 else 2.0,
             seed=n + d, pad_row=seg)
    assert launched, "no dk/dv launch"
    if temp:  # d-temperature: the dq kernel runs, so no dk/dv launch sums dq
        assert not any(launched), launched
    else:
        assert all(launched), launched


def test_dq_form_choice(monkeypatch):
    """Which backward form runs: the environment's pin, else separate under the interpreter, outside the
    eligible shapes, under pinned configs and torch's deterministic mode; one timing per key on a GPU;
    d-temperature always separate; a bad pin names the variable."""
    from attn.kernels import runtime
    from attn.kernels import softmax_family as sf

    calls = []
    forms = {"separate": lambda: calls.append("separate"), "one_pass": lambda: calls.append("one_pass")}
    monkeypatch.delenv(sf.DQ_FORM_ENV, raising=False)
    monkeypatch.delenv(runtime.CONFIG_ENV, raising=False)
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    assert sf._dq_form(("k0",), forms, False, True) == "separate"  # the interpreter: no timing
    monkeypatch.setattr(sf, "interpreting", lambda: False)  # the GPU's choice logic, here on the CPU
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    times = {"separate": 2.0, "one_pass": 1.0}
    import triton.testing
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), times[calls[-1]])[1])
    monkeypatch.setattr(sf, "_dq_forms", {})
    assert sf._dq_form(("k1",), forms, False, False) == "separate" and not calls  # not eligible: no timing
    assert sf._dq_form(("k1",), forms, False, True) == "one_pass" and sf._dq_forms == {("k1",): "one_pass"}
    timed = len(calls)
    assert sf._dq_form(("k1",), forms, False, True) == "one_pass" and len(calls) == timed  # timed once per key
    assert sf._dq_form(("k1",), forms, True, True) == "separate"  # d-temperature: the dq kernel sums it
    times.update(separate=0.5)
    assert sf._dq_form(("k6",), forms, False, True) == "separate"  # the faster form wins
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "0")
    assert sf._dq_form(("k2",), forms, False, True) == "separate"  # pinned configs: deterministic
    monkeypatch.delenv("ATTNLAB_AUTOTUNE")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert sf._dq_form(("k3",), forms, False, True) == "separate"
    monkeypatch.setenv(sf.DQ_FORM_ENV, "one_pass")
    assert sf._dq_form(("k4",), forms, False, False) == "one_pass"  # a pin holds at any shape
    assert sf._dq_form(("k4",), forms, True, True) == "separate"
    monkeypatch.setenv(sf.DQ_FORM_ENV, "atomic")
    with pytest.raises(ValueError, match=sf.DQ_FORM_ENV):
        sf._dq_form(("k5",), forms, False, True)
