"""models/head_norms.py: the Triton RMSNorm over each head's D (natively on a GPU, the interpreter on CPU)
against float64 by the DESIGN.md §6 rule, and the model's three norms through it against their plain
torch forms."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_within_reference_error

import models.head_norms as hn
from models.gpt import GPT, AttnConfig, GPTConfig

# the kernels run where the tests run: CUDA tensors on a GPU, else CPU tensors under the interpreter
# (which mishandles bf16: bf16 is checked on the GPU)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
FLOOR = {torch.float32: 3e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
TINY = torch.finfo(torch.float32).tiny

# the model's three norms: (weights, keyword arguments) with D filled in
KINDS = {
    "l2": lambda d, dtype: ({}, dict(eps=TINY, scale=d ** -0.5)),
    "rms": lambda d, dtype: ({"weight": torch.float32, "second_weight": torch.float32},
                             dict(first_slots=2, period=3, eps=torch.finfo(torch.float32).eps,
                                  out_dtype=torch.float32)),
    "out": lambda d, dtype: ({"weight": dtype}, dict(eps=1e-5)),
    # not one of the model's: a weight and a scale together
    "scaled": lambda d, dtype: ({"weight": torch.float32}, dict(eps=1e-5, scale=0.3)),
}


def make_input(t: int, s: int, d: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """float64 (T, S, D): contiguous; "strided", a slice of wider tokens (stride over T not S*D, as the
    heads of the qkv projection); "d_strided", D not unit-stride; "batched", (2, T, S, D) sliced out of a
    wider tensor (two leading dims)."""
    if layout == "strided":
        return torch.randn(t, s + 3, d, generator=gen, dtype=torch.float64)[:, 2:s + 2]
    if layout == "d_strided":
        return torch.randn(t, d, s, generator=gen, dtype=torch.float64).transpose(1, 2)
    if layout == "batched":
        return torch.randn(2, t, s + 1, d, generator=gen, dtype=torch.float64)[:, :, 1:]
    return torch.randn(t, s, d, generator=gen, dtype=torch.float64)


def run(x64, weights64, kwargs, dy64, dtype, kernel):
    """(out, dx, *weight grads) of head_rms_norm on leaf copies in `dtype` (weights in their own
    dtype, float64 for the reference)."""
    x = x64.detach().to(DEVICE, dtype).requires_grad_()
    ws = {name: (w.to(DEVICE, dtype if dtype == torch.float64 else w.dtype)).detach().requires_grad_()
          for name, w in weights64.items()}
    out_dtype = kwargs.get("out_dtype")
    kw = {**kwargs, "out_dtype": torch.float64 if dtype == torch.float64 and out_dtype else out_dtype}
    out = hn.head_rms_norm(x, **ws, **kw, kernel=kernel)
    out.backward(dy64.to(DEVICE, out.dtype))
    return [out, x.grad] + [w.grad for w in ws.values()]


def case(kind, dtype, t, s, d, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x64 = make_input(t, s, d, layout, gen)
    wdtypes, kwargs = KINDS[kind](d, dtype)
    weights64 = {name: (torch.rand(d, generator=gen, dtype=torch.float64) + 0.5).to(wd).double()
                 for name, wd in wdtypes.items()}
    dy64 = torch.randn(x64.shape, generator=gen, dtype=torch.float64)
    return x64, weights64, kwargs, dy64


def check(kind, dtype, x64, weights64, kwargs, dy64):
    names = ["out", "dx"] + ["d" + name for name in weights64]
    got = run(x64, weights64, kwargs, dy64, dtype, kernel=True)
    same = run(x64, weights64, kwargs, dy64, dtype, kernel=False)
    ref64 = run(x64, weights64, kwargs, dy64, torch.float64, kernel=False)
    assert got[0].dtype == kwargs.get("out_dtype", dtype) and got[1].dtype == dtype
    for name, g, sm, r in zip(names, got, same, ref64):
        assert g.shape == r.shape, name
        assert_within_reference_error(f"{kind} {dtype} {name}", g, sm, r, FLOOR[dtype])
    return got, ref64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("t,s,d,layout", [(1, 3, 64, "contiguous"), (17, 9, 48, "strided"),
                                          (127, 3, 64, "strided"), (17, 3, 48, "d_strided"),
                                          (5, 9, 64, "batched")])
def test_kernel_matches_float64(kind, dtype, t, s, d, layout, nan_poison):
    check(kind, dtype, *case(kind, dtype, t, s, d, layout))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 l2 dx of a zero row
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["l2", "out"])
def test_rows_of_zeros_give_zero_and_no_nan(kind, dtype, nan_poison):
    """A head of zeros normalizes to zeros (eps keeps rstd finite: for l2 the float32 tiny); no NaN in
    the output or the input gradient, and the other rows still pass the rule."""
    x64, weights64, kwargs, dy64 = case(kind, dtype, 17, 3, 64, "strided", seed=1)
    x64[3] = 0.0
    x64[10, 1] = 0.0
    zero = (x64.abs().sum(-1) == 0).to(DEVICE)
    got = run(x64, weights64, kwargs, dy64, dtype, kernel=True)
    assert (got[0][zero] == 0).all() and not got[0].isnan().any()
    assert not got[1].isnan().any()
    ref64 = run(x64, weights64, kwargs, dy64, torch.float64, kernel=False)
    if dtype != torch.float16 or kind == "out":  # fp16 cannot hold the l2 gradient of a zero row (~1e18 g)
        # dy, the weight and dx are each rounded to 16 bits: up to three unit roundoffs from float64
        rtol = max(2e-3, 1.5 * torch.finfo(dtype).eps)
        torch.testing.assert_close(got[1][zero].double(), ref64[1][zero], rtol=rtol, atol=FLOOR[dtype])
    same = run(x64, weights64, kwargs, dy64, dtype, kernel=False)
    keep = ~zero
    for name, i in (("out", 0), ("dx", 1)):
        assert_within_reference_error(f"{kind} {name}", got[i][keep], same[i][keep], ref64[i][keep], FLOOR[dtype])
    for i in range(2, len(got)):
        assert_within_reference_error(f"{kind} dweight", got[i], same[i], ref64[i], FLOOR[dtype])


def test_default_eps_is_the_normalizing_dtypes_machine_epsilon():
    """eps=None: the machine epsilon of the dtype the plain form normalizes in, on both paths (rows of
    a tiny RMS show it: eps dominates the mean square)."""
    x = torch.full((4, 2, 16), 1e-4, device=DEVICE)
    ones = torch.ones(16, device=DEVICE)
    for kwargs in ({}, {"weight": ones, "second_weight": ones, "first_slots": 1, "period": 2}):
        plain = hn.head_rms_norm(x, **kwargs, kernel=False)
        fused = hn.head_rms_norm(x, **kwargs, kernel=True)
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=0)
        want = 1e-4 / (1e-8 + torch.finfo(torch.float32).eps) ** 0.5
        torch.testing.assert_close(fused, torch.full_like(x, want), rtol=1e-4, atol=0)


@pytest.mark.parametrize("dtype", [dt for dt in DTYPES if dt != torch.float32])
@pytest.mark.parametrize("kernel", [True, False])
def test_round_weight_is_the_weight_cast_to_the_output_dtype(dtype, kernel):
    """round_weight=True gives bit for bit what passing weight.to(out_dtype) gives: the output, dx and the
    fp32 weight's gradient (that of the cast), on the kernels (which round as they read the weight) and
    on the plain form; with second_weight it is refused."""
    gen = torch.Generator().manual_seed(3)
    x64 = torch.randn(2, 17, 3, 48, generator=gen, dtype=torch.float64)
    w64 = torch.rand(48, generator=gen, dtype=torch.float64) + 0.5
    dy = torch.randn(x64.shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)

    def grads(round_weight):
        x = x64.to(DEVICE, dtype).requires_grad_()
        w = w64.to(DEVICE, torch.float32).requires_grad_()
        out = hn.head_rms_norm(x, w if round_weight else w.to(dtype), eps=1e-5, round_weight=round_weight,
                               kernel=kernel)
        out.backward(dy)
        return out, x.grad, w.grad

    for name, got, want in zip(("out", "dx", "dweight"), grads(True), grads(False)):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    with pytest.raises(ValueError, match=r"round_weight serves one weight for every slot"):
        hn.head_rms_norm(x64.float(), torch.ones(48), second_weight=torch.ones(48), first_slots=1, period=3,
                         round_weight=True)


def test_bad_arguments_are_refused_by_name():
    x = torch.randn(3, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        hn.head_rms_norm(x, torch.ones(4))
    with pytest.raises(ValueError, match=r"second_weight must have shape \(8,\)"):
        hn.head_rms_norm(x, torch.ones(8), second_weight=torch.ones(8, 1), first_slots=1, period=2)
    with pytest.raises(ValueError, match=r"period must be > 0 and divide x's slot count 4, got 3"):
        hn.head_rms_norm(x, torch.ones(8), second_weight=torch.ones(8), first_slots=1, period=3)
    with pytest.raises(ValueError, match=r"first_slots must be in \[0, period=2\], got 3"):
        hn.head_rms_norm(x, torch.ones(8), second_weight=torch.ones(8), first_slots=3, period=2)
    with pytest.raises(ValueError, match=r"second_weight needs weight"):
        hn.head_rms_norm(x, second_weight=torch.ones(8), first_slots=1, period=2)
    with pytest.raises(ValueError, match=r"x must be a floating tensor"):
        hn.head_rms_norm(torch.ones(8))
    with pytest.raises(ValueError, match=r"kernel=True takes x and out_dtype in"):
        hn.head_rms_norm(x.double(), kernel=True)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The number of kernel forwards so far, the norm's and the norm-with-RoPE's (a list of one int)."""
    calls = [0]
    for function in (hn._HeadRMSNorm, hn._HeadNormRope):
        def counting(ctx, *args, forward=function.forward):
            calls[0] += 1
            return forward(ctx, *args)

        monkeypatch.setattr(function, "forward", staticmethod(counting))
    return calls


def test_plain_form_off_cuda_and_under_torch_compile(kernel_calls, monkeypatch):
    """Not forced, tensors of a device outside KERNEL_DEVICE_TYPES take the plain form; with the device
    counted as a kernel device an eager call takes the kernels, a traced one (torch.compile) still the
    plain form."""
    x = torch.randn(5, 3, 16, device=DEVICE)
    monkeypatch.setattr(hn, "KERNEL_DEVICE_TYPES", ())
    plain = hn.head_rms_norm(x, eps=TINY, scale=0.25)
    assert kernel_calls[0] == 0
    monkeypatch.setattr(hn, "KERNEL_DEVICE_TYPES", (DEVICE.type,))
    fused = hn.head_rms_norm(x, eps=TINY, scale=0.25)
    assert kernel_calls[0] == 1
    traced = torch.compile(lambda t: hn.head_rms_norm(t, eps=TINY, scale=0.25), backend="eager", fullgraph=True)(x)
    assert kernel_calls[0] == 1
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(traced, plain, rtol=0, atol=0)


MODELS = [("threshold", None, "l2"), ("sigmoid", None, "rms"), ("diff_threshold", None, "l2"),
          ("diff_threshold", "rms", "rms")]


@pytest.mark.parametrize("name,qk_norm,kind", MODELS)
def test_the_model_on_the_kernels_matches_the_plain_forms(name, qk_norm, kind, kernel_calls, monkeypatch):
    """A tiny GPT (GQA: 4 q heads, 2 kv heads; the differential variants two q/k views) gives the same
    logits and gradients with its norms on the kernels as on the plain forms, within
    fp32 rounding; every norm of every layer went through the kernels."""
    params = {"beta": 1.0, "power": 2.0} if "threshold" in name else {}
    cfg = GPTConfig(vocab_size=37, context=16, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                    attn=AttnConfig(name=name, backend="reference", params=params, qk_norm=qk_norm))
    torch.manual_seed(0)
    model = GPT(cfg).to(DEVICE)
    layer = model.blocks[0].attn
    assert layer.qk_norm == kind and layer.views == (2 if name.startswith("diff") else 1)
    for module in model.modules():  # weights away from 1, so a slot given the wrong weight shows
        if isinstance(module, torch.nn.RMSNorm) and module.weight is not None:
            module.weight.data.uniform_(0.5, 1.5)
    idx = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def logits_and_grads():
        model.zero_grad(set_to_none=True)
        logits = model(idx)
        logits.float().square().mean().backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    monkeypatch.setattr(hn, "KERNEL_DEVICE_TYPES", ())
    plain = logits_and_grads()
    assert kernel_calls[0] == 0
    monkeypatch.setattr(hn, "KERNEL_DEVICE_TYPES", (DEVICE.type,))
    fused = logits_and_grads()
    norms_per_layer = 1 + (layer.head_norm is not None)
    assert kernel_calls[0] == cfg.n_layer * norms_per_layer
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-5)
    assert fused[1].keys() == plain[1].keys()
    assert any("q_norm" in n for n in fused[1]) == (kind == "rms")
    for n in plain[1]:
        torch.testing.assert_close(fused[1][n], plain[1][n], rtol=1e-4, atol=1e-6, msg=n)


# head_norm_rope: the model's two QK-norm kinds, then RoPE, as one kernel each way
ROPE_KINDS = {
    "l2": lambda d: ({}, dict(eps=TINY, scale=d ** -0.5)),
    "rms": lambda d: ({"weight": torch.float32, "second_weight": torch.float32},
                      dict(first_slots=2, period=3, eps=None)),
}


def rope_case(kind, b, n, s, d, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(b, n, s + 2, d, generator=gen, dtype=torch.float64)
    x64 = wide[:, :, 1:s + 1] if layout == "strided" else wide[:, :, :s].contiguous()
    angles = torch.rand(n, d // 2, generator=gen, dtype=torch.float64) * 6.3
    wdtypes, kwargs = ROPE_KINDS[kind](d)
    weights64 = {name: torch.rand(d, generator=gen, dtype=torch.float64) + 0.5 for name in wdtypes}
    return x64, angles, weights64, kwargs, torch.randn(x64.shape, generator=gen, dtype=torch.float64)


def run_rope(x64, angles, weights64, kwargs, dy64, dtype, kernel):
    x = x64.detach().to(DEVICE, dtype).requires_grad_()
    ws = {name: w.to(DEVICE, torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
          for name, w in weights64.items()}
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = (f(angles).to(DEVICE, table_dtype) for f in (torch.cos, torch.sin))
    out = hn.head_norm_rope(x, cos, sin, **ws, **kwargs, out_dtype=dtype, kernel=kernel)
    out.backward(dy64.to(DEVICE, out.dtype))
    return [out, x.grad] + [w.grad for w in ws.values()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(ROPE_KINDS))
@pytest.mark.parametrize("b,n,s,d,layout", [(1, 1, 3, 64, "contiguous"), (2, 17, 3, 48, "strided"),
                                            (1, 127, 6, 64, "strided")])
def test_norm_and_rope_kernel_matches_float64(kind, dtype, b, n, s, d, layout, nan_poison):
    """out, dx and the weights' gradients of the fused QK-norm and RoPE against the plain form in float64,
    by the DESIGN.md rule (the plain form in the kernel's dtype as the yardstick), every position's row
    rotated by its own angles."""
    x64, angles, weights64, kwargs, dy64 = rope_case(kind, b, n, s, d, layout, seed=n + s)
    got = run_rope(x64, angles, weights64, kwargs, dy64, dtype, kernel=True)
    same = run_rope(x64, angles, weights64, kwargs, dy64, dtype, kernel=False)
    ref64 = run_rope(x64, angles, weights64, kwargs, dy64, torch.float64, kernel=False)
    assert got[0].dtype == dtype and got[1].dtype == dtype
    names = ["out", "dx"] + ["d" + name for name in weights64]
    for name, g, sm, r in zip(names, got, same, ref64):
        assert g.shape == r.shape, name
        assert_within_reference_error(f"{kind} {dtype} {name}", g, sm, r, FLOOR[dtype])


def test_the_rotation_is_the_rope_modules():
    """The fused form's rotation is the model's (models.gpt.RoPE) of the normalized heads."""
    from models.gpt import RoPE

    rope = RoPE(16, 10000.0, 32).to(DEVICE)
    x = torch.randn(2, 7, 3, 16, device=DEVICE)
    cos, sin = rope.table_rows(5, 7)
    fused = hn.head_norm_rope(x, cos, sin, eps=1e-6, kernel=True)
    torch.testing.assert_close(fused, rope(hn.head_rms_norm(x, eps=1e-6, kernel=False), 5), rtol=1e-5, atol=1e-5)


def test_norm_and_rope_refuses_bad_tables_and_arguments_by_name():
    x = torch.randn(2, 5, 3, 8, device=DEVICE)
    cos = torch.ones(5, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"cos must be a floating \(5, 4\) tensor"):
        hn.head_norm_rope(x, torch.ones(4, 4, device=DEVICE), cos)
    with pytest.raises(ValueError, match=r"sin must be a floating \(5, 4\) tensor"):
        hn.head_norm_rope(x, cos, torch.ones(5, 4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="even D"):
        hn.head_norm_rope(torch.randn(2, 5, 3, 7, device=DEVICE), cos, cos)
